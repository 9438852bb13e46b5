// The forward-shaped steps of fovea/pipeline.h: packing inputs into forwards, a varlen batch, the
// outputs cut back into inputs, and each input's tensors.
#include <bit>
#include <cstring>

#include <fmt/format.h>

#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"

namespace fovea {

bool ForwardPacker::take(int64_t tokens) {
  if (inputs_ > 0 && tokens_ + tokens > max_) return false;
  tokens_ += tokens;
  inputs_ += 1;
  return true;
}

std::vector<std::pair<size_t, size_t>> pack_forwards(std::span<const int64_t> tokens, int64_t max_tokens) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t b = 0; b < tokens.size();) {
    ForwardPacker f(max_tokens);
    size_t e = b;
    while (e < tokens.size() && f.take(tokens[e])) ++e;
    out.emplace_back(b, e);
    b = e;
  }
  return out;
}

void Batch::add(image::Patches&& p) {
  pixels.insert(pixels.end(), p.pixels.begin(), p.pixels.end());
  grids.push_back(p.grid);
  std::vector<float>().swap(p.pixels);
}

int64_t Batch::tokens(const qwen3vl::VisionConfig& c) const {
  int64_t t = 0;
  for (const auto& g : grids) t += visual_tokens(c, g);
  return t;
}

Bf16Rows rows_of(const EncoderOutputsBf16& out) {
  Bf16Rows v{out.merged, {}};
  for (const auto& d : out.deepstack) v.deepstack.emplace_back(d);
  return v;
}

namespace {
// Throws unless every output in `out` (EncoderOutputs or Bf16Rows) holds exactly the rows of the
// inputs (grids as in the forward).
template <class Outputs>
void check_rows(const Outputs& out, const std::vector<qwen3vl::GridThw>& grids, const qwen3vl::VisionConfig& c) {
  const size_t O = size_t(c.out_hidden);
  size_t rows = 0;
  for (const auto& g : grids) rows += size_t(visual_tokens(c, g));
  if (out.merged.size() != rows * O)
    fail("split_inputs: the encoder gave {} values for {} inputs of {} visual tokens x {}", out.merged.size(),
         grids.size(), rows, O);
  for (const auto& d : out.deepstack)
    if (d.size() != rows * O) fail("split_inputs: a deepstack output has {} values, not {}", d.size(), rows * O);
}

// Calls cut(i, first value, values) for each input's rows.
template <class F>
void for_each_input(const std::vector<qwen3vl::GridThw>& grids, const qwen3vl::VisionConfig& c, F&& cut) {
  size_t at = 0;
  for (size_t i = 0; i < grids.size(); ++i) {
    const size_t n = size_t(visual_tokens(c, grids[i])) * size_t(c.out_hidden);
    cut(i, at, n);
    at += n;
  }
}
}  // namespace

std::vector<Bf16Rows> split_inputs(const Bf16Rows& out, const std::vector<qwen3vl::GridThw>& grids,
                                   const qwen3vl::VisionConfig& c) {
  check_rows(out, grids, c);
  std::vector<Bf16Rows> inputs(grids.size());
  for_each_input(grids, c, [&](size_t i, size_t at, size_t n) {
    inputs[i].merged = out.merged.subspan(at, n);
    for (const auto& d : out.deepstack) inputs[i].deepstack.push_back(d.subspan(at, n));
  });
  return inputs;
}

std::vector<F32Rows> split_inputs(EncoderOutputs&& out, const std::vector<qwen3vl::GridThw>& grids,
                                  const qwen3vl::VisionConfig& c) {
  check_rows(out, grids, c);
  std::vector<F32Rows> inputs(grids.size());
  for_each_input(grids, c, [&](size_t i, size_t at, size_t n) {
    const auto cut = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + long(at), v.begin() + long(at + n));
    };
    inputs[i].merged = cut(out.merged);
    for (const auto& d : out.deepstack) inputs[i].deepstack.push_back(cut(d));
  });
  out = {};
  return inputs;
}

std::vector<float> widen_bf16(std::span<const uint16_t> v) {
  std::vector<float> f(v.size());
  parallel_ranges(int64_t(v.size()), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) f[size_t(i)] = bf16_to_float(v[size_t(i)]);
  });
  return f;
}

// ---- OutputTensors ---------------------------------------------------------------------------------

namespace {
static_assert(std::endian::native == std::endian::little, "tensors are written as they lie in memory");

template <class T>
TensorToWrite view_of(const std::string& name, DType dtype, std::vector<int64_t> shape, std::span<const T> v) {
  TensorToWrite t{name, dtype, std::move(shape), {}, {}};
  t.view = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size_bytes());
  return t;
}

// One input's embeddings and deepstack outputs, checked against its grid, as views.
template <class T>
void append_rows(std::vector<TensorToWrite>& out, const std::string& p, const qwen3vl::GridThw& g,
                 const qwen3vl::VisionConfig& c, DType dtype, std::span<const T> merged,
                 const std::vector<std::span<const T>>& deepstack) {
  const int64_t tokens = visual_tokens(c, g);
  const size_t n = size_t(tokens) * size_t(c.out_hidden);
  if (merged.size() != n) fail("{}: {} embedding values, not {} x {}", p, merged.size(), tokens, c.out_hidden);
  out.push_back(view_of(p + ".embeddings", dtype, {tokens, c.out_hidden}, merged));
  for (size_t k = 0; k < deepstack.size(); ++k) {
    if (deepstack[k].size() != n) fail("{}: deepstack {} has {} values, not {}", p, k, deepstack[k].size(), n);
    out.push_back(view_of(p + ".deepstack." + std::to_string(k), dtype, {tokens, c.out_hidden}, deepstack[k]));
  }
}
}  // namespace

std::string OutputTensors::prefix(InputKind kind, const std::optional<ClipSampling>& clip) {
  const std::string p = fmt::format("{}.{}", input_kind_name(kind), count_[size_t(kind)]++);
  if (clip) {
    meta[p + ".fps"] = fmt::format("{}", clip->fps);
    meta[p + ".frame_indices"] = fmt::format("[{}]", fmt::join(clip->frame_indices, ", "));
  }
  return p;
}

std::string OutputTensors::add(InputKind kind, const qwen3vl::GridThw& g, const Bf16Rows& rows, bool widen,
                               const std::optional<ClipSampling>& clip) {
  if (!widen) {
    const std::string p = prefix(kind, clip);
    append_rows<uint16_t>(tensors_, p, g, c_, DType::BF16, rows.merged, rows.deepstack);
    add_grid_and_times(p, g, clip);
    return p;
  }
  owned_.push_back(widen_bf16(rows.merged));
  const std::span<const float> merged = owned_.back();
  std::vector<std::span<const float>> deepstack;
  for (const auto& d : rows.deepstack) {
    owned_.push_back(widen_bf16(d));
    deepstack.emplace_back(owned_.back());
  }
  const std::string p = prefix(kind, clip);
  append_rows<float>(tensors_, p, g, c_, DType::F32, merged, deepstack);
  add_grid_and_times(p, g, clip);
  return p;
}

std::string OutputTensors::add(InputKind kind, const qwen3vl::GridThw& g, F32Rows&& rows,
                               const std::optional<ClipSampling>& clip) {
  owned_.push_back(std::move(rows.merged));
  const std::span<const float> merged = owned_.back();
  std::vector<std::span<const float>> deepstack;
  for (auto& d : rows.deepstack) {
    owned_.push_back(std::move(d));
    deepstack.emplace_back(owned_.back());
  }
  const std::string p = prefix(kind, clip);
  append_rows<float>(tensors_, p, g, c_, DType::F32, merged, deepstack);
  add_grid_and_times(p, g, clip);
  return p;
}

void OutputTensors::add_grid_and_times(const std::string& p, const qwen3vl::GridThw& g,
                                       const std::optional<ClipSampling>& clip) {
  owned_.push_back({float(g[0]), float(g[1]), float(g[2])});
  tensors_.push_back(view_of<float>(p + ".grid_thw", DType::F32, {3}, owned_.back()));
  if (!clip) return;
  owned_.emplace_back(clip->timestamps.begin(), clip->timestamps.end());
  tensors_.push_back(view_of<float>(p + ".timestamps", DType::F32, {int64_t(owned_.back().size())}, owned_.back()));
}

size_t OutputTensors::bytes() const {
  size_t n = 0;
  for (const TensorToWrite& t : tensors_) n += t.data().size();
  return n;
}

}  // namespace fovea
