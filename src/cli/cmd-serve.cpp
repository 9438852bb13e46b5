// fovea serve MODEL [--host 127.0.0.1] [--port 8000] [limits] [engine flags]: the HTTP encoder
// service (src/server/). Runs until SIGINT or SIGTERM, then finishes the requests in flight.
#include "cli/commands.h"
#include "fovea/ec-cache.h"
#include "fovea/serve.h"

namespace fovea::cli {

namespace {

// vLLM's encoder cache (fovea/ec-cache.h): where, how many bytes, how long a used file is kept.
void add_ec_storage_flags(CLI::App* cmd, server::ServeOptions& o) {
  cmd->add_option("--ec-storage-path", o.ec_storage_path,
                  "write each image's encoder outputs to vLLM's encoder cache in this folder (its ECExampleConnector's "
                  "shared_storage_path): DIR/<uuid>/encoder_cache.safetensors; images already there are not encoded");
  cmd->add_option(
         "--ec-storage-max-bytes", o.ec_storage_max_bytes,
         "bound the bytes of the cache files fovea wrote there, least recently written or read first (0: none)")
      ->capture_default_str();
  cmd->add_option(
         "--ec-storage-min-age", o.ec_storage_min_age_s,
         "seconds a cache file fovea wrote or found (a hit) is kept from eviction after that use: vLLM checks the "
         "file when it schedules the request and reads it later, and the proxy's round trip, prefill and the "
         "consumer's queue happen in between; a write that only younger files keep from fitting "
         "--ec-storage-max-bytes is refused (0: no protection)")
      ->capture_default_str();
}

// The server, once the flags the parser cannot check are (before the model loads).
int run_serve(const server::ServeOptions& o) {
  check_ec_min_age(o.ec_storage_min_age_s);
  return server::serve(o);
}

// Items given by file:// or http(s):// URL (vLLM's flags; docs/vllm.md#media-urls).
void add_media_url_flags(CLI::App* cmd, server::ServeOptions& o) {
  cmd->add_option("--allowed-local-media-path", o.allowed_local_media_path,
                  "read file:// image and video URLs, only below this folder (no escape by .. or symlinks), as vLLM's "
                  "flag (default: file:// URLs are refused)");
  cmd->add_option("--allowed-media-domains", o.allowed_media_domains,
                  "fetch http(s):// image and video URLs from these hosts (comma-separated, exact names; * for any), "
                  "as vLLM's flag; unlike vLLM, none given means no fetching")
      ->delimiter(',');
  cmd->add_flag("--allow-private-media-urls", o.allow_private_media_urls,
                "let fetched URLs reach loopback and private addresses (10/8, 172.16/12, 192.168/16, fc00::/7, ...); "
                "link-local ones, where cloud metadata services answer, are never fetched");
  cmd->add_option("--media-fetch-timeout", o.media_fetch_timeout_s,
                  "seconds one URL's fetch may take, redirects included (also bounded by --request-timeout)")
      ->capture_default_str();
}

}  // namespace

void add_serve(CLI::App& app, Runner& runner) {
  auto* cmd = app.add_subcommand("serve",
                                 "HTTP encoder service: POST /v1/encode, POST /v1/chat/completions (vLLM's encode "
                                 "instance), /health, /v1/models, /metrics");
  auto o = std::make_shared<server::ServeOptions>();
  cmd->add_option("MODEL", o->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("--served-model-name", o->served_model_name,
                  "the model name requests give (\"model\") and replies carry, as vLLM's flag (default: MODEL)");
  cmd->add_option("--host", o->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o->port, "port to listen on; 0 picks a free one (printed)")->capture_default_str();
  cmd->add_option("--max-batch-tokens", o->max_batch_tokens,
                  "visual tokens per encoder forward; requests are packed up to this, an image is never split")
      ->capture_default_str();
  cmd->add_option("--max-queue", o->max_queue, "requests waiting for the encoder; more are answered 503")
      ->capture_default_str();
  cmd->add_option("--max-queue-tokens", o->max_queue_tokens,
                  "visual tokens waiting for the encoder (their pixels stay in memory, ~24 KB each); a request that "
                  "would pass it is answered 503 unless the queue is empty")
      ->capture_default_str();
  cmd->add_option("--max-body-bytes", o->http.max_body_bytes, "largest request body; larger is answered 413")
      ->capture_default_str();
  cmd->add_option("--max-images-per-request", o->max_images_per_request, "more images in one request are answered 400")
      ->capture_default_str();
  add_ec_storage_flags(cmd, *o);
  add_media_url_flags(cmd, *o);
  add_preprocess_flags(cmd, o->preprocess);
  add_video_flags(cmd, o->video);
  cmd->add_option("--request-timeout", o->request_timeout_s, "seconds from request to reply; later is answered 504")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads,
                  "worker threads: each handles one request's body (parse, decode, wait for the encoder); "
                  "connections take no thread")
      ->capture_default_str();
  cmd->add_option("--header-timeout", o->http.header_timeout_s,
                  "seconds from a request's first byte to the end of its head; later is answered 408")
      ->capture_default_str();
  cmd->add_option("--body-timeout", o->http.body_timeout_s,
                  "seconds from the end of a request's head to the end of its body; later is answered 408")
      ->capture_default_str();
  cmd->add_option("--keep-alive-timeout", o->http.keep_alive_timeout_s, "seconds an idle connection is kept open")
      ->capture_default_str();
  cmd->add_option("--max-header-bytes", o->http.max_header_bytes,
                  "largest request head (request line and fields); larger is answered 431")
      ->capture_default_str();
  cmd->add_option("--max-connections", o->http.max_connections, "open connections; more are answered 503")
      ->capture_default_str();
  cmd->add_option("--max-body-bytes-in-flight", o->http.max_body_bytes_in_flight,
                  "request bodies being received or handled, all connections together; a request that would "
                  "pass it is answered 503 (a lone request always fits)")
      ->capture_default_str();
  cmd->add_option("--max-decode-bytes", o->max_decode_bytes,
                  "memory for images being decoded and preprocessed, all requests together (each image's share "
                  "is reserved from its header before decoding); more waits, until the request's deadline")
      ->capture_default_str();
  cmd->add_option("--devices", o->devices,
                  "GPUs to serve on, one encoder replica each, fed from one queue: a list such as 0,1, or all "
                  "(default: GPU 0)");
  cmd->add_option("--workers", o->workers, "encoder replicas on the CPU (--device cpu), fed from one queue")
      ->capture_default_str();
  cmd->add_option("--drain-seconds", o->http.drain_delay_s,
                  "on SIGTERM/SIGINT: serve on this long with /ready answering 503 (so a load balancer stops "
                  "sending), then stop accepting and finish the requests in flight")
      ->capture_default_str();
  cmd->add_option("--shutdown-timeout", o->http.shutdown_timeout_s,
                  "on SIGTERM/SIGINT, once it stops accepting: how long the requests in flight may take; those "
                  "not finished then are answered 503 shutting_down at once (an orchestrator's grace period, "
                  "30 s in Kubernetes, should exceed --drain-seconds plus this)")
      ->capture_default_str();
  add_engine_flags(cmd, o->engine);
  cmd->callback([&runner, o] { runner = [o] { return run_serve(*o); }; });
}

}  // namespace fovea::cli
