// The image-batch steps of fovea/pipeline.h: decode + preprocess in parallel, pack, split, and the
// per-image output tensors.
#include <bit>
#include <chrono>
#include <cstring>

#include "fovea/bf16.h"
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
                                          const image::PreprocessConfig& cfg, const std::function<void(size_t)>& done,
                                          bool raw) {
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
      p.patches = image::preprocess(img, cfg, raw);
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

namespace {
// Throws unless every output in `out` (EncoderOutputs or EncoderOutputsView) holds exactly the rows
// of the images (grids as in the batch).
template <class Outputs>
void check_rows(const Outputs& out, const std::vector<qwen3vl::GridThw>& grids, const qwen3vl::VisionConfig& c) {
  const size_t O = size_t(c.out_hidden);
  size_t rows = 0;
  for (const auto& g : grids) rows += size_t(image_tokens(c, g));
  if (out.merged.size() != rows * O)
    fail("split_images: the encoder gave {} values for {} images of {} visual tokens x {}", out.merged.size(),
         grids.size(), rows, O);
  for (const auto& d : out.deepstack)
    if (d.size() != rows * O) fail("split_images: a deepstack output has {} values, not {}", d.size(), rows * O);
}
}  // namespace

std::vector<ImageTensors> split_images(EncoderOutputs&& out, const std::vector<qwen3vl::GridThw>& grids,
                                       const qwen3vl::VisionConfig& c) {
  check_rows(out, grids, c);
  const size_t O = size_t(c.out_hidden);
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

std::vector<ImageTensorsBf16> split_images(const EncoderOutputsBf16& out, const std::vector<qwen3vl::GridThw>& grids,
                                           const qwen3vl::VisionConfig& c) {
  EncoderOutputsView v{out.merged, {}};
  for (const auto& d : out.deepstack) v.deepstack.emplace_back(d);
  return split_images(v, grids, c);
}

std::vector<ImageTensorsBf16> split_images(const EncoderOutputsView& out, const std::vector<qwen3vl::GridThw>& grids,
                                           const qwen3vl::VisionConfig& c) {
  check_rows(out, grids, c);
  const size_t O = size_t(c.out_hidden);
  std::vector<ImageTensorsBf16> images(grids.size());
  size_t row = 0;
  for (size_t i = 0; i < grids.size(); ++i) {
    const size_t tokens = size_t(image_tokens(c, grids[i]));
    const auto rows_of = [&](std::span<const uint16_t> v) { return v.subspan(row * O, tokens * O); };
    images[i].merged = rows_of(out.merged);
    for (const auto& d : out.deepstack) images[i].deepstack.push_back(rows_of(d));
    row += tokens;
  }
  return images;
}

namespace {
static_assert(std::endian::native == std::endian::little, "tensors are written as they lie in memory");

template <class T>
TensorToWrite tensor_of(const std::string& name, DType dtype, std::vector<int64_t> shape, std::span<const T> v,
                        bool copy) {
  TensorToWrite t{name, dtype, std::move(shape), {}, {}};
  if (copy) {
    t.bytes.resize(v.size_bytes());
    std::memcpy(t.bytes.data(), v.data(), v.size_bytes());
  } else {
    t.view = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size_bytes());
  }
  return t;
}

// T: float (F32) or bf16 bits (BF16); copy = false writes views of merged and deepstack.
template <class T>
void append_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g, const qwen3vl::VisionConfig& c,
                    DType dtype, std::span<const T> merged, const std::vector<std::span<const T>>& deepstack, bool copy,
                    std::string_view kind) {
  const std::string p = std::string(kind) + "." + std::to_string(j);
  const int64_t tokens = image_tokens(c, g);
  const size_t n = size_t(tokens) * size_t(c.out_hidden);
  if (merged.size() != n) fail("image {}: {} embedding values, not {} x {}", j, merged.size(), tokens, c.out_hidden);
  out.push_back(tensor_of(p + ".embeddings", dtype, {tokens, c.out_hidden}, merged, copy));
  for (size_t k = 0; k < deepstack.size(); ++k) {
    if (deepstack[k].size() != n) fail("image {}: deepstack {} has {} values, not {}", j, k, deepstack[k].size(), n);
    out.push_back(tensor_of(p + ".deepstack." + std::to_string(k), dtype, {tokens, c.out_hidden}, deepstack[k], copy));
  }
  const float gf[3] = {float(g[0]), float(g[1]), float(g[2])};
  out.push_back(tensor_of(p + ".grid_thw", DType::F32, {3}, std::span<const float>(gf), true));
}
}  // namespace

void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g,
                          const qwen3vl::VisionConfig& c, const ImageTensors& t, std::string_view kind) {
  const std::vector<std::span<const float>> deepstack(t.deepstack.begin(), t.deepstack.end());
  append_tensors<float>(out, j, g, c, DType::F32, t.merged, deepstack, true, kind);
}

void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g,
                          const qwen3vl::VisionConfig& c, const ImageTensorsBf16& t, std::string_view kind) {
  append_tensors<uint16_t>(out, j, g, c, DType::BF16, t.merged, t.deepstack, false, kind);  // views: no copy
}

std::vector<float> widen_bf16(std::span<const uint16_t> v) {
  std::vector<float> f(v.size());
  parallel_ranges(int64_t(v.size()), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) f[size_t(i)] = bf16_to_float(v[size_t(i)]);
  });
  return f;
}

}  // namespace fovea
