// fovea/threads.h: a minimal parallel loop for CPU work (reference attention, image decoding).
#pragma once
#include <cstdint>
#include <functional>

namespace fovea {

// Number of worker threads to use when a caller asks for 0 ("all").
int hardware_threads();

// Names the calling thread (at most 15 characters are kept), as top -H and /proc/PID/task show it.
void name_this_thread(const char* name);
// Lowers this thread's scheduling priority by `nice` steps (threads it starts inherit it): a server's
// bulk work (decoding, encoding) yields the cores to its network thread, so probes are answered
// while the CPU is saturated. Raising the nice value needs no privilege; a failure is ignored.
void lower_this_thread_priority(int nice);

// Calls fn(i) for every i in [0, n) on up to `threads` threads (0: all), handing out chunks of
// `grain` indices dynamically so uneven work balances. The first exception thrown by fn is
// rethrown in the caller after all threads stop. It never uses more threads than the calling
// thread's cap (ThreadCap; none: hardware_threads()), and its threads share that cap among them, so
// nested loops (images in parallel, each resized in parallel) do not multiply threads.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int threads = 0, int64_t grain = 1);

// Caps the threads parallel_for starts from this thread while it lives (at least 1): a server
// decoding many requests at once gives each a share of the cores instead of all of them.
class ThreadCap {
 public:
  explicit ThreadCap(int threads);
  ~ThreadCap();
  ThreadCap(const ThreadCap&) = delete;
  ThreadCap& operator=(const ThreadCap&) = delete;
  static int current();  // this thread's cap: hardware_threads() when none is set

 private:
  int previous_;
};

// Calls fn(begin, end) for consecutive ranges of at most `grain` indices that cover [0, n), on all
// threads: for element-wise loops over large arrays.
void parallel_ranges(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace fovea
