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

#include "fovea/ec-cache.h"
#include "fovea/engine.h"
#include "server/batcher.h"
#include "server/endpoints.h"  // the paths it labels, the router's too

namespace fovea::server {

// Where a POST /v1/encode request's time goes, in order: read (head read to body read), wait (for
// a worker thread), parse (the JSON body), decode (base64, image decoding and preprocessing, waiting
// for decode memory included), encoder (queued and encoded), reply (building the reply body), write
// (handing it to the client). Summed over requests: a load test reads the mean of each.
enum class Phase { READ, WAIT, PARSE, DECODE, ENCODER, REPLY, WRITE };
inline constexpr std::array<const char*, 7> kPhaseNames = {"read",    "wait",  "parse", "decode",
                                                           "encoder", "reply", "write"};

class Metrics {
 public:
  void count_response(const std::string& path, int status);  // every response, any path
  void observe_encode_seconds(double s);                     // every /v1/encode response
  void add_phase(Phase p, double seconds);

  // `cache` (null without --ec-storage-path) adds the encoder cache's series.
  std::string render(const std::string& model, const EngineConfig& engine, const Batcher& batcher, int64_t in_flight,
                     const EcCache* cache = nullptr) const;

 private:
  // Upper bounds of the latency buckets, seconds (+Inf implied): a tiny CPU model answers in
  // milliseconds, several 4K images on a GPU in about a second, a deep queue in tens.
  static constexpr std::array<double, 14> kBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                      1,     2.5,  5,     10,   30,  60,   120};
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> responses_;
  std::array<uint64_t, kBuckets.size() + 1> bucket_counts_{};  // per bucket, not cumulative; last: +Inf
  std::array<double, kPhaseNames.size()> phase_seconds_{};
  double latency_sum_ = 0;
  uint64_t latency_count_ = 0;
};

}  // namespace fovea::server
