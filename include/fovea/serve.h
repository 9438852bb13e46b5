// fovea/serve.h: `fovea serve`'s options and entry point: an HTTP front end (src/server/http.h) over
// one batching worker per encoder replica (src/server/batcher.h).
//   POST /v1/encode   images and video clips (data URLs, base64, or OpenAI image_url / video_url
//                     content parts; clips and images packed into the same forwards) -> visual tokens
//                     as JSON (bf16 base64 or float lists) or, with Accept: application/octet-stream,
//                     the safetensors file `fovea encode -o` would write
//   POST /v1/chat/completions   with --ec-storage-path: vLLM's EPD proxy's request to an encode
//                     instance; writes vLLM's encoder-cache files, answers their grids
//   GET  /health (live: an encoder replica is up), GET /ready (taking requests: not stopping, queue
//   not full), GET /v1/models, GET /metrics (Prometheus; per-replica series by device)
// Every failure of a request is answered with {"error": {"message", "type", "code"}} and an HTTP
// status; the server itself survives any request. SIGINT / SIGTERM: /ready turns 503 at once, the
// server serves on for --drain-seconds, then stops accepting, answers every request whose body was
// read (within --shutdown-timeout; what has not finished by then gets 503 at once), 503 to those still
// arriving, and returns 0.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/video.h"

namespace fovea::server {

// The HTTP layer's bounds (--max-header-bytes, --max-body-bytes, the deadlines, ...).
struct HttpLimits {
  size_t max_header_bytes = 16 << 10;  // request line + header fields + CRLFs
  size_t max_header_fields = 100;
  size_t max_body_bytes = size_t(64) << 20;           // one request's body, any transfer encoding
  size_t max_body_bytes_in_flight = size_t(1) << 30;  // bodies being read or handled, all connections
  double header_timeout_s = 10;                       // first byte of a request -> end of its head
  double body_timeout_s = 60;                         // end of the head -> end of the body
  double keep_alive_timeout_s = 5;                    // idle between requests, then closed
  double write_timeout_s = 60;                        // writing one reply
  double shutdown_grace_s = 1;                        // on shutdown: how long requests still arriving get 503
  double drain_delay_s = 0;                           // on SIGTERM: serve on this long with /ready at 503 first
  double shutdown_timeout_s = 25;                     // then: requests in flight get this long, the rest 503 at once
  size_t max_connections = 1024;                      // more are answered 503 and closed
};

struct ServeOptions {
  std::string model;  // checkpoint folder or synthetic:<preset>
  // --served-model-name (vLLM's flag): the name requests give in "model" and replies carry; "" means
  // the MODEL argument itself.
  std::string served_model_name;
  const std::string& served_name() const { return served_model_name.empty() ? model : served_model_name; }
  std::string host = "127.0.0.1";
  int port = 8000;                   // 0: any free port (the one taken is printed)
  int64_t max_batch_tokens = 16384;  // visual tokens per forward (an image larger runs alone)
  size_t max_queue = 64;             // requests waiting; more get 503
  int64_t max_queue_tokens = 65536;  // visual tokens waiting (their pixels are held: ~24 KB
                                     // each); more get 503, but an idle queue takes any request
  size_t max_images_per_request = 16;
  image::PreprocessOverrides preprocess;        // resize budget (0: the checkpoint's), bomb guard
  video::VideoOverrides video;                  // clips: fps, video budget, frames, length (0: the checkpoint's)
  double request_timeout_s = 120;               // head read to reply; later gets 504
  int threads = 32;                             // worker threads (each handles one request's body)
  HttpLimits http;                              // the HTTP layer's bounds (--max-body-bytes, deadlines, ...)
  int64_t max_decode_bytes = int64_t(2) << 30;  // images being decoded and preprocessed; more wait
  std::string ec_storage_path;                  // vLLM's encoder cache folder (fovea/ec-cache.h); "" = none
  int64_t ec_storage_max_bytes = 0;             // bound on fovea's files there (0: none)
  double ec_storage_min_age_s = 300;            // files used more recently are never evicted (0: none)
  // Items given by URL (server/media-url.h): file:// below this folder ("" = none, vLLM's flag);
  // http(s):// from these hosts (vLLM's flag; "*" = any; none = no fetching), public addresses only
  // unless allow_private_media_urls; each fetch within media_fetch_timeout_s.
  std::string allowed_local_media_path;
  std::vector<std::string> allowed_media_domains;
  bool allow_private_media_urls = false;
  double media_fetch_timeout_s = 30;
  std::string devices;  // --devices 0,1,... | all: one encoder replica per GPU ("": one, on GPU 0)
  int workers = 1;      // --workers N: encoder replicas on the CPU (--device cpu)
  EngineOptions engine;
};

// Whether this build fetches http(s) media URLs (libcurl was found at build time).
bool http_media_supported();

// Runs the server until SIGINT or SIGTERM; returns the exit code. Startup errors (options, model,
// engine, port) throw fovea::Error.
int serve(const ServeOptions& options);

}  // namespace fovea::server
