// EncoderRunner: the CPU or GPU encoder forward the engine configuration selects.
#include "cli/run-encoder.h"

#include <chrono>
#include <cstring>

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

EncoderOutputs EncoderRunner::run(const std::vector<float>& pixels, const std::vector<qwen3vl::GridThw>& grids,
                                  bool with_deepstack) {
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
  BENCH_CUDA(cudaDeviceSynchronize());
  timings_.plan = lap();
  enc.upload_pixels(pixels, nullptr);
  BENCH_CUDA(cudaDeviceSynchronize());
  timings_.upload = lap();
  enc.forward(nullptr);
  enc.after_forward(nullptr);
  BENCH_CUDA(cudaDeviceSynchronize());
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

int64_t image_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g) {
  return int64_t(g[0]) * g[1] * g[2] / (int64_t(c.merge) * c.merge);
}

namespace {
TensorToWrite f32_tensor(const std::string& name, std::vector<int64_t> shape, const float* data, size_t n) {
  TensorToWrite t{name, DType::F32, std::move(shape), std::vector<uint8_t>(n * 4)};
  std::memcpy(t.bytes.data(), data, n * 4);
  return t;
}
}  // namespace

void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g, int64_t tokens,
                          int out_hidden, const float* merged, const std::vector<const float*>& deepstack) {
  const std::string p = "image." + std::to_string(j);
  const size_t n = size_t(tokens) * size_t(out_hidden);
  out.push_back(f32_tensor(p + ".embeddings", {tokens, out_hidden}, merged, n));
  for (size_t k = 0; k < deepstack.size(); ++k)
    out.push_back(f32_tensor(p + ".deepstack." + std::to_string(k), {tokens, out_hidden}, deepstack[k], n));
  const float gf[3] = {float(g[0]), float(g[1]), float(g[2])};
  out.push_back(f32_tensor(p + ".grid_thw", {3}, gf, 3));
}

}  // namespace fovea::cli
