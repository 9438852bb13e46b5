// `fovea serve`: routes, request parsing and replies, and the server's lifecycle (see server.h).
// A request is handled on one of httplib's threads: read the body (bounded), parse the JSON, decode
// and preprocess its images (in parallel), queue them for the batching worker, wait (bounded), reply.
#include "server/server.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cli/run-encoder.h"
#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/safetensors.h"
#include "fovea/threads.h"
#include "server/base64.h"
#include "server/batcher.h"
#include "server/metrics.h"

namespace fovea::server {

namespace {

using json = nlohmann::ordered_json;  // replies keep the order fields are written in

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// JSON text; invalid UTF-8 (from a client's bytes echoed in a message) becomes U+FFFD, never a throw.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// ---- errors ---------------------------------------------------------------------------------------

// A request's failure, as the reply it becomes: {"error": {"message", "type", "code"}}.
struct ApiError {
  int status = 500;
  std::string code, message;
};

[[noreturn]] void reject(int status, std::string code, std::string message) {
  throw ApiError{status, std::move(code), std::move(message)};
}

const char* error_type(int status) {
  if (status == 503) return "overloaded_error";
  if (status == 504) return "timeout_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  const json body = {{"error", {{"message", e.message}, {"type", error_type(e.status)}, {"code", e.code}}}};
  res.set_content(dump(body), "application/json");
}

// ---- the request ----------------------------------------------------------------------------------

struct EncodeRequest {
  std::vector<std::string_view> payloads;  // each image's base64 text, pointing into the parsed JSON
  bool as_base64 = true;                   // "encoding": "base64" (bf16 bytes) or "float"
  bool deepstack = false;                  // "return_deepstack"
};

// images[i] as its base64 text: a data URL (data:image/png;base64,...) or plain base64, bare or in
// an OpenAI content part {"type": "image_url", "image_url": {"url": ...}}.
std::string_view image_payload(const json& item, size_t i) {
  const std::string where = fmt::format("images[{}]", i);
  const json* url = &item;
  if (item.is_object()) {
    const auto type = item.find("type");
    const auto part = item.find("image_url");
    if (type == item.end() || *type != "image_url" || part == item.end())
      reject(400, "invalid_image",
             where + ": an object must be a content part {\"type\": \"image_url\", \"image_url\": {\"url\": ...}}");
    url = part->is_object() && part->contains("url") ? &part->at("url") : &*part;
  }
  if (!url->is_string())
    reject(400, "invalid_image", fmt::format("{}: expected a data URL or base64 string, got {}", where, url->type_name()));
  const std::string_view s = url->get_ref<const std::string&>();
  if (s.starts_with("data:")) {
    const size_t comma = s.find(',');
    if (comma == std::string_view::npos) reject(400, "invalid_image", where + ": data URL without ','");
    if (!s.substr(0, comma).ends_with(";base64"))
      reject(400, "invalid_image", where + ": only base64 data URLs are accepted (data:image/png;base64,...)");
    return s.substr(comma + 1);
  }
  if (s.starts_with("http://") || s.starts_with("https://"))
    reject(400, "invalid_image", where + ": image URLs are not fetched; send the image inline as a data URL or base64");
  if (s.empty()) reject(400, "invalid_image", where + ": empty string");
  return s;
}

EncodeRequest parse_encode_request(const json& doc, size_t max_images, const std::string& model) {
  if (!doc.is_object()) reject(400, "invalid_request", "the body must be a JSON object with an \"images\" array");
  EncodeRequest r;
  for (const auto& [key, value] : doc.items()) {
    if (key == "images") continue;
    if (key == "encoding") {
      if (value != "base64" && value != "float")
        reject(400, "invalid_request", fmt::format("\"encoding\" must be \"base64\" or \"float\", not {}", dump(value)));
      r.as_base64 = value == "base64";
    } else if (key == "return_deepstack") {
      if (!value.is_boolean()) reject(400, "invalid_request", "\"return_deepstack\" must be true or false");
      r.deepstack = value.get<bool>();
    } else if (key == "model") {
      if (value != model)
        reject(404, "model_not_found",
               fmt::format("model {} is not served here; this server serves \"{}\"", dump(value), model));
    } else {
      reject(400, "invalid_request",
             fmt::format("unknown field \"{}\" (accepted: images, encoding, return_deepstack, model)", key));
    }
  }
  const auto images = doc.find("images");
  if (images == doc.end() || !images->is_array() || images->empty())
    reject(400, "invalid_request",
           "\"images\" must be a non-empty array of data URLs, base64 strings or image_url content parts");
  if (images->size() > max_images)
    reject(400, "too_many_images",
           fmt::format("{} images in one request; the limit is {} (--max-images-per-request)", images->size(), max_images));
  for (size_t i = 0; i < images->size(); ++i) r.payloads.push_back(image_payload((*images)[i], i));
  return r;
}

// The body, at most max bytes (any transfer encoding). A Content-Length over the limit is refused by
// httplib itself (payload_max_length, status 413), which reads and discards the body.
std::string read_body(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader,
                      size_t max) {
  if (req.is_multipart_form_data())
    reject(415, "unsupported_media_type", "multipart bodies are not accepted: POST the JSON object (application/json)");
  std::string body;
  size_t seen = 0;
  const bool ok = reader([&](const char* data, size_t n) {
    seen += n;
    if (seen <= max) body.append(data, n);
    return seen - std::min(seen, max) <= max;  // past the limit, drain up to max more so the client reads the 413
  });
  if (seen > max || res.status == 413)
    reject(413, "body_too_large", fmt::format("the request body exceeds {} bytes (--max-body-bytes)", max));
  if (!ok) reject(400, "invalid_body", "the request body could not be read (truncated?)");
  return body;
}

// ---- decoding -------------------------------------------------------------------------------------

struct Decoded {
  std::vector<ImageInput> images;
  std::vector<double> decode_ms, preprocess_ms;
};

// Base64 -> image -> patches for every image, in parallel; the first failing image (by index) is the
// request's error, naming it.
Decoded decode_images(const EncodeRequest& r, const image::PreprocessConfig& pcfg) {
  const size_t n = r.payloads.size();
  Decoded d{std::vector<ImageInput>(n), std::vector<double>(n), std::vector<double>(n)};
  std::vector<std::optional<ApiError>> errors(n);
  parallel_for(int64_t(n), [&](int64_t k) {
    const size_t i = size_t(k);
    const std::string name = fmt::format("images[{}]", i);
    std::vector<uint8_t> bytes;
    try {
      bytes = base64_decode(r.payloads[i], name);
    } catch (const Error& e) {
      errors[i] = ApiError{400, "invalid_base64", e.what()};
      return;
    }
    try {
      auto t = Clock::now();
      const image::Rgb8 img = image::decode_memory(bytes, name, pcfg);
      d.decode_ms[i] = ms_since(t);
      t = Clock::now();
      image::Patches p = image::preprocess(img, pcfg);
      d.images[i] = {std::move(p.pixels), p.grid};
      d.preprocess_ms[i] = ms_since(t);
    } catch (const Error& e) {
      const std::string what = e.what();  // decode errors name the image, preprocess errors do not
      const bool named = what.find(name) != std::string::npos;
      errors[i] = ApiError{400, "invalid_image", named ? what : fmt::format("image '{}': {}", name, what)};
    }
  });
  for (const auto& e : errors)
    if (e) throw *e;
  return d;
}

// ---- replies --------------------------------------------------------------------------------------

// Rows as bf16 little-endian bytes in base64, or as a list of floats.
json values(const std::vector<float>& v, bool as_base64) {
  if (!as_base64) return v;
  std::vector<uint8_t> bytes(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t b = bf16_from_float(v[i]);
    bytes[2 * i] = uint8_t(b & 0xFF);
    bytes[2 * i + 1] = uint8_t(b >> 8);
  }
  return base64_encode(bytes.data(), bytes.size());
}

json timings(const Decoded& d, const ImageOutput& o, size_t i) {
  return {{"decode", d.decode_ms[i]}, {"preprocess", d.preprocess_ms[i]}, {"queue", o.queue_ms}, {"forward", o.forward_ms}};
}

// What the handlers share. The batcher, model and engine outlive the HTTP server.
struct Context {
  Context(const ServeOptions& o, const qwen3vl::Model& m, const EngineConfig& e, image::PreprocessConfig p, Batcher& b)
      : opt(o), model(m), engine(e), pcfg(p), batcher(b) {}
  const ServeOptions& opt;
  const qwen3vl::Model& model;
  const EngineConfig& engine;
  image::PreprocessConfig pcfg;
  Batcher& batcher;
  Metrics metrics;
  std::atomic<int64_t> in_flight{0};
  int64_t started_unix = std::time(nullptr);
};

std::string json_reply(const Context& c, const EncodeRequest& r, const Decoded& d, const Job& job, double total_ms) {
  const int O = c.model.config.out_hidden;
  json data = json::array();
  for (size_t i = 0; i < job.outputs.size(); ++i) {
    const ImageOutput& o = job.outputs[i];
    const qwen3vl::GridThw& g = job.images[i].grid;
    json item = {{"index", i},
                 {"grid_thw", g},
                 {"num_tokens", cli::image_tokens(c.model.config, g)},
                 {"hidden_size", O},
                 {"embeddings", values(o.merged, r.as_base64)}};
    if (r.deepstack) {
      item["deepstack"] = json::array();
      for (const auto& ds : o.deepstack) item["deepstack"].push_back(values(ds, r.as_base64));
    }
    item["timings_ms"] = timings(d, o, i);
    item["batch"] = {{"images", o.batch_images}, {"tokens", o.batch_tokens}};
    data.push_back(std::move(item));
  }
  const json reply = {{"object", "list"},
                      {"model", c.opt.model},
                      {"encoding", r.as_base64 ? "base64" : "float"},
                      {"dtype", r.as_base64 ? "bf16" : "float32"},
                      {"data", std::move(data)},
                      {"timings_ms", {{"total", total_ms}}}};
  return dump(reply);
}

// The safetensors file `fovea encode -o` writes for these images (fp32 tensors; deepstack only if
// asked for), with the per-image timings in the metadata.
std::string safetensors_reply(const Context& c, const EncodeRequest& r, const Decoded& d, const Job& job) {
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> meta = {
      {"model", c.opt.model}, {"dtype", dtype_name(c.engine.dtype)}, {"device", device_name(c.engine.device)}};
  for (size_t i = 0; i < job.outputs.size(); ++i) {
    const ImageOutput& o = job.outputs[i];
    std::vector<const float*> ds;
    if (r.deepstack)
      for (const auto& v : o.deepstack) ds.push_back(v.data());
    const qwen3vl::GridThw& g = job.images[i].grid;
    cli::append_image_tensors(tensors, i, g, cli::image_tokens(c.model.config, g), c.model.config.out_hidden,
                              o.merged.data(), ds);
    meta[fmt::format("image.{}.timings_ms", i)] = dump(timings(d, o, i));
  }
  return safetensors_bytes("reply", tensors, meta);
}

// ---- handlers -------------------------------------------------------------------------------------

// POST /v1/encode; every failure throws ApiError (handle_encode turns it into the reply).
void encode(Context& c, const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader,
            Clock::time_point t0) {
  const std::string body = read_body(req, res, reader, c.opt.max_body_bytes);
  json doc;
  try {
    doc = json::parse(body);
  } catch (const json::parse_error& e) {
    reject(400, "invalid_json", fmt::format("the body is not valid JSON: {}", e.what()));
  }
  const EncodeRequest r = parse_encode_request(doc, c.opt.max_images_per_request, c.opt.model);
  Decoded d = decode_images(r, c.pcfg);

  std::string refused;
  const std::shared_ptr<Job> job = c.batcher.submit(std::move(d.images), r.deepstack, refused);
  if (!job) {
    res.set_header("Retry-After", "1");  // kept on the error reply send_error() writes
    reject(503, "queue_full", refused + "; retry later");
  }
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(c.opt.request_timeout_s));
  std::string error;
  switch (c.batcher.wait(*job, deadline, error)) {
    case Batcher::Wait::TIMED_OUT:
      reject(504, "timeout", fmt::format("not encoded within {} s (--request-timeout)", c.opt.request_timeout_s));
    case Batcher::Wait::FAILED:
      reject(500, "encoder_error", error);
    case Batcher::Wait::DONE:
      break;
  }
  res.status = 200;
  if (req.get_header_value("Accept").find("application/octet-stream") != std::string::npos)
    res.set_content(safetensors_reply(c, r, d, *job), "application/octet-stream");
  else
    res.set_content(json_reply(c, r, d, *job, ms_since(t0)), "application/json");
}

void handle_encode(Context& c, const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& reader) {
  const Clock::time_point t0 = Clock::now();
  c.in_flight += 1;
  try {
    encode(c, req, res, reader, t0);
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (const std::exception& e) {
    send_error(res, {500, "internal_error", e.what()});
  } catch (...) {
    send_error(res, {500, "internal_error", "unknown exception"});
  }
  c.in_flight -= 1;
  c.metrics.observe_encode_seconds(ms_since(t0) / 1000);
}

void add_routes(httplib::Server& svr, Context& c) {
  svr.Post("/v1/encode", [&c](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
    handle_encode(c, req, res, reader);
  });
  svr.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"status": "ok"})", "application/json");
  });
  svr.Get("/v1/models", [&c](const httplib::Request&, httplib::Response& res) {
    const json model = {{"id", c.opt.model}, {"object", "model"}, {"created", c.started_unix}, {"owned_by", "fovea"}};
    const json models = {{"object", "list"}, {"data", json::array({model})}};
    res.set_content(dump(models), "application/json");
  });
  svr.Get("/metrics", [&c](const httplib::Request&, httplib::Response& res) {
    res.set_content(c.metrics.render(c.opt.model, c.engine, c.batcher, c.in_flight),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  // Replies httplib makes itself (unknown path, malformed HTTP, a Content-Length over the limit on
  // another path) get the same JSON error body.
  svr.set_error_handler(httplib::Server::HandlerWithResponse([&c](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    static const std::map<std::string, std::string> kAllowed = {
        {"/v1/encode", "POST"}, {"/health", "GET"}, {"/v1/models", "GET"}, {"/metrics", "GET"}};
    const auto known = kAllowed.find(req.path);
    if (res.status == 404 && known != kAllowed.end()) {  // a known path, another method
      res.set_header("Allow", known->second);
      send_error(res, {405, "method_not_allowed",
                       fmt::format("{} {}: this endpoint takes {}", req.method, req.path, known->second)});
    } else if (res.status == 404)
      send_error(res, {404, "not_found", fmt::format("no endpoint {} {} (endpoints: POST /v1/encode, GET /health, "
                                                     "GET /v1/models, GET /metrics)", req.method, req.path)});
    else if (res.status == 413)
      send_error(res, {413, "body_too_large",
                       fmt::format("the request body exceeds {} bytes (--max-body-bytes)", c.opt.max_body_bytes)});
    else if (res.status == 400)
      send_error(res, {400, "bad_request", "malformed HTTP request"});
    else
      send_error(res, {res.status, "http_error", fmt::format("HTTP status {}", res.status)});
    return httplib::Server::HandlerResponse::Handled;
  }));
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, {500, "internal_error", what});
  });
  // Counted just before a reply is written (every reply passes here, httplib's own included), so a
  // client that has its reply sees it counted in /metrics.
  svr.set_post_routing_handler([&c](const httplib::Request& req, httplib::Response& res) {
    c.metrics.count_response(req.path, res.status);
  });
}

// ---- lifecycle ------------------------------------------------------------------------------------

// SIGINT / SIGTERM write their number down a pipe that a watcher thread reads: write() is
// async-signal-safe, httplib::Server::stop() is not. wake() sends 0, which means "no signal".
class StopSignals {
 public:
  StopSignals() {
    if (pipe2(fds_, O_CLOEXEC) != 0) fail("serve: cannot create a pipe for signal handling: {}", std::strerror(errno));
    fcntl(fds_[1], F_SETFL, O_NONBLOCK);  // a signal handler must never block
    write_fd_ = fds_[1];
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &old_pipe_);  // a client hanging up must not kill the server
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGPIPE, &old_pipe_, nullptr);
    write_fd_ = -1;
    close(fds_[0]);
    close(fds_[1]);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Blocks until a signal (its number) or wake() (0).
  int next() {
    unsigned char c = 0;
    for (;;) {
      const ssize_t n = read(fds_[0], &c, 1);
      if (n == 1) return c;
      if (n < 0 && errno == EINTR) continue;
      return 0;
    }
  }
  void wake() {
    const unsigned char c = 0;
    [[maybe_unused]] const ssize_t n = write(fds_[1], &c, 1);
  }

 private:
  static inline volatile sig_atomic_t write_fd_ = -1;
  static void on_signal(int sig) {
    const int saved = errno;
    const unsigned char c = static_cast<unsigned char>(sig);
    if (write_fd_ >= 0) {
      [[maybe_unused]] const ssize_t n = write(write_fd_, &c, 1);
    }
    errno = saved;
  }
  int fds_[2] = {-1, -1};
  struct sigaction old_int_ {}, old_term_ {}, old_pipe_ {};
};

void check_options(const ServeOptions& o) {
  if (o.port < 0 || o.port > 65535) fail("--port {} is not a port number (0 picks a free one)", o.port);
  if (o.max_batch_tokens < 1) fail("--max-batch-tokens must be at least 1, not {}", o.max_batch_tokens);
  if (o.max_queue < 1) fail("--max-queue must be at least 1");
  if (o.max_queue_tokens < 1) fail("--max-queue-tokens must be at least 1");
  if (o.max_body_bytes < 1) fail("--max-body-bytes must be at least 1");
  if (o.max_images_per_request < 1) fail("--max-images-per-request must be at least 1");
  if (!(o.request_timeout_s > 0)) fail("--request-timeout must be > 0 seconds, not {}", o.request_timeout_s);
  if (o.threads < 1 || o.threads > 4096) fail("--threads must be in [1, 4096], not {}", o.threads);
}

}  // namespace

int serve(const ServeOptions& o) {
  check_options(o);
  const EngineConfig engine = resolve_engine(o.engine, query_system());
  const image::PreprocessConfig pcfg =
      image::load_preprocess_config(o.model, o.preprocess);
  const qwen3vl::Model model = qwen3vl::load_model(o.model);
  Batcher batcher(model, engine, o.max_queue, o.max_queue_tokens, o.max_batch_tokens);
  Context c(o, model, engine, pcfg, batcher);

  httplib::Server svr;
  add_routes(svr, c);
  svr.set_payload_max_length(o.max_body_bytes);
  svr.new_task_queue = [n = size_t(o.threads)] { return new httplib::ThreadPool(n); };
  // httplib 0.11 binds with SO_REUSEPORT, which lets a second server share the port silently, and
  // listens with a backlog of 5, which a burst of connects overflows (16 clients at once: the kernel
  // dropped some, and their reads failed). So SO_REUSEADDR only, and once bound the backlog is
  // raised to SOMAXCONN (listen() on a listening socket only changes its backlog).
  int listen_fd = -1;
  svr.set_socket_options([&listen_fd](int sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = sock;
  });
  const int port = o.port == 0 ? svr.bind_to_any_port(o.host) : (svr.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port <= 0) fail("cannot listen on {}:{} (address in use, or not allowed?)", o.host, o.port);
  if (::listen(listen_fd, SOMAXCONN) != 0) fail("cannot listen on {}:{}: {}", o.host, port, std::strerror(errno));

  StopSignals signals;  // from here on a signal is kept in the pipe until the watcher reads it
  const auto& cfg = model.config;
  fmt::print("fovea serve: model {} ({} blocks, out_hidden {}), {} attention{} on {} ({} backend); "
             "batches of up to {} tokens, queue of {} requests\n",
             o.model, cfg.depth, cfg.out_hidden, dtype_name(engine.dtype),
             engine.scale_mode ? fmt::format(" ({} scales)", scale_mode_name(*engine.scale_mode)) : "",
             device_name(engine.device), backend_name(engine.backend), o.max_batch_tokens, o.max_queue);
  const bool v6 = o.host.find(':') != std::string::npos;
  fmt::print("fovea serve: listening on http://{}{}{}:{}\n", v6 ? "[" : "", o.host, v6 ? "]" : "", port);
  std::fflush(stdout);

  std::atomic<bool> listening_ended{false};
  std::atomic<int> stop_signal{0};
  std::thread watcher([&] {  // nothing in here throws: std::printf, not fmt
    const int sig = signals.next();
    if (sig == 0) return;  // serve() woke us: listening ended on its own
    stop_signal = sig;
    std::printf("fovea serve: %s: not accepting new connections; finishing %lld request(s) in flight\n", strsignal(sig),
                static_cast<long long>(c.in_flight.load()));
    std::fflush(stdout);
    while (!svr.is_running() && !listening_ended) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    svr.stop();  // listen_after_bind() returns once every accepted connection has been answered
    if (signals.next() != 0) {
      std::fprintf(stderr, "fovea serve: second signal: exiting without finishing\n");
      std::_Exit(1);
    }
  });

  svr.listen_after_bind();
  listening_ended = true;
  batcher.stop();  // every handler has returned; nothing is left queued, but finish it if so
  signals.wake();
  watcher.join();
  if (stop_signal == 0) fail("the listening socket on {}:{} failed", o.host, port);
  fmt::print("fovea serve: stopped ({} images encoded)\n", batcher.images_encoded());
  std::fflush(stdout);
  return 0;
}

}  // namespace fovea::server
