// `fovea serve`: routes, replies, and the server's lifecycle (see server.h). The HTTP layer
// (http.h) reads a request; its body is handled on a worker thread: parse the JSON (request.h),
// decode and preprocess its images (in parallel, within the decode-memory budget), queue them for
// the batching worker, wait (bounded), reply.
#include "fovea/serve.h"


#include <signal.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <span>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fovea/bf16.h"
#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/json.h"
#include "fovea/pipeline.h"
#include "fovea/system.h"
#include "fovea/threads.h"
#include "fovea/video.h"
#include "fovea/safetensors.h"
#include "fovea/sha256.h"
#include "server/base64.h"
#include "server/budget.h"
#include "server/http.h"
#include "server/request.h"
#include "server/batcher.h"
#include "server/metrics.h"

namespace fovea::server {

namespace {

using json = nlohmann::ordered_json;  // replies keep the order fields are written in

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// JSON text; invalid UTF-8 (from a client's bytes echoed in a message) becomes U+FFFD, never a throw.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

const char* error_type(int status) {
  if (status == 503) return "overloaded_error";
  if (status == 504) return "timeout_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

// ---- decoding -------------------------------------------------------------------------------------

struct Decoded {
  std::vector<image::Patches> images;
  std::vector<double> decode_ms, preprocess_ms;
};

// The image's bytes; its base64 text is freed unless keep (it may be decoded again).
std::vector<uint8_t> image_bytes(EncodeRequest& r, size_t i, bool keep = false) {
  try {
    std::vector<uint8_t> bytes = base64_decode(r.payloads[i], r.names[i]);
    if (!keep) std::string().swap(r.payloads[i]);
    return bytes;
  } catch (const Error& e) {
    throw ApiError{400, "invalid_base64", e.what()};
  }
}

// Base64 -> image -> patches for the images `which` (indices into the request), in parallel
// (prepare_images); the first failing image (by index) is the request's error, naming it. Each
// image reserves the memory it will take to decode and preprocess (from its header) before a pixel
// is decoded, waiting for room until the request's deadline, and gives it back once preprocessed.
Decoded decode_images(EncodeRequest& r, const std::vector<size_t>& which, const image::PreprocessConfig& pcfg,
                      ByteBudget& budget, Clock::time_point deadline) {
  const size_t n = which.size();
  // Requests decoding at once share the cores: each gets cores / requests threads (at least one),
  // not all of them each (each resize pass of each request used to start a thread per core).
  static std::atomic<int> decoding{0};
  struct Count {
    Count() { ++decoding; }
    ~Count() { --decoding; }
  } counted;
  ThreadCap cap(hardware_threads() / std::max(1, decoding.load()));
  std::vector<int64_t> held(n, 0);
  const auto name_of = [&](size_t j) { return r.names[which[j]]; };
  const auto decode = [&](size_t j) {
    const size_t i = which[j];
    const std::string name = name_of(j);
    const std::vector<uint8_t> bytes = image_bytes(r, i);
    const image::ImageInfo info = image::probe(bytes, name, pcfg);
    const int64_t need = image::decode_peak_bytes(info, pcfg);
    if (need > budget.capacity())
      throw ApiError{400, "invalid_image",
                     fmt::format("image '{}': {}x{} needs {} bytes to decode, more than the server's {} "
                                 "(--max-decode-bytes)", name, info.width, info.height, need, budget.capacity())};
    if (!budget.acquire(need, deadline))
      throw ApiError{503, "server_busy",
                     fmt::format("image '{}': no room to decode it before the request's deadline (the "
                                 "server's images being decoded hold {} of {} bytes, --max-decode-bytes)",
                                 name, budget.used(), budget.capacity())};
    held[j] = need;
    return image::decode_memory(bytes, name, pcfg);
  };
  const auto release = [&](size_t j) {
    if (held[j]) budget.release(held[j]);
  };
  // Raw uint8 patches: an eighth of the fp32 bytes to queue and upload; the GPU normalizes them.
  std::vector<PreparedImage> prepared = prepare_images(n, decode, pcfg, release, /*raw=*/true);
  Decoded d;
  for (size_t i = 0; i < n; ++i) {
    PreparedImage& p = prepared[i];
    if (p.error) {
      try {
        std::rethrow_exception(p.error);
      } catch (const ApiError&) {
        throw;
      } catch (const Error& e) {
        const std::string what = e.what();  // decode errors name the image, preprocess errors do not
        const std::string name = name_of(i);  // i: this image's place among `which`
        throw ApiError{400, "invalid_image", what.find(name) != std::string::npos ? what : fmt::format("image '{}': {}", name, what)};
      }
    }
    d.images.push_back(std::move(p.patches));
    d.decode_ms.push_back(p.decode_ms);
    d.preprocess_ms.push_back(p.preprocess_ms);
  }
  return d;
}

// ---- replies --------------------------------------------------------------------------------------

// bf16 rows are sent as the bytes they are in memory (little-endian), or widened to floats.
static_assert(std::endian::native == std::endian::little, "bf16 rows are sent as they lie in memory");

// What the handlers share. The batcher, model and engine outlive the HTTP server.
struct Context {
  Context(const ServeOptions& o, const qwen3vl::Model& m, const EngineConfig& e, image::PreprocessConfig p,
          video::VideoConfig v, Batcher& b)
      : opt(o), model(m), engine(e), pcfg(p), vcfg(v), vlim(video::limits_from(o.video)), batcher(b),
        decode_budget(o.max_decode_bytes) {}
  const ServeOptions& opt;
  const qwen3vl::Model& model;
  const EngineConfig& engine;
  image::PreprocessConfig pcfg;
  video::VideoConfig vcfg;
  video::VideoLimits vlim;
  Batcher& batcher;
  ByteBudget decode_budget;
  Metrics metrics;
  const http::Server* http = nullptr;
  EcCache* cache = nullptr;  // --ec-storage-path
  int64_t started_unix = std::time(nullptr);
};

// One image of a reply: its grid, its cache key and whether it was found there, its rows (views
// into the forward's outputs, or into `loaded`: a cached entry read back) and its timings.
struct ReplyImage {
  qwen3vl::GridThw grid{};
  std::string key;      // "" without the encoder cache
  bool cached = false;  // found in the cache: not encoded
  ImageTensorsBf16 rows;
  std::vector<uint16_t> loaded;  // a cache entry's [tokens, out_hidden * (1 + k)], when rows point into it
  json timings = json::object(), batch = json::object();
  bool video = false;            // a clip: its sampling, for the LLM's prompt
  std::vector<int64_t> frame_indices;
  std::vector<double> timestamps;  // per temporal patch, seconds
  double fps = 0;
};

// A cached entry's rows for a reply: read back, cut into the merger output and deepstack columns.
void load_cached(const Context& c, ReplyImage& im, bool with_deepstack) {
  const auto& cfg = c.model.config;
  const int64_t tokens = image_tokens(cfg, im.grid), O = cfg.out_hidden, k = int64_t(cfg.deepstack.size());
  const std::vector<uint16_t> all = c.cache->load(im.key, tokens, O * (1 + k));
  const int64_t parts = with_deepstack ? 1 + k : 1;
  im.loaded.resize(size_t(tokens * O * parts));
  for (int64_t p = 0; p < parts; ++p)  // part p: [tokens, O], row after row
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(im.loaded.data() + (p * tokens + t) * O, all.data() + (t * (1 + k) + p) * O, size_t(O) * 2);
  const std::span<const uint16_t> v(im.loaded);
  im.rows.merged = v.subspan(0, size_t(tokens * O));
  im.rows.deepstack.clear();
  for (int64_t p = 1; p < parts; ++p) im.rows.deepstack.push_back(v.subspan(size_t(p * tokens * O), size_t(tokens * O)));
}

// The JSON reply, written out member by member: the embeddings (megabytes of base64 per image) are
// appended as they are, never passed through the JSON writer's per-character escaping; everything
// else is dumped by nlohmann. With the encoder cache, embeddings only if asked for.
std::string json_reply(const Context& c, const EncodeRequest& r, const std::vector<ReplyImage>& images, bool embeddings,
                       double total_ms) {
  const int O = c.model.config.out_hidden;
  const auto open_object = [](const json& j) {  // the object's text without its closing brace
    std::string t = dump(j);
    t.pop_back();
    return t;
  };
  const auto append_value = [&](std::string& out, std::span<const uint16_t> v) {
    if (!r.as_base64) {
      out += dump(json(widen_bf16(v)));
      return;
    }
    out += '"';
    base64_append(out, reinterpret_cast<const uint8_t*>(v.data()), v.size() * 2);  // [A-Za-z0-9+/=]: no escaping
    out += '"';
  };
  std::string out;
  if (r.as_base64 && embeddings) {  // one allocation: the base64 text plus room for each image's few fields
    size_t bytes = 0;
    for (const ReplyImage& im : images)
      bytes += (1 + (r.deepstack ? im.rows.deepstack.size() : 0)) * base64_size(im.rows.merged.size() * 2) + 1024;
    out.reserve(bytes + 1024);
  }
  out += open_object({{"object", "list"},
                      {"model", c.opt.model},
                      {"encoding", r.as_base64 ? "base64" : "float"},
                      {"dtype", r.as_base64 ? "bf16" : "float32"}});
  out += ",\"data\":[";
  for (size_t i = 0; i < images.size(); ++i) {
    const ReplyImage& im = images[i];
    if (i) out += ',';
    json head = {{"index", i}, {"type", im.video ? "video" : "image"}, {"grid_thw", im.grid},
                 {"num_tokens", image_tokens(c.model.config, im.grid)}, {"hidden_size", O}};
    if (im.video) {
      head["fps"] = im.fps;
      head["frame_indices"] = im.frame_indices;
      head["timestamps"] = im.timestamps;
    }
    if (c.cache) {
      head["uuid"] = im.key;
      head["cached"] = im.cached;
    }
    out += open_object(head);
    if (embeddings) {
      out += ",\"embeddings\":";
      append_value(out, im.rows.merged);
      if (r.deepstack) {
        out += ",\"deepstack\":[";
        for (size_t k = 0; k < im.rows.deepstack.size(); ++k) {
          if (k) out += ',';
          append_value(out, im.rows.deepstack[k]);
        }
        out += ']';
      }
    }
    out += ",\"timings_ms\":" + dump(im.timings);
    out += ",\"batch\":" + dump(im.batch) + "}";
  }
  out += "],\"timings_ms\":" + dump(json{{"total", total_ms}}) + "}";
  return out;
}

// The safetensors file `fovea encode -o` writes for these items: image.<j> over the images and
// video.<k> over the clips, each counted in request order; BF16 tensors straight from the bf16 rows,
// or, with "encoding": "float", F32 ones (those values widened, as in the float JSON reply; see
// request.h); deepstack only if asked for; a clip's timestamps as video.<k>.timestamps; the per-item
// timings (and cache keys, a clip's fps and frame indices) in the metadata.
std::string safetensors_reply(const Context& c, const EncodeRequest& r, const std::vector<ReplyImage>& images) {
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> meta = {
      {"model", c.opt.model}, {"dtype", dtype_name(c.engine.dtype)}, {"device", device_name(c.engine.device)}};
  std::vector<std::vector<float>> stamps;  // alive until the bytes are made
  stamps.reserve(images.size());
  size_t counted[2] = {0, 0};  // images, clips
  for (const ReplyImage& im : images) {
    const char* kind = im.video ? "video" : "image";
    const size_t j = counted[im.video]++;
    ImageTensorsBf16 t{im.rows.merged, {}};
    if (r.deepstack) t.deepstack = im.rows.deepstack;
    if (r.as_base64) {
      append_image_tensors(tensors, j, im.grid, c.model.config, t, kind);
    } else {
      ImageTensors f{widen_bf16(t.merged), {}};
      for (const auto& v : t.deepstack) f.deepstack.push_back(widen_bf16(v));
      append_image_tensors(tensors, j, im.grid, c.model.config, f, kind);
    }
    const std::string p = fmt::format("{}.{}", kind, j);
    meta[p + ".timings_ms"] = dump(im.timings);
    if (c.cache) {
      meta[p + ".uuid"] = im.key;
      meta[p + ".cached"] = im.cached ? "true" : "false";
    }
    if (im.video) {
      stamps.emplace_back(im.timestamps.begin(), im.timestamps.end());
      TensorToWrite ts{p + ".timestamps", DType::F32, {int64_t(stamps.back().size())}, {}, {}};
      ts.view = {reinterpret_cast<const uint8_t*>(stamps.back().data()), stamps.back().size() * sizeof(float)};
      tensors.push_back(std::move(ts));
      meta[p + ".fps"] = fmt::format("{}", im.fps);
      meta[p + ".frame_indices"] = fmt::format("[{}]", fmt::join(im.frame_indices, ", "));
    }
  }
  return safetensors_bytes("reply", tensors, meta);
}

// ---- handlers -------------------------------------------------------------------------------------

http::Response json_response(int status, const json& body) {
  return {status, "application/json", dump(body), {}};
}

http::Response error_response(const ApiError& e) {
  return json_response(e.status, {{"error", {{"message", e.message}, {"type", error_type(e.status)}, {"code", e.code}}}});
}

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Whether item i is a clip: its first bytes decide (a container's magic, video::looks_like_video);
// an item the request called an image or a video must be one.
bool settle_kind(const EncodeRequest& r, size_t i) {
  const std::string& b64 = r.payloads[i];
  std::vector<uint8_t> head;
  try {  // 512 characters are 384 bytes, past every magic number looks_like_video reads
    head = base64_decode(std::string_view(b64).substr(0, std::min<size_t>(b64.size(), 512) & ~size_t(3)), r.names[i]);
  } catch (const Error&) {  // whitespace inside, or bad base64: decoding the item will say which
    return r.kinds[i] == ItemKind::VIDEO;
  }
  const bool clip = video::looks_like_video(head);
  if (r.kinds[i] == ItemKind::VIDEO && !clip)
    reject(400, "invalid_video",
           fmt::format("{}: a video_url item that is not a clip fovea reads (MP4/MOV, WebM/MKV, AVI, MPEG-TS, FLV, Ogg)", r.names[i]));
  if (r.kinds[i] == ItemKind::IMAGE && clip)
    reject(400, "invalid_image", fmt::format("{}: an image_url item holding a video clip; send it as a video_url part", r.names[i]));
  return clip;
}

// A clip's sampling on its reply item, from its header (a cache hit) or its decode.
void set_clip(ReplyImage& im, const video::ClipInfo& info, const video::VideoConfig& cfg) {
  const video::ClipPlan plan = video::plan_clip(info, cfg);
  im.grid = plan.grid;
  im.frame_indices = plan.indices;
  im.timestamps = plan.timestamps;
  im.fps = info.fps;
}
void set_clip(ReplyImage& im, const video::Clip& clip) {
  im.frame_indices = clip.indices;
  im.timestamps = clip.timestamps;
  im.fps = clip.info.fps;
}

// Base64 -> clip -> patches for the clips `which` (indices into the request), one after another.
// Each reserves the memory its decode holds at its peak (video::ClipPlan, from the container's
// header) in the budget images share, before a frame is decoded, and its decode stops at the
// request's deadline.
std::vector<video::Clip> decode_videos(Context& c, EncodeRequest& r, const std::vector<size_t>& which, Clock::time_point deadline) {
  std::vector<video::Clip> clips;
  for (const size_t i : which) {
    const std::string& name = r.names[i];
    const std::vector<uint8_t> bytes = image_bytes(r, i);
    video::VideoLimits lim = c.vlim;
    lim.deadline_seconds = std::min(lim.deadline_seconds, std::max(1e-3, seconds_between(Clock::now(), deadline)));
    int64_t held = 0;
    try {
      const video::ClipPlan plan = video::plan_clip(video::probe_clip(bytes, name, lim, c.pcfg), c.vcfg);
      const int64_t need = std::min(plan.peak_bytes(hardware_threads()), lim.max_bytes_in_flight);
      if (need > c.decode_budget.capacity())
        throw ApiError{400, "invalid_video",
                       fmt::format("video '{}': {} frames to {}x{} need {} bytes to decode, more than the server's {} "
                                   "(--max-decode-bytes)", name, plan.indices.size(), plan.width, plan.height, need,
                                   c.decode_budget.capacity())};
      if (!c.decode_budget.acquire(need, deadline))
        throw ApiError{503, "server_busy",
                       fmt::format("video '{}': no room to decode it before the request's deadline (the server's "
                                   "images and clips being decoded hold {} of {} bytes, --max-decode-bytes)",
                                   name, c.decode_budget.used(), c.decode_budget.capacity())};
      held = need;
      clips.push_back(video::decode_clip(bytes, name, c.vcfg, lim, c.pcfg));
      c.decode_budget.release(held);
    } catch (const Error& e) {
      if (held) c.decode_budget.release(held);
      if (Clock::now() > deadline)
        reject(504, "timeout", fmt::format("{}: not decoded within {} s (--request-timeout)", name, c.opt.request_timeout_s));
      reject(400, "invalid_video", e.what());
    } catch (...) {
      if (held) c.decode_budget.release(held);
      throw;
    }
  }
  return clips;
}

// POST /v1/encode with its body; every failure throws ApiError. Adds the time of each of its phases
// to the metrics as it ends.
http::Response encode(Context& c, http::Request& req) {
  const Clock::time_point t0 = req.received;
  Clock::time_point mark = Clock::now();
  const auto phase_ended = [&](Phase p) {
    const Clock::time_point now = Clock::now();
    c.metrics.add_phase(p, seconds_between(mark, now));
    mark = now;
  };
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(c.opt.request_timeout_s));
  if (Clock::now() > deadline)
    reject(504, "timeout", fmt::format("not started within {} s (--request-timeout)", c.opt.request_timeout_s));
  EncodeRequest r = parse_encode_request(req.body, c.opt.max_images_per_request, c.opt.model);
  std::string().swap(req.body);
  const size_t n = r.payloads.size();
  std::vector<ReplyImage> images(n);
  std::vector<bool> is_video(n);
  for (size_t i = 0; i < n; ++i) is_video[i] = settle_kind(r, i);
  const bool octet = req.header("accept").find("application/octet-stream") != std::string_view::npos;
  // Embeddings: always without the cache and in safetensors replies; with the cache, if asked for.
  const bool embeddings = octet || (c.cache ? r.return_embeddings == 1 : r.return_embeddings != 0);
  for (size_t i = 0; i < n; ++i) {
    if (c.cache) {  // the client's uuid, or the sha256 of the image's URL string as sent (vLLM's EPD proxy's key)
      ReplyImage& im = images[i];
      if (!r.uuids[i].empty()) {
        im.key = r.uuids[i];
      } else {
        const std::string url = r.url_prefixes[i] + r.payloads[i];
        im.key = sha256_hex({reinterpret_cast<const uint8_t*>(url.data()), url.size()});
      }
      im.cached = c.cache->lookup(im.key);
    }
  }
  for (size_t i = 0; i < n; ++i) {  // a cached item: its grid from its header alone, its rows read now
    ReplyImage& im = images[i];
    im.video = is_video[i];
    if (!im.cached) continue;
    const auto t = Clock::now();
    try {
      if (im.video) {
        const std::vector<uint8_t> bytes = image_bytes(r, i, embeddings);
        set_clip(im, video::probe_clip(bytes, r.names[i], c.vlim, c.pcfg), c.vcfg);
      } else {
        const image::ImageInfo info = image::probe(image_bytes(r, i, embeddings), r.names[i], c.pcfg);
        im.grid = image::resized_grid(info.height, info.width, c.pcfg);
      }
    } catch (const Error& e) {
      throw ApiError{400, im.video ? "invalid_video" : "invalid_image", e.what()};
    }
    im.timings = {{"decode", 0.0}, {"preprocess", 0.0}, {"probe", ms_since(t)}, {"queue", 0.0}, {"forward", 0.0}};
    if (embeddings) {
      // Read right after the lookup: a file evicted (or damaged) by another writer since is encoded
      // again, and written again, rather than failing the request.
      try {
        load_cached(c, im, r.deepstack);
        std::string().swap(r.payloads[i]);
      } catch (const Error&) {
        ReplyImage again;
        again.key = im.key;
        again.video = im.video;
        im = std::move(again);
      }
    }
  }
  std::vector<size_t> misses, image_misses, video_misses;  // the items to encode
  for (size_t i = 0; i < n; ++i)
    if (!images[i].cached) {
      misses.push_back(i);
      (is_video[i] ? video_misses : image_misses).push_back(i);
    }
  phase_ended(Phase::PARSE);
  Decoded d = decode_images(r, image_misses, c.pcfg, c.decode_budget, deadline);
  std::vector<video::Clip> clips = decode_videos(c, r, video_misses, deadline);
  phase_ended(Phase::DECODE);

  // The job's items in request order; a clip's patches are fp32, and its batch then normalizes the
  // raw images beside it on the host (EncoderRunner::start).
  std::vector<image::Patches> items;
  std::vector<double> decode_ms, preprocess_ms;
  for (size_t j = 0, ki = 0, kv = 0; j < misses.size(); ++j) {
    if (is_video[misses[j]]) {
      video::Clip& clip = clips[kv++];
      set_clip(images[misses[j]], clip);
      items.push_back(std::move(clip.patches));
      decode_ms.push_back(clip.decode_ms);
      preprocess_ms.push_back(clip.preprocess_ms);
    } else {
      items.push_back(std::move(d.images[ki]));
      decode_ms.push_back(d.decode_ms[ki]);
      preprocess_ms.push_back(d.preprocess_ms[ki++]);
    }
  }
  std::shared_ptr<Job> job;
  if (!misses.empty()) {
    // The cache holds every deepstack output, so a request that fills it asks for them.
    const bool deepstack = r.deepstack || (c.cache && !c.model.config.deepstack.empty());
    std::string refused;
    job = c.batcher.submit(std::move(items), deepstack, refused);
    if (!job) reject(503, "queue_full", refused + "; retry later");
    std::string error;
    switch (c.batcher.wait(*job, deadline, error)) {
      case Batcher::Wait::TIMED_OUT:
        reject(504, "timeout", fmt::format("not encoded within {} s (--request-timeout)", c.opt.request_timeout_s));
      case Batcher::Wait::FAILED:
        reject(500, "encoder_error", error);
      case Batcher::Wait::DONE:
        break;
    }
  }
  phase_ended(Phase::ENCODER);
  const int O = c.model.config.out_hidden;
  for (size_t j = 0; j < misses.size(); ++j) {
    ReplyImage& im = images[misses[j]];
    const ImageOutput& o = job->outputs[j];
    im.grid = job->images[j].grid;
    im.rows.merged = o.merged(O);
    for (size_t k = 0; k < o.forward->deepstack.size(); ++k) im.rows.deepstack.push_back(o.deepstack(k, O));
    im.timings = {{"decode", decode_ms[j]}, {"preprocess", preprocess_ms[j]}, {"queue", o.queue_ms}, {"forward", o.forward_ms}};
    im.batch = {{"images", o.batch_images}, {"tokens", o.batch_tokens}};
    if (c.cache) {
      try {
        c.cache->store(im.key, im.rows, im.grid, c.model.config);
      } catch (const Error& e) {
        reject(500, "ec_cache_write_failed", fmt::format("{}: {}", r.names[misses[j]], e.what()));
      }
    }
  }
  http::Response res;
  if (octet)
    res = {200, "application/octet-stream", safetensors_reply(c, r, images), {}};
  else
    res = {200, "application/json", json_reply(c, r, images, embeddings, ms_since(t0)), {}};
  phase_ended(Phase::REPLY);
  return res;
}

// The endpoints, on top of the HTTP layer (http.h).
class Service final : public http::Handler {
 public:
  explicit Service(Context& c) : c_(c) {}

  std::optional<http::Response> route(const http::Request& req) override {
    static const std::map<std::string, std::string> kAllowed = {
        {"/v1/encode", "POST"}, {"/health", "GET"}, {"/ready", "GET"}, {"/v1/models", "GET"}, {"/metrics", "GET"}};
    const auto known = kAllowed.find(req.path);
    if (known == kAllowed.end())
      return error_response({404, "not_found", fmt::format("no endpoint {} {} (endpoints: POST /v1/encode, GET /health, "
                                                           "GET /ready, GET /v1/models, GET /metrics)",
                                                           req.method, quote_for_error(req.path))});
    if (req.method != known->second) {
      http::Response r = error_response({405, "method_not_allowed",
                                         fmt::format("{} {}: this endpoint takes {}", req.method.substr(0, 32),
                                                     req.path, known->second)});
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
      if (c_.http->stopping()) return json_response(503, {{"status", "stopping"}, {"reason", "the server is shutting down"}});
      if (c_.batcher.replicas_up() == 0)
        return json_response(503, {{"status", "down"}, {"reason", "no encoder device is up"}});
      const size_t depth = c_.batcher.queue_depth();
      if (depth >= c_.opt.max_queue)
        return json_response(503, {{"status", "busy"}, {"reason", fmt::format("the encoder queue is full ({} requests)", depth)}});
      return json_response(200, {{"status", "ready"}});
    }
    if (req.path == "/v1/models") {
      const json model = {{"id", c_.opt.model}, {"object", "model"}, {"created", c_.started_unix}, {"owned_by", "fovea"}};
      return json_response(200, {{"object", "list"}, {"data", json::array({model})}});
    }
    if (req.path == "/metrics")
      return http::Response{200, "text/plain; version=0.0.4; charset=utf-8",
                            c_.metrics.render(c_.opt.model, c_.engine, c_.batcher, int64_t(c_.http->in_flight()), c_.cache), {}};
    if (req.header("content-type").starts_with("multipart/"))
      return error_response({415, "unsupported_media_type",
                             "multipart bodies are not accepted: POST the JSON object (application/json)"});
    return std::nullopt;  // POST /v1/encode: read the body, then handle()
  }

  http::Response handle(http::Request& req) override {
    const Clock::time_point t0 = req.received;
    http::Response res;
    try {
      res = encode(c_, req);
    } catch (const ApiError& e) {
      res = error_response(e);
      if (e.status == 503) res.headers.push_back({"Retry-After", "1"});
    } catch (const std::exception& e) {
      res = error_response({500, "internal_error", e.what()});
    }
    c_.metrics.observe_encode_seconds(ms_since(t0) / 1000);
    return res;
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
  for (const auto& [flag, v] : {std::pair{"--header-timeout", o.http.header_timeout_s}, {"--body-timeout", o.http.body_timeout_s},
                                {"--keep-alive-timeout", o.http.keep_alive_timeout_s}, {"--request-timeout", o.request_timeout_s}})
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
  if (o.workers != 1) fail("--workers is for --device cpu; on GPUs, --devices 0,1,... or all gives one replica per GPU");
  std::vector<int> gpus;
  if (o.devices.empty()) {
    gpus = {0};
  } else if (o.devices == "all") {
    for (const GpuInfo& g : sys.gpus) gpus.push_back(g.index);
  } else {
    for (size_t at = 0; at <= o.devices.size();) {
      const size_t comma = std::min(o.devices.find(',', at), o.devices.size());
      const std::string item = o.devices.substr(at, comma - at);
      int v = -1;
      const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
      if (item.empty() || ec != std::errc() || end != item.data() + item.size() || v < 0)
        fail("--devices {}: '{}' is not a GPU index (a list such as 0,1, or all)", o.devices, item);
      if (std::find(gpus.begin(), gpus.end(), v) != gpus.end()) fail("--devices {}: GPU {} is listed twice", o.devices, v);
      gpus.push_back(v);
      at = comma + 1;
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
      fail("--devices: GPU {} ({}) would run the {} backend, GPU {} the {} one; give GPUs of one kind or "
           "--mm-encoder-attn-backend", g, it->name, backend_name(here.backend), gpus[0], backend_name(engine.backend));
    out.push_back({fmt::format("cuda:{}", g), g});
  }
  return out;
}

}  // namespace

int serve(const ServeOptions& o) {
  check_options(o);
  const SystemInfo sys = query_system();
  const EngineConfig engine = resolve_engine(o.engine, sys);
  const std::vector<ReplicaSpec> replicas = replica_specs(o, engine, sys);
  if (replicas.size() > 1 && engine.scale_mode == ScaleMode::CALIBRATE)
    fail("--mm-encoder-fp8-scale-save-path: calibration runs on one encoder replica (its 16 forwards make one "
         "file); calibrate without --devices / --workers, then serve the file with --mm-encoder-fp8-scale-path");
  const image::PreprocessConfig pcfg = image::load_preprocess_config(o.model, o.preprocess);
  const video::VideoConfig vcfg = video::load_video_config(o.model, o.video);
  const qwen3vl::Model model = qwen3vl::load_model(o.model);
  std::optional<EcCache> cache;
  if (!o.ec_storage_path.empty()) cache.emplace(o.ec_storage_path, o.ec_storage_max_bytes);
  Batcher batcher(model, engine, replicas, o.max_queue, o.max_queue_tokens, o.max_batch_tokens);
  Context c(o, model, engine, pcfg, vcfg, batcher);
  if (cache) c.cache = &*cache;
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
  fmt::print("fovea serve: model {} ({} blocks, out_hidden {}), {} attention{} on {} ({} backend); "
             "batches of up to {} tokens, queue of {} requests; {} encoder replica(s): {}\n",
             o.model, cfg.depth, cfg.out_hidden, dtype_name(engine.dtype),
             engine.scale_mode ? fmt::format(" ({} scales)", scale_mode_name(*engine.scale_mode)) : "",
             device_name(engine.device), backend_name(engine.backend), o.max_batch_tokens, o.max_queue, replicas.size(),
             fmt::join(replica_names(replicas), ", "));
  if (cache) {
    const EcCache::Stats s = cache->stats();
    fmt::print("fovea serve: encoder cache {} (vLLM's ECExampleConnector layout): {} files of fovea's ({:.1f} MB{}), "
               "{} of other writers\n",
               o.ec_storage_path, s.files, double(s.bytes) / 1e6,
               o.ec_storage_max_bytes ? fmt::format(" of at most {:.1f}", double(o.ec_storage_max_bytes) / 1e6) : "",
               s.foreign_files);
  }
  const bool v6 = o.host.find(':') != std::string::npos;
  fmt::print("fovea serve: listening on http://{}{}{}:{}\n", v6 ? "[" : "", o.host, v6 ? "]" : "", server.port());
  std::fflush(stdout);

  const double drain_s = o.http.drain_delay_s;
  server.run([drain_s](int sig, size_t in_flight) {  // on the network thread; std::printf, nothing that throws
    if (drain_s > 0)
      std::printf("fovea serve: %s: /ready says 503; serving on for %g s, then not accepting new connections and "
                  "finishing the requests in flight (%zu now)\n", strsignal(sig), drain_s, in_flight);
    else
      std::printf("fovea serve: %s: not accepting new connections; finishing %zu request(s) in flight\n", strsignal(sig),
                  in_flight);
    std::fflush(stdout);
  });
  batcher.stop();  // every reply is written; nothing is left queued, but finish it if so
  fmt::print("fovea serve: stopped ({} images encoded)\n", batcher.images_encoded());
  std::fflush(stdout);
  return 0;
}

}  // namespace fovea::server
