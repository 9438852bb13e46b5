// Prometheus text exposition format 0.0.4 (see metrics.h).
#include "server/metrics.h"

#include <span>
#include <vector>

#include <fmt/format.h>

#include "server/endpoints.h"

namespace fovea::server {

namespace {

// Label values: backslash, double quote and newline escaped.
std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

// A metric with one unlabelled sample.
template <class T>
void sample(std::string& out, const char* name, const char* type, const char* help, const T& value) {
  header(out, name, type, help);
  out += fmt::format("{} {}\n", name, value);
}

// Unknown paths share one label so that probing clients cannot grow the metric without bound.
std::string path_label(const std::string& path) {
  for (const Endpoint& e : kEndpoints)
    if (path == e.path) return path;
  return "other";
}

// The sections of render(), in the order they appear. The first three read Metrics' own counters
// (private, so passed in, under its lock); the rest are read from the batcher and engine at scrape time.

void render_responses(std::string& out, const std::map<std::pair<std::string, int>, uint64_t>& responses) {
  header(out, "fovea_requests_total", "counter", "HTTP responses by path and status code.");
  for (const auto& [key, n] : responses)
    out += fmt::format("fovea_requests_total{{path=\"{}\",code=\"{}\"}} {}\n", key.first, key.second, n);
}

// `counts` per bucket (not cumulative), one more than `bounds`: the last is +Inf.
void render_latency(std::string& out, std::span<const double> bounds, std::span<const uint64_t> counts, double sum,
                    uint64_t count) {
  header(out, "fovea_request_duration_seconds", "histogram", "POST /v1/encode latency, head read to reply ready.");
  uint64_t cumulative = 0;
  for (size_t b = 0; b < bounds.size(); ++b) {
    cumulative += counts[b];
    out += fmt::format("fovea_request_duration_seconds_bucket{{le=\"{}\"}} {}\n", bounds[b], cumulative);
  }
  out += fmt::format("fovea_request_duration_seconds_bucket{{le=\"+Inf\"}} {}\n", count);
  out += fmt::format("fovea_request_duration_seconds_sum {}\n", sum);
  out += fmt::format("fovea_request_duration_seconds_count {}\n", count);
}

void render_phases(std::string& out, const std::array<double, kPhaseNames.size()>& seconds) {
  header(out, "fovea_encode_phase_seconds_total", "counter",
         "POST /v1/encode time by phase, summed over requests: read (head to body read), wait (for a worker), "
         "parse (JSON), decode (base64, decoding, preprocessing), encoder (queued and encoded), reply (building "
         "it), write (sending it).");
  for (size_t p = 0; p < kPhaseNames.size(); ++p)
    out += fmt::format("fovea_encode_phase_seconds_total{{phase=\"{}\"}} {}\n", kPhaseNames[p], seconds[p]);
}

// The batching worker's queue and encoder counters, all replicas together.
void render_worker(std::string& out, const Batcher& batcher, int64_t in_flight) {
  sample(out, "fovea_requests_in_flight", "gauge", "POST /v1/encode requests being handled.", in_flight);
  sample(out, "fovea_queue_depth", "gauge", "Requests waiting for the encoder (partly encoded ones included).",
         batcher.queue_depth());
  const uint64_t inputs = batcher.inputs_encoded();  // read once: the alias shows the same value
  sample(out, "fovea_inputs_encoded_total", "counter", "Inputs (images and clips) encoded.", inputs);
  sample(
      out, "fovea_images_encoded_total", "counter",
      "Deprecated alias of fovea_inputs_encoded_total (same value, images and clips); removed after the next release.",
      inputs);
  sample(out, "fovea_tokens_encoded_total", "counter", "Visual tokens (merger output rows) produced.",
         batcher.tokens_encoded());
  sample(out, "fovea_encoder_forwards_total", "counter", "Encoder forwards (batches) run.", batcher.forwards());
  sample(out, "fovea_encoder_failed_forwards_total", "counter", "Encoder forwards that threw.",
         batcher.failed_forwards());
  sample(
      out, "fovea_encoder_forward_seconds_total", "counter",
      "GPU time of the encoder forwards (pixel upload to outputs copied back, from CUDA events; wall time on the CPU).",
      batcher.forward_seconds());
}

// Per encoder replica (fovea serve --devices / --workers), labelled by device.
void render_replicas(std::string& out, const std::vector<ReplicaState>& replicas) {
  const auto per_replica = [&](const char* name, const char* type, const char* help, auto value) {
    header(out, name, type, help);
    for (const ReplicaState& r : replicas) out += fmt::format("{}{{device=\"{}\"}} {}\n", name, r.name, value(r));
  };
  per_replica("fovea_device_up", "gauge",
              "1 while the encoder replica on this device is in rotation, 0 once taken out.",
              [](const ReplicaState& r) { return int(r.up); });
  per_replica("fovea_device_forwards_total", "counter", "Encoder forwards run on this device.",
              [](const ReplicaState& r) { return r.forwards; });
  per_replica("fovea_device_inputs_encoded_total", "counter", "Inputs (images and clips) encoded on this device.",
              [](const ReplicaState& r) { return r.inputs; });
  per_replica("fovea_device_images_encoded_total", "counter",
              "Deprecated alias of fovea_device_inputs_encoded_total (same value); removed after the next release.",
              [](const ReplicaState& r) { return r.inputs; });
  per_replica("fovea_device_tokens_encoded_total", "counter", "Visual tokens produced on this device.",
              [](const ReplicaState& r) { return r.tokens; });
  per_replica("fovea_device_forward_seconds_total", "counter", "Forward time on this device.",
              [](const ReplicaState& r) { return r.forward_seconds; });
  per_replica("fovea_device_failed_forwards_total", "counter", "Encoder forwards that threw on this device.",
              [](const ReplicaState& r) { return r.failed_forwards; });
}

// Info-style gauges (value 1): what the engine is, in labels.
void render_engine(std::string& out, const std::string& model, const EngineConfig& engine) {
  header(out, "fovea_engine_info", "gauge", "The engine this server runs (value 1).");
  out += fmt::format("fovea_engine_info{{model=\"{}\",device=\"{}\",backend=\"{}\",dtype=\"{}\"}} 1\n", label(model),
                     device_name(engine.device), backend_name(engine.backend), dtype_name(engine.dtype));
  header(out, "fovea_fp8_scale_mode", "gauge", "FP8 attention scale mode (value 1); \"none\" for BF16 attention.");
  out += fmt::format("fovea_fp8_scale_mode{{mode=\"{}\"}} 1\n",
                     engine.scale_mode ? scale_mode_name(*engine.scale_mode) : "none");
}

// The encoder cache (--ec-storage-path).
void render_cache(std::string& out, const EcCache::Stats& s) {
  sample(out, "fovea_ec_cache_bytes", "gauge", "Bytes of the encoder cache files fovea wrote (--ec-storage-path).",
         s.bytes);
  sample(out, "fovea_ec_cache_files", "gauge", "Encoder cache files fovea wrote and holds.", s.files);
  sample(out, "fovea_ec_cache_foreign_files", "gauge", "Encoder cache files of other writers (never deleted).",
         s.foreign_files);
  sample(out, "fovea_ec_cache_hits_total", "counter", "Images found in the encoder cache (not encoded).", s.hits);
  sample(out, "fovea_ec_cache_misses_total", "counter", "Images not in the encoder cache (encoded and written).",
         s.misses);
  sample(out, "fovea_ec_cache_writes_total", "counter", "Encoder cache files written.", s.writes);
  sample(out, "fovea_ec_cache_evictions_total", "counter",
         "Encoder cache files fovea deleted to stay within --ec-storage-max-bytes.", s.evictions);
  sample(out, "fovea_ec_cache_refused_total", "counter",
         "Encoder cache writes refused (nothing written) because files used less than --ec-storage-min-age ago "
         "fill --ec-storage-max-bytes.",
         s.refused);
  sample(out, "fovea_ec_cache_young_kept_total", "counter",
         "Encoder cache files least-recently-used eviction would have deleted but kept, used less than "
         "--ec-storage-min-age ago (per file, per write or start-up).",
         s.young_kept);
  sample(out, "fovea_ec_cache_vanished_total", "counter",
         "Encoder cache files of fovea's found deleted or replaced by someone else.", s.vanished);
  sample(out, "fovea_ec_cache_load_failures_total", "counter",
         "Encoder cache files that could not be read back (the image was encoded again).", s.load_failures);
}

}  // namespace

void Metrics::count_response(const std::string& path, int status) {
  std::lock_guard lk(mu_);
  responses_[{path_label(path), status}] += 1;
}

void Metrics::observe_encode_seconds(double s) {
  size_t b = 0;
  while (b < kBuckets.size() && s > kBuckets[b]) ++b;
  std::lock_guard lk(mu_);
  bucket_counts_[b] += 1;
  latency_sum_ += s;
  latency_count_ += 1;
}

void Metrics::add_phase(Phase p, double seconds) {
  std::lock_guard lk(mu_);
  phase_seconds_[size_t(p)] += seconds;
}

std::string Metrics::render(const std::string& model, const EngineConfig& engine, const Batcher& batcher,
                            int64_t in_flight, const EcCache* cache) const {
  std::string out;
  {
    std::lock_guard lk(mu_);  // the series this class counts itself, read as one snapshot
    render_responses(out, responses_);
    render_latency(out, kBuckets, bucket_counts_, latency_sum_, latency_count_);
    render_phases(out, phase_seconds_);
  }
  render_worker(out, batcher, in_flight);
  render_replicas(out, batcher.replicas());
  render_engine(out, model, engine);
  if (cache) render_cache(out, cache->stats());
  sample(out, "fovea_fp8_nonfinite_amax_total", "counter",
         "Non-finite amax values the FP8 scale book ignored, all layers (docs/fp8.md §Dynamic scaling).",
         batcher.nonfinite_amax());
  header(out, "fovea_fp8_static_guard_total", "counter",
         "Times the static FP8 scales' guard switched a layer's q, k or v to the batch's own scale: the inputs "
         "passed the scale file's range, which would have clipped (docs/fp8.md §Static guard).");
  const GuardCounts g = batcher.static_guarded();
  for (const auto& [t, n] : {std::pair{"q", g.q}, std::pair{"k", g.k}, std::pair{"v", g.v}})
    out += fmt::format("fovea_fp8_static_guard_total{{tensor=\"{}\"}} {}\n", t, n);
  sample(out, "fovea_encoder_graph_replays_total", "counter",
         "Forwards replayed through an encoder CUDA graph (--compilation-config cudagraph_mm_encoder).",
         batcher.graph_replays());
  sample(out, "fovea_encoder_graph_eager_total", "counter",
         "Forwards run eagerly with encoder CUDA graphs on: the batch fit no budget.", batcher.graph_eager());
  return out;
}

}  // namespace fovea::server
