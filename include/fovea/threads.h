// fovea/threads.h: a minimal parallel loop for CPU work (reference attention, image decoding).
#pragma once
#include <cstdint>
#include <functional>

namespace fovea {

// Number of worker threads to use when a caller asks for 0 ("all").
int hardware_threads();

// Calls fn(i) for every i in [0, n) on up to `threads` threads (0: all), handing out chunks of
// `grain` indices dynamically so uneven work balances. The first exception thrown by fn is
// rethrown in the caller after all threads stop.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, int threads = 0, int64_t grain = 1);

// Calls fn(begin, end) for consecutive ranges of at most `grain` indices that cover [0, n), on all
// threads: for element-wise loops over large arrays.
void parallel_ranges(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace fovea
