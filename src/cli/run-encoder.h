// The encoder forward as the engine flags ask: CPU (reference forward with BF16 / FP8-emulated
// attention) or GPU (cuda::Encoder, weights uploaded once), FP8 with the engine's scale book.
// Used by encode, check-golden and bench mm-processor.
#pragma once
#include <memory>
#include <vector>

#include "fovea/engine.h"
#include "fovea/model.h"

namespace fovea::cli {

struct EncoderOutputs {
  std::vector<float> merged;                  // [N/4, out_hidden]
  std::vector<std::vector<float>> deepstack;  // each [N/4, out_hidden]
};

class EncoderRunner {
 public:
  // `book`: the FP8 scale book (make_scale_book), null for BF16; every run() advances calibration.
  EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg, ScaleBook* book);
  ~EncoderRunner();
  EncoderOutputs run(const std::vector<float>& pixels, const std::vector<qwen3vl::GridThw>& grids);

 private:
  struct Gpu;
  const qwen3vl::Model& model_;
  EngineConfig cfg_;
  ScaleBook* book_;
  std::unique_ptr<Gpu> gpu_;
};

}  // namespace fovea::cli
