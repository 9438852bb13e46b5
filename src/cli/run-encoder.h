// The encoder forward as the engine flags ask: CPU (reference forward with BF16 / FP8-emulated
// attention) or GPU (cuda::Encoder, weights uploaded once), FP8 with the engine's scale book.
// Used by encode, check-golden and bench mm-processor.
#pragma once
#include <memory>
#include <optional>
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
  // FP8 engines get the scale book make_scale_book() gives (dynamic, static or calibrating); every
  // run() advances calibration.
  EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg);
  ~EncoderRunner();
  EncoderOutputs run(const std::vector<float>& pixels, const std::vector<qwen3vl::GridThw>& grids);
  ScaleBook* book() { return book_ ? &*book_ : nullptr; }  // null for BF16

 private:
  struct Gpu;
  const qwen3vl::Model& model_;
  EngineConfig cfg_;
  std::optional<ScaleBook> book_;
  std::unique_ptr<Gpu> gpu_;
};

}  // namespace fovea::cli
