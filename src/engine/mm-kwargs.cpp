// A request's preprocessing options under vLLM's names (fovea/pipeline.h: MmKwargs, apply_mm_kwargs)
// and the identifier vLLM derives from them (fovea/ec-cache.h: vllm_mm_hash).
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "fovea/blake3.h"
#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/json.h"
#include "fovea/pipeline.h"

namespace fovea {

using ojson = nlohmann::ordered_json;

namespace {

// Python's truthiness of a kwargs value as vLLM tests it: null and {} are nothing.
bool says_something(const ojson& v) { return !v.is_null() && !(v.is_object() && v.empty()); }

std::string type_of(const ojson& v) { return v.is_number_integer() ? "an integer" : std::string("a ") + v.type_name(); }

}  // namespace

bool MmKwargs::empty() const { return !says_something(processor) && !says_something(media_io); }

MmKwargs parse_mm_kwargs(std::string_view processor, std::string_view media_io) {
  JsonLimits lim;
  lim.max_bytes = 64 << 10;
  lim.max_depth = 6;
  lim.max_elements = 1024;
  lim.max_object_keys = 64;
  lim.max_string_bytes = 4096;
  MmKwargs k;
  if (!processor.empty()) k.processor = parse_json_bounded_ordered(processor, lim, "--mm-processor-kwargs");
  if (!media_io.empty()) k.media_io = parse_json_bounded_ordered(media_io, lim, "--media-io-kwargs");
  return k;
}

namespace {

// The options one request sets, each already checked alone (null: keep the server's).
struct Asked {
  std::optional<int64_t> image_min, image_max, video_min, video_max, num_frames, min_frames, max_frames;
  std::optional<double> fps;
};

int64_t integer_in(const ojson& v, const std::string& where, int64_t lo, int64_t hi) {
  if (!v.is_number_integer())
    fail("{}: must be an integer, not {}{}", where, type_of(v), v.is_number() ? " (" + v.dump() + ")" : "");
  if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(hi) : v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    fail("{}: {} is out of range ({} to {})", where, v.dump(), lo, hi);
  return v.get<int64_t>();
}

double number_in(const ojson& v, const std::string& where, double lo, double hi) {
  if (!v.is_number() || v.is_boolean()) fail("{}: must be a number, not {}", where, type_of(v));
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) fail("{}: {} is out of range ({} to {})", where, v.dump(), lo, hi);
  return d;
}

// "size": {"longest_edge": max, "shortest_edge": min} (pixels: an image's, or a clip's frames x h x w).
void read_size(const ojson& v, const std::string& where, std::optional<int64_t>& min, std::optional<int64_t>& max) {
  if (v.is_null()) return;
  if (!v.is_object()) fail("{}: must be an object {{\"longest_edge\", \"shortest_edge\"}}, not {}", where, type_of(v));
  for (const auto& [key, value] : v.items()) {
    const std::string at = where + "." + escape_for_error(key, 32);
    if (key != "longest_edge" && key != "shortest_edge")
      fail("{}: not implemented (size takes longest_edge and shortest_edge: pixel budgets)", at);
    if (value.is_null()) continue;
    (key == "longest_edge" ? max : min) = integer_in(value, at, 1, image::kMaxPixelBudget);
  }
}

// One key of mm_processor_kwargs (or of its images_kwargs / videos_kwargs: `scope`), into `a`.
void read_processor_key(const std::string& key, const ojson& v, const std::string& where, const char* scope, Asked& a,
                        const InputConfig& server) {
  const bool images = scope == nullptr || std::string_view(scope) == "images_kwargs";
  const bool videos = scope == nullptr || std::string_view(scope) == "videos_kwargs";
  const bool video_pixels = std::string_view(scope ? scope : "") == "videos_kwargs";  // else pixels are the images'
  if (key == "size") {
    if (images) read_size(v, where, a.image_min, a.image_max);
    if (videos) read_size(v, where, a.video_min, a.video_max);
    return;
  }
  if (v.is_null() && (key == "max_pixels" || key == "min_pixels" ||
                      (videos && (key == "fps" || key == "num_frames" || key == "min_frames" || key == "max_frames"))))
    return;
  const int64_t frames = server.video.max_frames;
  if (key == "max_pixels" || key == "min_pixels") {
    const int64_t px = integer_in(v, where, 1, image::kMaxPixelBudget);
    (video_pixels ? (key == "max_pixels" ? a.video_max : a.video_min)
                  : (key == "max_pixels" ? a.image_max : a.image_min)) = px;
  } else if (videos && key == "fps") {
    a.fps = number_in(v, where, 0.01, 240);
  } else if (videos && (key == "num_frames" || key == "min_frames" || key == "max_frames")) {
    const int64_t n = integer_in(v, where, 1, frames);
    (key == "num_frames" ? a.num_frames : key == "min_frames" ? a.min_frames : a.max_frames) = n;
  } else {
    fail(
        "{}: not implemented (fovea takes max_pixels, min_pixels, size, fps, num_frames, min_frames, max_frames, "
        "images_kwargs, videos_kwargs)",
        where);
  }
}

Asked read_processor(const ojson& p, const InputConfig& server) {
  Asked a;
  if (p.is_null()) return a;
  if (!p.is_object()) fail("mm_processor_kwargs: must be an object, not {}", type_of(p));
  for (const auto& [key, value] : p.items()) {
    const std::string where = "mm_processor_kwargs." + escape_for_error(key, 32);
    if (key != "images_kwargs" && key != "videos_kwargs") {
      read_processor_key(key, value, where, nullptr, a, server);
      continue;
    }
    if (value.is_null()) continue;
    if (!value.is_object()) fail("{}: must be an object, not {}", where, type_of(value));
    for (const auto& [k, v] : value.items())
      read_processor_key(k, v, where + "." + escape_for_error(k, 32),
                         key == "images_kwargs" ? "images_kwargs" : "videos_kwargs", a, server);
  }
  return a;
}

void check_media_io(const ojson& m) {
  if (m.is_null()) return;
  if (!m.is_object()) fail("media_io_kwargs: must be an object of modalities, not {}", type_of(m));
  for (const auto& [modality, options] : m.items()) {
    const std::string where = "media_io_kwargs." + escape_for_error(modality, 32);
    if (modality != "image" && modality != "video") fail("{}: not implemented (fovea takes images and clips)", where);
    if (options.is_null()) continue;
    if (!options.is_object()) fail("{}: must be an object, not {}", where, type_of(options));
    if (!options.empty())
      fail(
          "{}.{}: not implemented: fovea reads an item once and samples a clip's frames as the processor does; vLLM's "
          "loader options are not applied (send fps / num_frames in mm_processor_kwargs)",
          where, escape_for_error(options.begin().key(), 32));
  }
}

// A budget the request narrows: its max no higher than the server's, its min no higher than its max
// (a min the request did not set comes down to the max with it).
void narrow(int64_t& min, int64_t& max, const std::optional<int64_t>& want_min, const std::optional<int64_t>& want_max,
            const std::string& what, const char* server_flag) {
  if (want_max && *want_max > max)
    fail("{}: {} raises the server's limit of {} ({}): a request can only lower it", what + "max_pixels / longest_edge",
         *want_max, max, server_flag);
  if (want_max) max = *want_max;
  if (want_min && *want_min > max)
    fail("{}: {} is above the largest budget, {}", what + "min_pixels / shortest_edge", *want_min, max);
  min = want_min ? *want_min : std::min(min, max);
}

}  // namespace

InputConfig apply_mm_kwargs(const InputConfig& server, const MmKwargs& k) {
  check_media_io(k.media_io);
  const Asked a = read_processor(k.processor, server);
  InputConfig c = server;
  narrow(c.image.min_pixels, c.image.max_pixels, a.image_min, a.image_max,
         "mm_processor_kwargs (images): ", "--max-pixels");
  narrow(c.video.min_pixels, c.video.max_pixels, a.video_min, a.video_max,
         "mm_processor_kwargs (videos): ", "--video-max-pixels");
  if (a.fps) c.video.fps = *a.fps;
  if (a.num_frames) c.video.num_frames = *a.num_frames;
  if (a.max_frames) c.video.max_frames = *a.max_frames;
  if (a.min_frames) c.video.min_frames = *a.min_frames;
  c.video.min_frames = std::min(c.video.min_frames, c.video.max_frames);
  if (a.min_frames && *a.min_frames > c.video.max_frames)
    fail("mm_processor_kwargs: min_frames {} is above max_frames {}", *a.min_frames, c.video.max_frames);
  return c;
}

// ---- vLLM's identifier ----------------------------------------------------------------------------

namespace {

// MultiModalHasher's framed byte stream (see ec-cache.h), fed straight into the digest.
class Framer {
 public:
  explicit Framer(Blake3& h) : h_(h) {}
  void length(uint64_t n) {
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = uint8_t(n >> (8 * i));
    h_.update(std::span<const uint8_t>(b, 8));
  }
  void framed(std::string_view bytes) {
    length(bytes.size());
    h_.update(bytes);
  }
  void tag(uint8_t t) { h_.update(std::span<const uint8_t>(&t, 1)); }
  void value(const ojson& v);

 private:
  Blake3& h_;
};

void Framer::value(const ojson& v) {
  // Iterative: a stack of the containers open and their next element (a value is never recursed into).
  struct Open {
    const ojson* c;
    ojson::const_iterator it;
  };
  std::vector<Open> stack;
  const auto one = [&](const ojson& x) {
    if (x.is_null()) return tag(0x00);
    if (x.is_array() || x.is_object()) {
      tag(x.is_array() ? 0x01 : 0x02);
      length(x.size());
      stack.push_back({&x, x.cbegin()});
      return;
    }
    tag(0x03);
    char b[8];
    if (x.is_string()) return framed(x.get_ref<const std::string&>());
    if (x.is_boolean()) return framed(std::string_view(x.get<bool>() ? "\x01" : "\x00", 1));
    if (x.is_number_float()) {
      const double d = x.get<double>();
      std::memcpy(b, &d, 8);  // float64, little-endian (the host's order: fovea runs on little-endian hosts)
    } else {
      const uint64_t u = x.is_number_unsigned() ? x.get<uint64_t>() : uint64_t(x.get<int64_t>());
      for (int i = 0; i < 8; ++i) b[i] = char(u >> (8 * i));  // int64 (uint64 above it): numpy's choice
    }
    framed(std::string_view(b, 8));
  };
  one(v);
  while (!stack.empty()) {
    Open& o = stack.back();
    if (o.it == o.c->cend()) {
      stack.pop_back();
      continue;
    }
    const auto it = o.it++;
    if (o.c->is_object()) framed(it.key());
    one(*it);  // may push: `o` is not used after
  }
}

}  // namespace

std::string vllm_mm_hash(const std::string& model_id, InputKind modality, const std::string& uuid, const MmKwargs& k) {
  const std::string name = input_kind_name(modality);  // "image", "video": vLLM's modality names
  std::map<std::string, ojson> args;                   // the hasher's arguments, in name order
  if (k.media_io.is_object() && k.media_io.contains(name) && says_something(k.media_io.at(name)))
    args["media_io_kwargs"] = ojson{{name, k.media_io.at(name)}};
  const char* scoped = modality == InputKind::VIDEO ? "videos_kwargs" : "images_kwargs";
  ojson processor = ojson::object();
  if (k.processor.is_object())
    for (const auto& [key, value] : k.processor.items())
      if ((key != "images_kwargs" && key != "videos_kwargs" && key != "audio_kwargs") || key == scoped)
        processor[key] = value;
  if (!processor.empty()) args["mm_processor_kwargs"] = std::move(processor);
  if (args.empty()) return uuid;
  args["model_id"] = model_id;
  args[name] = uuid;
  Blake3 h;
  Framer f(h);
  for (const auto& [key, value] : args) {
    f.framed(key);
    f.value(value);
  }
  return h.hex();
}

}  // namespace fovea
