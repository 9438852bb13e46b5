// EncoderRunner (fovea/pipeline.h): the CPU or GPU encoder forward the engine configuration selects.
#include <chrono>

#include "fovea/encoder.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
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

EncoderOutputs EncoderRunner::run(const Batch& batch, bool with_deepstack) {
  const std::vector<float>& pixels = batch.pixels;
  const std::vector<qwen3vl::GridThw>& grids = batch.grids;
  EncoderOutputs out;
  using clock = std::chrono::steady_clock;
  auto t = clock::now();
  auto lap = [&t] {
    const auto now = clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - t).count();
    t = now;
    return ms;
  };
  timings_ = {};
  if (!gpu_) {
    qwen3vl::ForwardOptions o;
    o.attention = cfg_.dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    o.scales = book();
    auto r = qwen3vl::forward_cpu(model_, pixels, grids, o);
    out.merged = std::move(r.merged);
    if (with_deepstack) out.deepstack = std::move(r.deepstack);
    timings_.forward = lap();
    return out;
  }
#if FOVEA_HAVE_CUDA
  auto& enc = gpu_->enc;
  enc.plan(grids);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  timings_.plan = lap();
  enc.upload_pixels(pixels, nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  timings_.upload = lap();
  enc.forward(nullptr);
  enc.after_forward(nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  timings_.forward = lap();
  out.merged = enc.merged(nullptr);
  if (with_deepstack) out.deepstack = enc.deepstack(nullptr);
  timings_.download = lap();
#endif
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
