// parallel_for: dynamic chunking over std::thread; exceptions cross back to the caller.
#include "fovea/threads.h"

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fovea {

int hardware_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

void name_this_thread(const char* name) {
  char n[16] = {};
  for (size_t i = 0; i < sizeof n - 1 && name[i]; ++i) n[i] = name[i];
  pthread_setname_np(pthread_self(), n);
}

void lower_this_thread_priority(int nice) {
  const pid_t tid = ::gettid();
  errno = 0;
  const int now = ::getpriority(PRIO_PROCESS, id_t(tid));
  if (errno == 0) ::setpriority(PRIO_PROCESS, id_t(tid), std::min(19, now + nice));
}

namespace {
thread_local int tl_cap = 0;  // 0: none
}  // namespace

ThreadCap::ThreadCap(int threads) : previous_(tl_cap) { tl_cap = std::max(1, threads); }
ThreadCap::~ThreadCap() { tl_cap = previous_; }
int ThreadCap::current() { return tl_cap > 0 ? tl_cap : hardware_threads(); }

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int threads, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t chunks = (n + grain - 1) / grain;
  const int cap = ThreadCap::current();
  const int t = int(std::min<int64_t>(threads > 0 ? std::min(threads, cap) : cap, chunks));
  const int share = std::max(1, cap / std::max(1, t));  // what each thread may start in turn
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  const std::thread::id caller = std::this_thread::get_id();
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    ThreadCap nested(share);
    if (std::this_thread::get_id() != caller) name_this_thread("fovea-parallel");
    for (;;) {
      const int64_t c = next.fetch_add(1);
      if (c >= chunks || stop.load(std::memory_order_relaxed)) return;
      try {
        for (int64_t i = c * grain, e = std::min(n, i + grain); i < e; ++i) fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        stop = true;
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int i = 1; i < t; ++i) pool.emplace_back(work);
  } catch (...) {  // could not start a thread (resource limits): work on with the ones that started
  }
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

void parallel_ranges(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  parallel_for((n + grain - 1) / grain, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

}  // namespace fovea
