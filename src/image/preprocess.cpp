// smart_resize, the antialiased bicubic resize, normalization and patchify (docs/encoder.md §smart_resize to
// §Patchify).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/json.h"
#include "fovea/threads.h"

namespace fovea::image {

std::vector<std::string> list_images(const std::string& folder, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec)) fail("{} '{}' is not a folder", what, folder);
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(folder)) {
    std::string ext = e.path().extension().string();
    for (auto& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (e.is_regular_file() &&
        (ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".webp" || ext == ".bmp" || ext == ".gif"))
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) fail("{} '{}' has no .jpg/.jpeg/.png/.webp/.bmp/.gif files", what, folder);
  return files;
}

PreprocessConfig parse_preprocess_config(std::string_view text, const std::string& where) {
  const nlohmann::json j = parse_json_bounded(text, qwen3vl::config_json_limits(), where);
  if (!j.is_object()) fail("{}: not a JSON object", where);
  PreprocessConfig c;
  // An integer field within [lo, hi], or the default when absent.
  auto integer = [&](const nlohmann::json& obj, const char* key, int64_t& dst, int64_t lo, int64_t hi,
                     const char* shown) {
    if (!obj.contains(key) || obj.at(key).is_null()) return;
    const nlohmann::json& v = obj.at(key);
    const bool ok = v.is_number_unsigned()  ? v.get<uint64_t>() <= uint64_t(hi) && int64_t(v.get<uint64_t>()) >= lo
                    : v.is_number_integer() ? v.get<int64_t>() >= lo && v.get<int64_t>() <= hi
                                            : false;
    if (!ok) fail("{}: {} is {}; it must be an integer in {}..{}", where, shown, quote_for_error(v), lo, hi);
    dst = v.get<int64_t>();
  };
  auto small = [&](const char* key, int& dst, int hi) {
    int64_t v = dst;
    integer(j, key, v, 1, hi, key);
    dst = int(v);
  };
  if (j.contains("size") && j.at("size").is_object()) {
    integer(j.at("size"), "shortest_edge", c.min_pixels, 1, kMaxPixelBudget, "size.shortest_edge");
    integer(j.at("size"), "longest_edge", c.max_pixels, 1, kMaxPixelBudget, "size.longest_edge");
  }
  integer(j, "min_pixels", c.min_pixels, 1, kMaxPixelBudget, "min_pixels");
  integer(j, "max_pixels", c.max_pixels, 1, kMaxPixelBudget, "max_pixels");
  if (c.max_pixels < c.min_pixels) fail("{}: max_pixels {} is below min_pixels {}", where, c.max_pixels, c.min_pixels);
  small("patch_size", c.patch, qwen3vl::kMaxPatch);
  small("merge_size", c.merge, qwen3vl::kMaxMerge);
  small("temporal_patch_size", c.temporal, qwen3vl::kMaxTemporalPatch);
  for (const char* key : {"image_mean", "image_std"}) {
    if (!j.contains(key) || j.at(key).is_null()) continue;
    const bool is_std = std::string_view(key) == "image_std";
    const nlohmann::json& v = j.at(key);
    if (!v.is_array() || v.size() != 3)
      fail("{}: {} is {}; it must be a list of 3 numbers", where, key, quote_for_error(v));
    for (size_t i = 0; i < 3; ++i) {
      const double x = v[i].is_number() ? v[i].get<double>() : std::nan("");
      const bool ok = is_std ? x >= 1e-6 && x <= 1e6 : x >= -1e6 && x <= 1e6;  // false for NaN
      if (!ok)
        fail("{}: {}[{}] is {}; it must be a finite number in {}", where, key, i, quote_for_error(v[i]),
             is_std ? "[1e-6, 1e6] (pixels are divided by it)" : "[-1e6, 1e6]");
      (is_std ? c.std : c.mean)[i] = float(x);
    }
  }
  return c;
}

void check_against_model(const PreprocessConfig& p, const std::string& p_where, const qwen3vl::VisionConfig& m) {
  auto same = [&](int pv, const char* pkey, int mv, const char* mkey) {
    if (pv != mv)
      fail("{}: {} is {}, but the model ({}) has vision_config.{} {}: the two must agree", p_where, pkey, pv, m.name,
           mkey, mv);
  };
  same(p.patch, "patch_size", m.patch, "patch_size");
  same(p.merge, "merge_size", m.merge, "spatial_merge_size");
  same(p.temporal, "temporal_patch_size", m.temporal_patch, "temporal_patch_size");
  if (m.in_channels != 3)
    fail("model {}: vision_config.in_channels is {}; image preprocessing produces RGB (3)", m.name, m.in_channels);
}

std::optional<std::string> model_folder_file(const std::string& model, const char* name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(model, ec)) return std::nullopt;
  std::string path = (fs::path(model) / name).string();
  if (!fs::exists(path, ec)) return std::nullopt;
  return path;
}

std::optional<qwen3vl::VisionConfig> readable_model_config(const std::string& model) {
  std::error_code ec;
  if (!std::filesystem::is_directory(model, ec))
    return qwen3vl::synthetic_config(model);  // unknown names: load_model reports them
  // config.json: the same reader load_model uses; without one load_model fails, naming it.
  const std::optional<std::string> cp = model_folder_file(model, "config.json");
  if (!cp) return std::nullopt;
  return qwen3vl::parse_config(read_file(*cp, "model config", qwen3vl::config_json_limits().max_bytes), *cp);
}

namespace {

// The model's own preprocessing (its folder's preprocessor_config.json, or the shipped defaults),
// checked against the model's config when it can be read. `where` is set to where it came from.
PreprocessConfig model_preprocess_config(const std::string& model, std::string& where) {
  PreprocessConfig c;
  where = "the shipped Qwen3-VL preprocessing defaults";
  if (const std::optional<std::string> path = model_folder_file(model, "preprocessor_config.json")) {
    c = parse_preprocess_config(read_file(*path, "preprocessor config", qwen3vl::config_json_limits().max_bytes),
                                *path);
    where = *path;
  }
  if (const auto mc = readable_model_config(model)) check_against_model(c, where, *mc);
  return c;
}

}  // namespace

PreprocessConfig load_preprocess_config(const std::string& model, const PreprocessOverrides& o) {
  std::string where;
  PreprocessConfig c = model_preprocess_config(model, where);
  if (o.min_pixels > kMaxPixelBudget) fail("--min-pixels {} is over the limit of {}", o.min_pixels, kMaxPixelBudget);
  if (o.max_pixels > kMaxPixelBudget) fail("--max-pixels {} is over the limit of {}", o.max_pixels, kMaxPixelBudget);
  if (o.min_pixels > 0) c.min_pixels = o.min_pixels;
  if (o.max_pixels > 0) c.max_pixels = o.max_pixels;
  if (c.max_pixels < c.min_pixels) fail("--max-pixels {} is below --min-pixels {}", c.max_pixels, c.min_pixels);
  if (o.max_image_pixels < 0)
    fail("--max-image-pixels must be 0 (auto: 4 x max(--max-pixels, 4096^2)) or a number of pixels, not {}",
         o.max_image_pixels);
  c.max_image_pixels = o.max_image_pixels;
  return c;
}

std::pair<int, int> smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels) {
  if (height <= 0 || width <= 0) fail("image size {}x{} is empty", width, height);
  if (double(std::max(height, width)) / std::min(height, width) > 200)
    fail("aspect ratio {}x{} is over 200:1", width, height);
  // Python's round() is round-half-to-even, which std::nearbyint gives in the default FP mode.
  int64_t h = int64_t(std::nearbyint(double(height) / factor)) * factor;
  int64_t w = int64_t(std::nearbyint(double(width) / factor)) * factor;
  if (h * w > max_pixels) {
    const double beta = std::sqrt(double(height) * width / double(max_pixels));
    h = std::max<int64_t>(factor, int64_t(std::floor(height / beta / factor)) * factor);
    w = std::max<int64_t>(factor, int64_t(std::floor(width / beta / factor)) * factor);
  } else if (h * w < min_pixels) {
    const double beta = std::sqrt(double(min_pixels) / (double(height) * width));
    h = int64_t(std::ceil(height * beta / factor)) * factor;
    w = int64_t(std::ceil(width * beta / factor)) * factor;
  }
  return {int(h), int(w)};
}

namespace {

// Keys' cubic convolution kernel with a = -0.5 (the antialiased bicubic's choice).
double cubic(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}

struct Taps {
  std::vector<int> start, count;
  std::vector<int32_t> weights;  // fixed point with `precision` fraction bits, `ksize` per output
  int ksize = 0, precision = 0;
};

// Per output pixel: the input range and normalized weights, rounded to int16 with as many fraction
// bits as the largest weight allows (torch's uint8 antialiased path, which transformers'
// torchvision backend runs: Pillow's precompute_coeffs with int16 instead of 22-bit weights).
Taps taps(int in_size, int out_size) {
  const double scale = double(in_size) / out_size;
  const double support = 2.0 * std::max(scale, 1.0);
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
  Taps t;
  t.ksize = int(std::ceil(support)) * 2 + 1;
  t.start.resize(size_t(out_size));
  t.count.resize(size_t(out_size));
  std::vector<double> w(size_t(out_size) * t.ksize, 0.0);
  double wmax = 0;
  for (int o = 0; o < out_size; ++o) {
    const double center = (o + 0.5) * scale;
    const int xmin = std::max(int(center - support + 0.5), 0);
    const int xcount = std::min(int(center + support + 0.5), in_size) - xmin;
    double* k = w.data() + size_t(o) * t.ksize;
    double total = 0;
    for (int x = 0; x < xcount; ++x) total += k[x] = cubic((x + xmin - center + 0.5) * invscale);
    for (int x = 0; x < xcount; ++x) {
      if (total != 0) k[x] /= total;
      wmax = std::max(wmax, k[x]);
    }
    t.start[size_t(o)] = xmin;
    t.count[size_t(o)] = xcount;
  }
  while (t.precision < 22 && int(0.5 + wmax * double(1 << (t.precision + 1))) < (1 << 15)) ++t.precision;
  t.weights.resize(w.size());
  for (size_t i = 0; i < w.size(); ++i)
    t.weights[i] = int16_t(w[i] * double(1 << t.precision) + (w[i] < 0 ? -0.5 : 0.5));
  return t;
}

// One output value: the rounded, clamped fixed-point dot product of a tap row with `n` inputs
// `stride` apart.
uint8_t convolve(const uint8_t* in, size_t stride, const int32_t* w, int n, int precision) {
  int32_t ss = 1 << (precision - 1);
  for (int i = 0; i < n; ++i) ss += int32_t(in[size_t(i) * stride]) * w[i];
  ss >>= precision;
  return uint8_t(ss < 0 ? 0 : ss > 255 ? 255 : ss);
}

// Threads for a resize pass writing `pixels` outputs: all cores for large images (a 4K photograph
// takes ~0.3 s on one core), one for small ones, where starting threads would cost more.
int threads_for(int64_t pixels) { return pixels >= (int64_t(1) << 20) ? 0 : 1; }

}  // namespace

Rgb8 resize_bicubic(const Rgb8& in, int out_h, int out_w) {
  if (out_h <= 0 || out_w <= 0) fail("resize to {}x{}: empty size", out_w, out_h);
  // Horizontal pass (in_h x out_w), then vertical (out_h x out_w), each rounded to uint8.
  Rgb8 mid;
  mid.width = out_w;
  mid.height = in.height;
  mid.data.resize(size_t(out_w) * in.height * 3);
  if (out_w == in.width) {
    mid.data = in.data;
  } else {
    const Taps t = taps(in.width, out_w);
    parallel_for(
        in.height,
        [&](int64_t y) {
          for (int x = 0; x < out_w; ++x)
            for (int c = 0; c < 3; ++c)
              mid.data[(size_t(y) * out_w + x) * 3 + c] =
                  convolve(in.data.data() + (size_t(y) * in.width + t.start[size_t(x)]) * 3 + c, 3,
                           t.weights.data() + size_t(x) * t.ksize, t.count[size_t(x)], t.precision);
        },
        threads_for(int64_t(out_w) * in.height), 8);
  }
  if (out_h == in.height) return mid;
  Rgb8 out;
  out.width = out_w;
  out.height = out_h;
  out.data.resize(size_t(out_w) * out_h * 3);
  const Taps t = taps(in.height, out_h);
  parallel_for(
      out_h,
      [&](int64_t y) {
        for (int x = 0; x < out_w; ++x)
          for (int c = 0; c < 3; ++c)
            out.data[(size_t(y) * out_w + x) * 3 + c] =
                convolve(mid.data.data() + (size_t(t.start[size_t(y)]) * out_w + x) * 3 + c, size_t(out_w) * 3,
                         t.weights.data() + size_t(y) * t.ksize, t.count[size_t(y)], t.precision);
      },
      threads_for(int64_t(out_w) * out_h), 8);
  return out;
}

namespace {
// Calls put(row, y0, x0) for each patch in merge-window order: (bh, bw, mh, mw), its top-left pixel.
template <class F>
void for_each_patch(const Rgb8& img, const PreprocessConfig& cfg, Patches& out, F&& put) {
  const int P = cfg.patch, M = cfg.merge;
  if (img.height % (P * M) || img.width % (P * M))
    fail("patchify: image {}x{} is not a multiple of {} on each side", img.width, img.height, P * M);
  const int gh = img.height / P, gw = img.width / P;
  out.grid = {1, gh, gw};
  size_t r = 0;
  for (int bh = 0; bh < gh / M; ++bh)
    for (int bw = 0; bw < gw / M; ++bw)
      for (int mh = 0; mh < M; ++mh)
        for (int mw = 0; mw < M; ++mw, ++r) put(r, (bh * M + mh) * P, (bw * M + mw) * P);
}

// transformers fuses rescale into normalize: (x - mean*255) / (std*255) in float32 ((x - 127.5) /
// 127.5 for the shipped values; docs/encoder.md §Normalization). The GPU encoder's copy of this is
// normalize_kernel in forward-cuda.cu.
float normalize(uint8_t x, const float* mean, const float* std, int c) {
  return (float(x) - mean[c] * 255.0f) / (std[c] * 255.0f);
}
}  // namespace

Patches patchify(const Rgb8& img, const PreprocessConfig& cfg) {
  const int P = cfg.patch, T = cfg.temporal;
  const size_t row = size_t(3) * T * P * P;
  Patches out;
  out.pixels.resize(size_t(img.height / P) * (img.width / P) * row);
  // Columns (c, t, py, px); the still frame is repeated T times.
  for_each_patch(img, cfg, out, [&](size_t r, int y0, int x0) {
    float* dst = out.pixels.data() + r * row;
    for (int c = 0; c < 3; ++c)
      for (int t = 0; t < T; ++t)
        for (int py = 0; py < P; ++py)
          for (int px = 0; px < P; ++px)
            dst[((c * T + t) * P + py) * P + px] =
                normalize(img.data[(size_t(y0 + py) * img.width + x0 + px) * 3 + c], cfg.mean, cfg.std, c);
  });
  return out;
}

Patches patchify_raw(const Rgb8& img, const PreprocessConfig& cfg) {
  const int P = cfg.patch;
  const size_t row = size_t(3) * P * P;
  Patches out;
  out.raw.resize(size_t(img.height / P) * (img.width / P) * row);
  for (int c = 0; c < 3; ++c) {
    out.norm.mean[c] = cfg.mean[c];
    out.norm.std[c] = cfg.std[c];
  }
  out.norm.temporal = cfg.temporal;
  for_each_patch(img, cfg, out, [&](size_t r, int y0, int x0) {  // columns (c, py, px)
    uint8_t* dst = out.raw.data() + r * row;
    for (int c = 0; c < 3; ++c)
      for (int py = 0; py < P; ++py)
        for (int px = 0; px < P; ++px)
          dst[(c * P + py) * P + px] = img.data[(size_t(y0 + py) * img.width + x0 + px) * 3 + c];
  });
  return out;
}

void normalize_raw(Patches& p) {
  const int T = p.norm.temporal;
  const size_t rows = size_t(p.grid[0]) * p.grid[1] * p.grid[2], in_row = rows ? p.raw.size() / rows : 0,
               plane = in_row / 3;
  if (p.raw.empty() || T < 1 || rows * in_row != p.raw.size() || plane * 3 != in_row)
    fail("normalize_raw: these are not raw patches");
  p.pixels.resize(rows * in_row * size_t(T));
  float* dst = p.pixels.data();
  for (size_t r = 0; r < rows; ++r)
    for (int c = 0; c < 3; ++c)
      for (int t = 0; t < T; ++t)
        for (size_t k = 0; k < plane; ++k)
          *dst++ = normalize(p.raw[r * in_row + c * plane + k], p.norm.mean, p.norm.std, c);
}

std::pair<int, int> resized_size(int height, int width, const PreprocessConfig& cfg) {
  return smart_resize(height, width, cfg.patch * cfg.merge, cfg.min_pixels, cfg.max_pixels);
}

qwen3vl::GridThw resized_grid(int height, int width, const PreprocessConfig& cfg) {
  const auto [h, w] = resized_size(height, width, cfg);
  return {1, h / cfg.patch, w / cfg.patch};
}

Patches preprocess(const Rgb8& img, const PreprocessConfig& cfg, bool raw) {
  try {
    const auto [h, w] = resized_size(img.height, img.width, cfg);
    const bool as_is = h == img.height && w == img.width;
    const Rgb8 resized = as_is ? Rgb8{} : resize_bicubic(img, h, w);
    const Rgb8& sized = as_is ? img : resized;
    return raw ? patchify_raw(sized, cfg) : patchify(sized, cfg);
  } catch (const Error& e) {
    if (img.name.empty()) throw;
    fail("image '{}': {}", img.name, e.what());
  }
}

}  // namespace fovea::image
