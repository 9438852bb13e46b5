// run_encoder: the CPU or GPU encoder forward the engine configuration selects.
#include "cli/run-encoder.h"

#include "cli/bench-cuda.h"
#include "fovea/encoder.h"
#include "fovea/error.h"

namespace fovea::cli {

EncoderOutputs run_encoder(const qwen3vl::Model& m, const std::vector<float>& pixels,
                           const std::vector<qwen3vl::GridThw>& grids, const EngineConfig& cfg, ScaleBook* book) {
  EncoderOutputs out;
  if (cfg.device == Device::CPU) {
    qwen3vl::ForwardOptions o;
    o.attention = cfg.dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    o.scales = book;
    auto r = qwen3vl::forward_cpu(m, pixels, grids, o);
    out.merged = std::move(r.merged);
    out.deepstack = std::move(r.deepstack);
    return out;
  }
#if FOVEA_HAVE_CUDA
  qwen3vl::cuda::Encoder enc(m, {cfg.dtype, book});
  enc.plan(grids);
  enc.upload_pixels(pixels, nullptr);
  enc.forward(nullptr);
  enc.after_forward(nullptr);
  BENCH_CUDA(cudaDeviceSynchronize());
  out.merged = enc.merged(nullptr);
  out.deepstack = enc.deepstack(nullptr);
  return out;
#else
  fail("--device cuda: this fovea was built without CUDA");
#endif
}

}  // namespace fovea::cli
