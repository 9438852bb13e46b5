// fovea/clock.h: elapsed time on the monotonic clock, the one way fovea times its steps.
#pragma once
#include <chrono>

namespace fovea {

using Clock = std::chrono::steady_clock;

// Milliseconds from a to b (negative when b is earlier).
inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
// Milliseconds from t to now.
inline double ms_since(Clock::time_point t) { return ms_between(t, Clock::now()); }

// Seconds from a to b (negative when b is earlier).
inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
// Seconds from t to now.
inline double seconds_since(Clock::time_point t) { return seconds_between(t, Clock::now()); }

// s seconds as a Clock duration, for deadlines and timers (Clock::now() + from_seconds(timeout_s)).
inline Clock::duration from_seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace fovea
