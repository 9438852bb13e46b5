// The image-batch steps of fovea/pipeline.h: decode + preprocess in parallel, pack, split, and the
// per-image output tensors.
#include <chrono>
#include <cstring>

#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"

namespace fovea {

int64_t image_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g) {
  return int64_t(g[0]) * g[1] * g[2] / (int64_t(c.merge) * c.merge);
}

std::string PreparedImage::error_message() const {
  if (!error) return {};
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

std::vector<PreparedImage> prepare_images(size_t n, const std::function<image::Rgb8(size_t)>& decode,
                                          const image::PreprocessConfig& cfg, const std::function<void(size_t)>& done) {
  using clock = std::chrono::steady_clock;
  const auto ms_since = [](clock::time_point t) {
    return std::chrono::duration<double, std::milli>(clock::now() - t).count();
  };
  std::vector<PreparedImage> out(n);
  parallel_for(int64_t(n), [&](int64_t k) {
    PreparedImage& p = out[size_t(k)];
    try {
      const auto t = clock::now();
      const image::Rgb8 img = decode(size_t(k));
      p.decode_ms = ms_since(t);
      const auto t2 = clock::now();
      p.patches = image::preprocess(img, cfg);
      p.preprocess_ms = ms_since(t2);
    } catch (...) {
      p.patches = {};
      p.error = std::current_exception();
    }
    if (done) done(size_t(k));
  });
  return out;
}

void Batch::add(image::Patches&& p) {
  pixels.insert(pixels.end(), p.pixels.begin(), p.pixels.end());
  grids.push_back(p.grid);
  std::vector<float>().swap(p.pixels);
}

int64_t Batch::tokens(const qwen3vl::VisionConfig& c) const {
  int64_t t = 0;
  for (const auto& g : grids) t += image_tokens(c, g);
  return t;
}

std::vector<ImageTensors> split_images(EncoderOutputs&& out, const std::vector<qwen3vl::GridThw>& grids,
                                       const qwen3vl::VisionConfig& c) {
  const size_t O = size_t(c.out_hidden);
  size_t rows = 0;
  for (const auto& g : grids) rows += size_t(image_tokens(c, g));
  if (out.merged.size() != rows * O)
    fail("split_images: the encoder gave {} values for {} images of {} visual tokens x {}", out.merged.size(),
         grids.size(), rows, O);
  for (const auto& d : out.deepstack)
    if (d.size() != rows * O) fail("split_images: a deepstack output has {} values, not {}", d.size(), rows * O);
  std::vector<ImageTensors> images(grids.size());
  size_t row = 0;
  for (size_t i = 0; i < grids.size(); ++i) {
    const size_t tokens = size_t(image_tokens(c, grids[i]));
    const auto rows_of = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + long(row * O), v.begin() + long((row + tokens) * O));
    };
    images[i].merged = rows_of(out.merged);
    for (const auto& d : out.deepstack) images[i].deepstack.push_back(rows_of(d));
    row += tokens;
  }
  out = {};
  return images;
}

namespace {
TensorToWrite f32_tensor(const std::string& name, std::vector<int64_t> shape, const float* data, size_t n) {
  TensorToWrite t{name, DType::F32, std::move(shape), std::vector<uint8_t>(n * 4)};
  std::memcpy(t.bytes.data(), data, n * 4);
  return t;
}
}  // namespace

void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g,
                          const qwen3vl::VisionConfig& c, const ImageTensors& t) {
  const std::string p = "image." + std::to_string(j);
  const int64_t tokens = image_tokens(c, g);
  const size_t n = size_t(tokens) * size_t(c.out_hidden);
  if (t.merged.size() != n) fail("image {}: {} embedding values, not {} x {}", j, t.merged.size(), tokens, c.out_hidden);
  out.push_back(f32_tensor(p + ".embeddings", {tokens, c.out_hidden}, t.merged.data(), n));
  for (size_t k = 0; k < t.deepstack.size(); ++k) {
    if (t.deepstack[k].size() != n) fail("image {}: deepstack {} has {} values, not {}", j, k, t.deepstack[k].size(), n);
    out.push_back(f32_tensor(p + ".deepstack." + std::to_string(k), {tokens, c.out_hidden}, t.deepstack[k].data(), n));
  }
  const float gf[3] = {float(g[0]), float(g[1]), float(g[2])};
  out.push_back(f32_tensor(p + ".grid_thw", {3}, gf, 3));
}

}  // namespace fovea
