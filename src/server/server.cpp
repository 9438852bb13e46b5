// `fovea serve`: the endpoints and the server's lifecycle (see fovea/serve.h). The HTTP layer
// (http.h) reads a request; the bodies of POST /v1/encode and POST /v1/chat/completions are handled
// on a worker thread (encode.h); the other endpoints answer from the request's head.
#include "fovea/serve.h"

#include <malloc.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "fovea/clock.h"
#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/json.h"
#include "fovea/lists.h"
#include "fovea/pipeline.h"
#include "fovea/system.h"
#include "server/batcher.h"
#include "server/encode.h"
#include "server/endpoints.h"
#include "server/http.h"
#include "server/media-url.h"
#include "server/metrics.h"

namespace fovea::server {

namespace {

// The endpoints, on top of the HTTP layer (http.h).
class Service final : public http::Handler {
 public:
  explicit Service(Context& c) : c_(c) {}

  std::optional<http::Response> route(const http::Request& req) override {
    static const std::map<std::string, std::string> kAllowed = endpoint_methods();
    const auto known = kAllowed.find(req.path);
    if (known == kAllowed.end())
      return error_response(
          {404, "not_found",
           fmt::format("no endpoint {} {} (endpoints: {})", req.method, quote_for_error(req.path), endpoint_list())});
    if (req.method != known->second) {
      http::Response r = error_response(
          {405, "method_not_allowed",
           fmt::format("{} {}: this endpoint takes {}", req.method.substr(0, 32), req.path, known->second)});
      r.headers.push_back({"Allow", known->second});
      return r;
    }
    if (req.path == "/health") {
      // Live: the process answers and an encoder replica is up (each one's state listed). The server
      // listens only once every replica has loaded its weights and reserved its memory.
      json devices = json::array();
      for (const ReplicaState& r : c_.batcher.replicas()) {
        json d = {{"device", r.name}, {"up", r.up}};
        if (!r.up) d["reason"] = r.down_reason;
        devices.push_back(std::move(d));
      }
      const bool live = c_.batcher.replicas_up() > 0;
      return json_response(live ? 200 : 503, {{"status", live ? "ok" : "down"}, {"devices", std::move(devices)}});
    }
    if (req.path == "/ready") {
      // Ready: taking requests (not stopping, a replica up, the encoder queue not full).
      if (c_.http->stopping())
        return json_response(503, {{"status", "stopping"}, {"reason", "the server is shutting down"}});
      if (c_.batcher.replicas_up() == 0)
        return json_response(503, {{"status", "down"}, {"reason", "no encoder device is up"}});
      const size_t depth = c_.batcher.queue_depth();
      if (depth >= c_.opt.max_queue)
        return json_response(
            503, {{"status", "busy"}, {"reason", fmt::format("the encoder queue is full ({} requests)", depth)}});
      return json_response(200, {{"status", "ready"}});
    }
    if (req.path == "/v1/models") {
      const json model = {
          {"id", c_.opt.served_name()}, {"object", "model"}, {"created", c_.started_unix}, {"owned_by", "fovea"}};
      return json_response(200, {{"object", "list"}, {"data", json::array({model})}});
    }
    if (req.path == "/metrics")
      return http::Response{
          200,
          "text/plain; version=0.0.4; charset=utf-8",
          c_.metrics.render(c_.opt.served_name(), c_.engine, c_.batcher, int64_t(c_.http->in_flight()), c_.cache),
          {}};
    if (req.header("content-type").starts_with("multipart/"))
      return error_response({415, "unsupported_media_type",
                             "multipart bodies are not accepted: POST the JSON object (application/json)"});
    return std::nullopt;  // POST /v1/encode or /v1/chat/completions: read the body, then handle()
  }

  void handle(http::Request& req, Reply reply) override {
    Reply observed = [this, t0 = req.received, reply = std::move(reply)](http::Response res) {
      c_.metrics.observe_encode_seconds(ms_since(t0) / 1000);
      reply(std::move(res));
    };
    if (req.path == "/v1/chat/completions")
      chat(c_, req, std::move(observed));
    else
      encode(c_, req, std::move(observed));
  }

  // Shutdown's timeout passed: nothing waits any longer (the HTTP layer has answered 503 already).
  void abandon() override {
    c_.abandoned = true;
    c_.batcher.abort("the server is shutting down");
    c_.decode_budget.close();
    c_.fetch_budget.close();
    if (c_.media) c_.media->abort_fetches({503, "shutting_down", "the server is shutting down"});
  }

  http::Response error(int status, const std::string& code, const std::string& message) override {
    return error_response({status, code, message});
  }

  void replied(const http::Request& req, int status) override {
    c_.metrics.count_response(req.path, status);
    if (req.handling == Clock::time_point{}) return;  // answered from its head, or by the layer
    c_.metrics.add_phase(Phase::READ, seconds_between(req.received, req.body_read));
    c_.metrics.add_phase(Phase::WAIT, seconds_between(req.body_read, req.handling));
    c_.metrics.add_phase(Phase::WRITE, seconds_between(req.ready, Clock::now()));
  }

 private:
  Context& c_;
};

// ---- lifecycle ------------------------------------------------------------------------------------

void check_options(const ServeOptions& o) {
  if (o.port < 0 || o.port > 65535) fail("--port {} is not a port number (0 picks a free one)", o.port);
  if (o.max_batch_tokens < 1) fail("--max-batch-tokens must be at least 1, not {}", o.max_batch_tokens);
  if (o.max_queue < 1) fail("--max-queue must be at least 1");
  if (o.max_queue_tokens < 1) fail("--max-queue-tokens must be at least 1");
  if (o.http.max_body_bytes < 1) fail("--max-body-bytes must be at least 1");
  if (o.max_images_per_request < 1) fail("--max-images-per-request must be at least 1");
  if (o.threads < 1 || o.threads > 4096) fail("--threads must be in [1, 4096], not {}", o.threads);
  // Deadlines: positive and finite, at most a day (a timer of 1e300 s would overflow).
  for (const auto& [flag, v] : {std::pair{"--header-timeout", o.http.header_timeout_s},
                                {"--body-timeout", o.http.body_timeout_s},
                                {"--keep-alive-timeout", o.http.keep_alive_timeout_s},
                                {"--request-timeout", o.request_timeout_s}})
    if (!(v > 0 && v <= 86400)) fail("{} must be in (0, 86400] seconds, not {}", flag, v);
  if (o.http.max_header_bytes < 256 || o.http.max_header_bytes > (size_t(1) << 20))
    fail("--max-header-bytes must be in [256, 1048576], not {}", o.http.max_header_bytes);
  if (o.http.max_connections < 1 || o.http.max_connections > 1000000)
    fail("--max-connections must be in [1, 1000000], not {}", o.http.max_connections);
  if (o.http.max_body_bytes_in_flight < o.http.max_body_bytes)
    fail("--max-body-bytes-in-flight ({}) must be at least --max-body-bytes ({})", o.http.max_body_bytes_in_flight,
         o.http.max_body_bytes);
  if (o.max_decode_bytes < 1) fail("--max-decode-bytes must be at least 1");
  if (o.workers < 1 || o.workers > 256) fail("--workers must be in [1, 256], not {}", o.workers);
  if (!(o.http.drain_delay_s >= 0 && o.http.drain_delay_s <= 3600))
    fail("--drain-seconds must be in [0, 3600], not {}", o.http.drain_delay_s);
  if (!(o.http.shutdown_timeout_s >= 0 && o.http.shutdown_timeout_s <= 3600))
    fail("--shutdown-timeout must be in [0, 3600], not {}", o.http.shutdown_timeout_s);
}

std::vector<std::string> replica_names(const std::vector<ReplicaSpec>& rs) {
  std::vector<std::string> v;
  for (const ReplicaSpec& r : rs) v.push_back(r.name);
  return v;
}

// The encoder replicas: --workers on the CPU, or one per GPU of --devices (GPU 0 when empty), each
// GPU checked to run the engine as it was resolved (the same backend).
std::vector<ReplicaSpec> replica_specs(const ServeOptions& o, const EngineConfig& engine, const SystemInfo& sys) {
  std::vector<ReplicaSpec> out;
  if (engine.device == Device::CPU) {
    if (!o.devices.empty()) fail("--devices {}: the engine runs on the CPU; --workers N sets its replicas", o.devices);
    for (int i = 0; i < o.workers; ++i) out.push_back({fmt::format("cpu:{}", i), -1});
    return out;
  }
  if (o.workers != 1)
    fail("--workers is for --device cpu; on GPUs, --devices 0,1,... or all gives one replica per GPU");
  std::vector<int> gpus;
  if (o.devices.empty()) {
    gpus = {0};
  } else if (o.devices == "all") {
    for (const GpuInfo& g : sys.gpus) gpus.push_back(g.index);
  } else {
    for (const std::string& item : split_list(o.devices)) {
      const std::optional<int> v = parse_int(item);
      if (!v || *v < 0) fail("--devices {}: '{}' is not a GPU index (a list such as 0,1, or all)", o.devices, item);
      if (std::find(gpus.begin(), gpus.end(), *v) != gpus.end())
        fail("--devices {}: GPU {} is listed twice", o.devices, *v);
      gpus.push_back(*v);
    }
  }
  if (gpus.empty()) fail("--devices {}: no GPU is visible", o.devices);
  for (const int g : gpus) {
    const auto it = std::find_if(sys.gpus.begin(), sys.gpus.end(), [&](const GpuInfo& i) { return i.index == g; });
    if (it == sys.gpus.end()) fail("--devices {}: there is no GPU {} ({} visible)", o.devices, g, sys.gpus.size());
    SystemInfo alone = sys;  // the engine as this GPU alone would resolve it
    alone.gpus = {*it};
    EngineConfig here;
    try {
      here = resolve_engine(o.engine, alone);
    } catch (const Error& e) {
      fail("--devices: GPU {} ({}) cannot run this engine: {}", g, it->name, e.what());
    }
    if (here.backend != engine.backend)
      fail(
          "--devices: GPU {} ({}) would run the {} backend, GPU {} the {} one; give GPUs of one kind or "
          "--mm-encoder-attn-backend",
          g, it->name, backend_name(here.backend), gpus[0], backend_name(engine.backend));
    out.push_back({fmt::format("cuda:{}", g), g});
  }
  return out;
}

}  // namespace

int serve(const ServeOptions& o) {
  check_options(o);
  // Buffers of 1 MiB and more (bodies, fetched media, decoded pixels) are mapped on their own and
  // unmapped when freed, so what a burst of requests held goes back to the system; by default glibc
  // raises this threshold as such buffers are freed, and later ones stay in its arenas.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const MediaSources media(o);
  const SystemInfo sys = query_system();
  const EngineConfig engine = resolve_engine(o.engine, sys);
  const std::vector<ReplicaSpec> replicas = replica_specs(o, engine, sys);
  if (replicas.size() > 1 && engine.scale_mode == ScaleMode::CALIBRATE)
    fail(
        "--mm-encoder-fp8-scale-save-path: calibration runs on one encoder replica (its 16 forwards make one "
        "file); calibrate without --devices / --workers, then serve the file with --mm-encoder-fp8-scale-path");
  InputConfig inputs = load_input_config(o.model, o.preprocess, o.video);
  const qwen3vl::Model model = qwen3vl::load_model(o.model);
  std::optional<EcCache> cache;
  if (!o.ec_storage_path.empty()) cache.emplace(o.ec_storage_path, o.ec_storage_max_bytes, o.ec_storage_min_age_s);
  Batcher batcher(model, engine, replicas, o.max_queue, o.max_queue_tokens, o.max_batch_tokens);
  Context c(o, model, engine, std::move(inputs), batcher);
  if (cache) c.cache = &*cache;
  c.media = &media;
  Service service(c);

  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, nullptr);  // a client hanging up must not kill the server
  http::Options ho;
  ho.host = o.host;
  ho.port = o.port;
  ho.threads = o.threads;
  ho.limits = o.http;
  ho.limits.write_timeout_s = o.http.body_timeout_s;
  http::Server server(ho, service);
  c.http = &server;

  const auto& cfg = model.config;
  fmt::print(
      "fovea serve: model {} ({} blocks, out_hidden {}), {} attention{} on {} ({} backend); "
      "batches of up to {} tokens, queue of {} requests; {} encoder replica(s): {}\n",
      o.model, cfg.depth, cfg.out_hidden, dtype_name(engine.dtype),
      engine.scale_mode ? fmt::format(" ({} scales)", scale_mode_name(*engine.scale_mode)) : "",
      device_name(engine.device), backend_name(engine.backend), o.max_batch_tokens, o.max_queue, replicas.size(),
      fmt::join(replica_names(replicas), ", "));
  if (engine.dtype == AttnDtype::FP8)
    fmt::print("fovea serve: FP8 attention: {}\n", engine.fp8_plan(cfg.depth, cfg.heads, cfg.head_dim()).describe());
  if (cache) {
    const EcCache::Stats s = cache->stats();
    fmt::print(
        "fovea serve: encoder cache {} (vLLM's ECExampleConnector layout): {} files of fovea's ({:.1f} MB{}), "
        "{} of other writers{}\n",
        o.ec_storage_path, s.files, double(s.bytes) / 1e6,
        o.ec_storage_max_bytes ? fmt::format(" of at most {:.1f}", double(o.ec_storage_max_bytes) / 1e6) : "",
        s.foreign_files,
        o.ec_storage_min_age_s > 0 ? fmt::format("; none used in the last {:g} s is evicted", o.ec_storage_min_age_s)
                                   : "");
  }
  fmt::print("fovea serve: URL items: data: always; {}\n", media.describe());
  const bool v6 = o.host.find(':') != std::string::npos;
  fmt::print("fovea serve: listening on http://{}{}{}:{}\n", v6 ? "[" : "", o.host, v6 ? "]" : "", server.port());
  std::fflush(stdout);

  const double drain_s = o.http.drain_delay_s;
  server.run([drain_s](int sig, size_t in_flight) {  // on the network thread; std::printf, nothing that throws
    if (drain_s > 0)
      std::printf(
          "fovea serve: %s: /ready says 503; serving on for %g s, then not accepting new connections and "
          "finishing the requests in flight (%zu now)\n",
          strsignal(sig), drain_s, in_flight);
    else
      std::printf("fovea serve: %s: not accepting new connections; finishing %zu request(s) in flight\n",
                  strsignal(sig), in_flight);
    std::fflush(stdout);
  });
  batcher.stop();  // every reply is written; nothing is left queued, but finish it if so
  fmt::print("fovea serve: stopped ({} inputs encoded)\n", batcher.inputs_encoded());
  std::fflush(stdout);
  return 0;
}

}  // namespace fovea::server
