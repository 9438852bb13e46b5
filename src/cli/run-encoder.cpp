// EncoderRunner: the CPU or GPU encoder forward the engine configuration selects.
#include "cli/run-encoder.h"

#include "cli/bench-cuda.h"
#include "fovea/encoder.h"
#include "fovea/error.h"

namespace fovea::cli {

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

EncoderOutputs EncoderRunner::run(const std::vector<float>& pixels, const std::vector<qwen3vl::GridThw>& grids) {
  EncoderOutputs out;
  if (!gpu_) {
    qwen3vl::ForwardOptions o;
    o.attention = cfg_.dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    o.scales = book();
    auto r = qwen3vl::forward_cpu(model_, pixels, grids, o);
    out.merged = std::move(r.merged);
    out.deepstack = std::move(r.deepstack);
    return out;
  }
#if FOVEA_HAVE_CUDA
  auto& enc = gpu_->enc;
  enc.plan(grids);
  enc.upload_pixels(pixels, nullptr);
  enc.forward(nullptr);
  enc.after_forward(nullptr);
  BENCH_CUDA(cudaDeviceSynchronize());
  out.merged = enc.merged(nullptr);
  out.deepstack = enc.deepstack(nullptr);
#endif
  return out;
}

}  // namespace fovea::cli
