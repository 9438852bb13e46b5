// A byte budget shared by threads: `fovea serve` reserves the memory an image will take to decode
// and preprocess before decoding it, so that concurrent requests cannot together exhaust the host.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "fovea/clock.h"

namespace fovea::server {

class ByteBudget {
 public:
  explicit ByteBudget(int64_t capacity) : capacity_(capacity) {}

  // Waits until `bytes` fit beside what is held, or until the deadline (false). Asking for more
  // than the capacity is the caller's error to report; it never fits.
  bool acquire(int64_t bytes, Clock::time_point deadline) {
    std::unique_lock lk(mu_);
    if (bytes > capacity_ || closed_) return false;
    if (!freed_.wait_until(lk, deadline, [&] { return closed_ || used_ + bytes <= capacity_; }) || closed_)
      return false;
    used_ += bytes;
    return true;
  }
  // From now on every acquire fails at once, those waiting too (the server is going away).
  void close() {
    {
      std::lock_guard lk(mu_);
      closed_ = true;
    }
    freed_.notify_all();
  }
  void release(int64_t bytes) {
    {
      std::lock_guard lk(mu_);
      used_ -= bytes;
    }
    freed_.notify_all();
  }
  int64_t capacity() const { return capacity_; }
  int64_t used() const {
    std::lock_guard lk(mu_);
    return used_;
  }

 private:
  const int64_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  int64_t used_ = 0;
  bool closed_ = false;
};

}  // namespace fovea::server
