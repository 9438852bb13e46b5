// POST /v1/encode: what the handlers share (Context), the handler, and the JSON replies every
// endpoint uses. The engine does the work (fovea/pipeline.h); this layer adds HTTP: the request's
// deadline, the decode-memory budget, the encoder cache's keys, the queue, and the reply's formats.
#pragma once
#include <atomic>
#include <ctime>

#include <nlohmann/json.hpp>

#include "fovea/ec-cache.h"
#include "fovea/model.h"
#include "fovea/pipeline.h"
#include "fovea/serve.h"
#include "server/batcher.h"
#include "server/budget.h"
#include "server/http.h"
#include "server/media-url.h"
#include "server/metrics.h"
#include "server/request.h"

namespace fovea::server {

using json = nlohmann::ordered_json;  // replies keep the order fields are written in

// What the handlers share. The batcher, model and engine outlive the HTTP server.
struct Context {
  Context(const ServeOptions& o, const qwen3vl::Model& m, const EngineConfig& e, InputConfig in, Batcher& b)
      : opt(o),
        model(m),
        engine(e),
        inputs(std::move(in)),
        batcher(b),
        decode_budget(o.max_decode_bytes),
        fetch_budget(int64_t(o.http.max_body_bytes_in_flight)) {}
  const ServeOptions& opt;
  const qwen3vl::Model& model;
  const EngineConfig& engine;
  const InputConfig inputs;
  Batcher& batcher;
  ByteBudget decode_budget;
  ByteBudget fetch_budget;  // the bytes of URL items being read and held, as request bodies are (media-url.h)
  Metrics metrics;
  http::Server* http = nullptr;
  EcCache* cache = nullptr;             // --ec-storage-path
  const MediaSources* media = nullptr;  // file:// and http(s):// items (null: data URLs and base64 only)
  int64_t started_unix = std::time(nullptr);
  std::atomic<bool> abandoned{false};  // shutdown's timeout passed: requests still here are answered 503 already
};

// POST /v1/encode with its body, answered through `reply` (once: the reply, or the failure as
// {"error": ...} with Retry-After on a 503), now or, with http(s) URL items, from a worker after they
// are fetched (the calling worker is free meanwhile). Adds the time of each of its phases to the
// metrics as it ends.
void encode(Context& c, http::Request& req, http::Handler::Reply reply);
// POST /v1/chat/completions: vLLM's EPD proxy's request to an encode instance (request.h,
// parse_chat_request), answered as encode() is. Needs the encoder cache: writes each item's file
// under its key (its uuid, or the sha256 of its URL string: the proxy's key) and answers a minimal
// chat.completion whose "ec_transfer_params" gives, per key, {"metadata": {"image_grid_thw": [t, h,
// w]}, "item_indices": [positions in this request]}, cache hits included. A key repeated in a request
// is encoded and written once.
void chat(Context& c, http::Request& req, http::Handler::Reply reply);

// JSON text; invalid UTF-8 (from a client's bytes echoed in a message) becomes U+FFFD, never a throw.
std::string dump(const json& j);
http::Response json_response(int status, const json& body);
// {"error": {"message", "type", "code"}}.
http::Response error_response(const ApiError& e);

}  // namespace fovea::server
