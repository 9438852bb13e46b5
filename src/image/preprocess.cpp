// smart_resize, the antialiased bicubic resize, normalization and patchify (spec §2.2-§2.5).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/threads.h"

namespace fovea::image {

std::vector<std::string> list_images(const std::string& folder, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec)) fail("{} '{}' is not a folder", what, folder);
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(folder)) {
    std::string ext = e.path().extension().string();
    for (auto& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (e.is_regular_file() && (ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp" || ext == ".gif"))
      files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) fail("{} '{}' has no .jpg/.jpeg/.png/.bmp/.gif files", what, folder);
  return files;
}

namespace {

// The model's own preprocessing (its folder's preprocessor_config.json, or the shipped defaults).
PreprocessConfig model_preprocess_config(const std::string& model) {
  PreprocessConfig c;
  std::error_code ec;
  if (!std::filesystem::is_directory(model, ec)) return c;  // synthetic:<preset>: the shipped defaults
  const std::string path = (std::filesystem::path(model) / "preprocessor_config.json").string();
  if (!std::filesystem::exists(path, ec)) return c;  // the shipped defaults
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path, "preprocessor config"));
    if (j.contains("size") && j["size"].is_object()) {
      c.min_pixels = j["size"].value("shortest_edge", c.min_pixels);
      c.max_pixels = j["size"].value("longest_edge", c.max_pixels);
    }
    c.min_pixels = j.value("min_pixels", c.min_pixels);
    c.max_pixels = j.value("max_pixels", c.max_pixels);
    c.patch = j.value("patch_size", c.patch);
    c.merge = j.value("merge_size", c.merge);
    c.temporal = j.value("temporal_patch_size", c.temporal);
    for (const char* key : {"image_mean", "image_std"})
      if (j.contains(key)) {
        const auto v = j[key].get<std::vector<float>>();
        if (v.size() != 3) fail("{}: {} must have 3 values", path, key);
        for (int i = 0; i < 3; ++i) (std::string(key) == "image_mean" ? c.mean : c.std)[i] = v[size_t(i)];
      }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: {}", path, e.what());
  }
  if (c.patch <= 0 || c.merge <= 0 || c.temporal <= 0 || c.min_pixels <= 0 || c.max_pixels < c.min_pixels)
    fail("{}: invalid sizes (patch {}, merge {}, temporal {}, min_pixels {}, max_pixels {})", path, c.patch, c.merge,
         c.temporal, c.min_pixels, c.max_pixels);
  return c;
}

}  // namespace

PreprocessConfig load_preprocess_config(const std::string& model, const PreprocessOverrides& o) {
  PreprocessConfig c = model_preprocess_config(model);
  if (o.min_pixels > 0) c.min_pixels = o.min_pixels;
  if (o.max_pixels > 0) c.max_pixels = o.max_pixels;
  if (c.max_pixels < c.min_pixels) fail("--max-pixels {} is below --min-pixels {}", c.max_pixels, c.min_pixels);
  if (o.max_image_pixels < 1) fail("--max-image-pixels must be at least 1, not {}", o.max_image_pixels);
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
    parallel_for(in.height, [&](int64_t y) {
      for (int x = 0; x < out_w; ++x)
        for (int c = 0; c < 3; ++c)
          mid.data[(size_t(y) * out_w + x) * 3 + c] =
              convolve(in.data.data() + (size_t(y) * in.width + t.start[size_t(x)]) * 3 + c, 3,
                       t.weights.data() + size_t(x) * t.ksize, t.count[size_t(x)], t.precision);
    }, threads_for(int64_t(out_w) * in.height), 8);
  }
  if (out_h == in.height) return mid;
  Rgb8 out;
  out.width = out_w;
  out.height = out_h;
  out.data.resize(size_t(out_w) * out_h * 3);
  const Taps t = taps(in.height, out_h);
  parallel_for(out_h, [&](int64_t y) {
    for (int x = 0; x < out_w; ++x)
      for (int c = 0; c < 3; ++c)
        out.data[(size_t(y) * out_w + x) * 3 + c] =
            convolve(mid.data.data() + (size_t(t.start[size_t(y)]) * out_w + x) * 3 + c, size_t(out_w) * 3,
                     t.weights.data() + size_t(y) * t.ksize, t.count[size_t(y)], t.precision);
  }, threads_for(int64_t(out_w) * out_h), 8);
  return out;
}

Patches patchify(const Rgb8& img, const PreprocessConfig& cfg) {
  const int P = cfg.patch, M = cfg.merge, T = cfg.temporal;
  if (img.height % (P * M) || img.width % (P * M))
    fail("patchify: image {}x{} is not a multiple of {} on each side", img.width, img.height, P * M);
  const int gh = img.height / P, gw = img.width / P;
  const int row = 3 * T * P * P;
  Patches out;
  out.grid = {1, gh, gw};
  out.pixels.resize(size_t(gh) * gw * row);
  size_t r = 0;
  // Rows in (bh, bw, mh, mw) order; columns (c, t, py, px); the still frame is repeated T times.
  for (int bh = 0; bh < gh / M; ++bh)
    for (int bw = 0; bw < gw / M; ++bw)
      for (int mh = 0; mh < M; ++mh)
        for (int mw = 0; mw < M; ++mw, ++r) {
          const int y0 = (bh * M + mh) * P, x0 = (bw * M + mw) * P;
          float* dst = out.pixels.data() + r * size_t(row);
          for (int c = 0; c < 3; ++c)
            for (int t = 0; t < T; ++t)
              for (int py = 0; py < P; ++py)
                for (int px = 0; px < P; ++px) {
                  // transformers fuses rescale into normalize: (x - mean*255) / (std*255) in float32
                  // ((x - 127.5) / 127.5 for the shipped values; spec §2.3).
                  const float v = img.data[(size_t(y0 + py) * img.width + x0 + px) * 3 + c];
                  dst[((c * T + t) * P + py) * P + px] = (v - cfg.mean[c] * 255.0f) / (cfg.std[c] * 255.0f);
                }
        }
  return out;
}

Patches preprocess(const Rgb8& img, const PreprocessConfig& cfg) {
  try {
    const auto [h, w] = smart_resize(img.height, img.width, cfg.patch * cfg.merge, cfg.min_pixels, cfg.max_pixels);
    return patchify(h == img.height && w == img.width ? img : resize_bicubic(img, h, w), cfg);
  } catch (const Error& e) {
    if (img.name.empty()) throw;
    fail("image '{}': {}", img.name, e.what());
  }
}

}  // namespace fovea::image
