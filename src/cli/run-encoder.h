// One encoder forward as the engine flags ask: CPU (reference forward with BF16 / FP8-emulated
// attention) or GPU (cuda::Encoder), FP8 with the engine's scale book. Used by encode and
// check-golden.
#pragma once
#include <vector>

#include "fovea/engine.h"
#include "fovea/model.h"

namespace fovea::cli {

struct EncoderOutputs {
  std::vector<float> merged;                  // [N/4, out_hidden]
  std::vector<std::vector<float>> deepstack;  // each [N/4, out_hidden]
};

// `book` is the FP8 scale book (make_scale_book), null for BF16; calibration is advanced by one forward.
EncoderOutputs run_encoder(const qwen3vl::Model& m, const std::vector<float>& pixels,
                           const std::vector<qwen3vl::GridThw>& grids, const EngineConfig& cfg, ScaleBook* book);

}  // namespace fovea::cli
