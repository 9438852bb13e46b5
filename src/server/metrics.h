// Prometheus text-format metrics of `fovea serve` (GET /metrics): responses by path and status code,
// the /v1/encode latency histogram, and, read at scrape time, the batching worker's queue and
// encoder counters and the engine (device, dtype, FP8 scale mode, non-finite amax values ignored).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "fovea/engine.h"
#include "server/batcher.h"

namespace fovea::server {

class Metrics {
 public:
  void count_response(const std::string& path, int status);  // every response, any path
  void observe_encode_seconds(double s);                     // every /v1/encode response

  std::string render(const std::string& model, const EngineConfig& engine, const Batcher& batcher,
                     int64_t in_flight) const;

 private:
  // Upper bounds of the latency buckets, seconds (+Inf implied): a tiny CPU model answers in
  // milliseconds, several 4K images on a GPU in about a second, a deep queue in tens.
  static constexpr std::array<double, 14> kBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                      1,     2.5,  5,     10,   30,  60,  120};
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> responses_;
  std::array<uint64_t, kBuckets.size() + 1> bucket_counts_{};  // per bucket, not cumulative; last: +Inf
  double latency_sum_ = 0;
  uint64_t latency_count_ = 0;
};

}  // namespace fovea::server
