// The encoder forward as the engine flags ask: CPU (reference forward with BF16 / FP8-emulated
// attention) or GPU (cuda::Encoder, weights uploaded once), FP8 with the engine's scale book.
// Used by encode, serve, check-golden and bench mm-processor.
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "fovea/engine.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"

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
  // with_deepstack = false leaves `deepstack` empty (on the GPU they are then not copied back).
  EncoderOutputs run(const std::vector<float>& pixels, const std::vector<qwen3vl::GridThw>& grids,
                     bool with_deepstack = true);
  ScaleBook* book() { return book_ ? &*book_ : nullptr; }  // null for BF16
  // Where the last run() spent its time (host wall clock, ms): planning the batch shape, pixel
  // conversion + upload, the forward on the device (synchronized), outputs back + conversion. On
  // the CPU all of it is `forward`.
  struct Timings {
    double plan = 0, upload = 0, forward = 0, download = 0;
  };
  const Timings& last_timings() const { return timings_; }
  // Non-finite amax values the scale book has ignored so far, all layers (0 for BF16 and static
  // scales). On the GPU this copies the device rings into the book first (one small sync).
  uint64_t nonfinite_amax();

 private:
  struct Gpu;
  const qwen3vl::Model& model_;
  EngineConfig cfg_;
  std::optional<ScaleBook> book_;
  std::unique_ptr<Gpu> gpu_;
  Timings timings_;
};

// Visual tokens (merger output rows) of one image: t*h*w / merge^2.
int64_t image_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g);

// One image's tensors as `fovea encode -o` writes them and `fovea serve` returns them, appended to
// `out`, all fp32: "image.<j>.embeddings" [tokens, out_hidden] from `merged` (the image's first row),
// "image.<j>.deepstack.<k>" likewise from each of `deepstack`, and "image.<j>.grid_thw" [3].
void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g, int64_t tokens,
                          int out_hidden, const float* merged, const std::vector<const float*>& deepstack);

}  // namespace fovea::cli
