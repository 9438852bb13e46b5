// EncoderRunner (fovea/pipeline.h): the CPU or GPU encoder forward the engine configuration selects.
#include <chrono>

#include "fovea/bf16.h"
#include "fovea/encoder.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"
#if FOVEA_HAVE_CUDA
#include "fovea/cuda-support.h"
#endif

namespace fovea {

struct EncoderRunner::Gpu {
#if FOVEA_HAVE_CUDA
  qwen3vl::cuda::Encoder enc;
  Gpu(const qwen3vl::Model& m, const qwen3vl::cuda::EncoderOptions& o) : enc(m, o) {}
#endif
};

EncoderRunner::EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg) : model_(m), cfg_(cfg) {
  if (cfg.dtype == AttnDtype::FP8) book_ = make_scale_book(cfg, m.config.depth);
  if (cfg.device == Device::CUDA) {
#if FOVEA_HAVE_CUDA
    gpu_ = std::make_unique<Gpu>(m, qwen3vl::cuda::EncoderOptions{cfg.dtype, book()});
#else
    fail("--device cuda: this fovea was built without CUDA");
#endif
  }
}

EncoderRunner::~EncoderRunner() = default;

void EncoderRunner::reserve(int64_t visual_tokens) {
#if FOVEA_HAVE_CUDA
  if (gpu_) gpu_->enc.reserve(visual_tokens * model_.config.merge * model_.config.merge);
#else
  (void)visual_tokens;
#endif
}

namespace {
using clock_type = std::chrono::steady_clock;
// Milliseconds since t; t moves to now.
double lap(clock_type::time_point& t) {
  const auto now = clock_type::now();
  const double ms = std::chrono::duration<double, std::milli>(now - t).count();
  t = now;
  return ms;
}
}  // namespace

std::optional<qwen3vl::ForwardResult> EncoderRunner::forward(const Batch& batch) {
  timings_ = {};
  auto t = clock_type::now();
  if (!gpu_) {
    qwen3vl::ForwardOptions o;
    o.attention = cfg_.dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    o.scales = book();
    auto r = qwen3vl::forward_cpu(model_, batch.pixels, batch.grids, o);
    timings_.forward = lap(t);
    return r;
  }
#if FOVEA_HAVE_CUDA
  auto& enc = gpu_->enc;
  enc.plan(batch.grids);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  timings_.plan = lap(t);
  enc.upload_pixels(batch.pixels, nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  timings_.upload = lap(t);
  enc.forward(nullptr);
  enc.after_forward(nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  timings_.forward = lap(t);
#endif
  return std::nullopt;
}

EncoderOutputs EncoderRunner::run(const Batch& batch, bool with_deepstack) {
  EncoderOutputs out;
  std::optional<qwen3vl::ForwardResult> cpu = forward(batch);
  if (cpu) {
    out.merged = std::move(cpu->merged);
    if (with_deepstack) out.deepstack = std::move(cpu->deepstack);
    return out;
  }
#if FOVEA_HAVE_CUDA
  auto t = clock_type::now();
  out.merged = gpu_->enc.merged(nullptr);
  if (with_deepstack) out.deepstack = gpu_->enc.deepstack(nullptr);
  timings_.download = lap(t);
#endif
  return out;
}

namespace {
std::vector<uint16_t> narrow(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  parallel_ranges(int64_t(v.size()), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) b[size_t(i)] = bf16_from_float(v[size_t(i)]);
  });
  return b;
}
}  // namespace

void EncoderRunner::run_bf16(const Batch& batch, bool with_deepstack, EncoderOutputsBf16& out) {
  std::optional<qwen3vl::ForwardResult> cpu = forward(batch);
  if (cpu) {
    out.merged = narrow(cpu->merged);
    out.deepstack.clear();
    if (with_deepstack)
      for (const auto& d : cpu->deepstack) out.deepstack.push_back(narrow(d));
    return;
  }
#if FOVEA_HAVE_CUDA
  auto t = clock_type::now();
  std::vector<std::vector<uint16_t>> v;
  v.push_back(std::move(out.merged));
  for (auto& d : out.deepstack) v.push_back(std::move(d));
  gpu_->enc.outputs_bf16(with_deepstack, v, nullptr);
  out.merged = std::move(v[0]);
  out.deepstack.clear();
  for (size_t k = 1; k < v.size(); ++k) out.deepstack.push_back(std::move(v[k]));
  timings_.download = lap(t);
#endif
}

EncoderOutputsBf16 EncoderRunner::run_bf16(const Batch& batch, bool with_deepstack) {
  EncoderOutputsBf16 out;
  run_bf16(batch, with_deepstack, out);
  return out;
}

uint64_t EncoderRunner::nonfinite_amax() {
  if (!book_ || book_->mode() == ScaleMode::STATIC) return 0;
#if FOVEA_HAVE_CUDA
  if (gpu_) gpu_->enc.sync_scales(nullptr);
#endif
  uint64_t n = 0;
  for (int l = 0; l < book_->num_layers(); ++l) n += book_->nonfinite_count(l);
  return n;
}

}  // namespace fovea
