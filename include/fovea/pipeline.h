// fovea/pipeline.h: from images to per-image visual tokens, the one path that `fovea encode`,
// `fovea serve`, `check-golden` and the benches share (src/engine/):
//   prepare_images  decode + preprocess a set of images in parallel, errors kept per image;
//   Batch           their patches and grids packed into one varlen batch;
//   EncoderRunner   the encoder forward the engine configuration selects (CPU or GPU, BF16 or FP8);
//   split_images    the packed outputs cut back into each image's rows;
//   append_image_tensors  one image's tensors as `encode -o` writes them and `serve` returns them.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/model.h"
#include "fovea/safetensors.h"

namespace fovea {

// Visual tokens (merger output rows) of one image: t*h*w / merge^2.
int64_t image_tokens(const qwen3vl::VisionConfig& c, const qwen3vl::GridThw& g);

// ---- decode + preprocess ----------------------------------------------------------------------------

struct PreparedImage {
  image::Patches patches;     // empty when `error` is set
  std::exception_ptr error;   // what decoding or preprocessing threw, as thrown
  double decode_ms = 0, preprocess_ms = 0;
  std::string error_message() const;  // error's what(); empty if none
};

// Images 0..n-1, in parallel (fovea::parallel_for): decode(i) gives image i's pixels, then
// image::preprocess makes its patches. Whatever either throws is kept as that image's error; the
// others go on. done(i), if given, runs after image i is preprocessed or has failed (the server
// releases its decode-memory reservation there).
std::vector<PreparedImage> prepare_images(size_t n, const std::function<image::Rgb8(size_t)>& decode,
                                          const image::PreprocessConfig& cfg,
                                          const std::function<void(size_t)>& done = {});

// ---- one varlen batch -------------------------------------------------------------------------------

struct Batch {
  std::vector<float> pixels;             // [patches, patch_dim], the images one after another
  std::vector<qwen3vl::GridThw> grids;   // one per image
  // Moves one image's patches to the end (p.pixels is left empty: no second copy is kept).
  void add(image::Patches&& p);
  int64_t tokens(const qwen3vl::VisionConfig& c) const;  // visual tokens of all images
};

struct EncoderOutputs {
  std::vector<float> merged;                  // [tokens, out_hidden], the images one after another
  std::vector<std::vector<float>> deepstack;  // each [tokens, out_hidden]; empty if not asked for
};

// The same as bf16 bits (little-endian uint16): what the GPU computes and what an LLM consumes. The
// GPU path copies them back as they are (no fp32 copy); the CPU forward's fp32 is rounded to nearest.
struct EncoderOutputsBf16 {
  std::vector<uint16_t> merged;
  std::vector<std::vector<uint16_t>> deepstack;
};

// One image's rows of EncoderOutputs.
struct ImageTensors {
  std::vector<float> merged;                  // [tokens, out_hidden]
  std::vector<std::vector<float>> deepstack;  // each [tokens, out_hidden]
};

// Cuts packed outputs back into images (grids as in the batch); `out` is consumed. Throws if the
// row counts do not match the grids.
std::vector<ImageTensors> split_images(EncoderOutputs&& out, const std::vector<qwen3vl::GridThw>& grids,
                                       const qwen3vl::VisionConfig& c);

// ---- the encoder forward ----------------------------------------------------------------------------

class EncoderRunner {
 public:
  // FP8 engines get the scale book make_scale_book() gives (dynamic, static or calibrating); every
  // run() advances calibration.
  EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg);
  ~EncoderRunner();
  // GPU: sizes the device buffers for batches of up to `visual_tokens` once, so later batches of any
  // shape within it allocate nothing (a larger one still runs, growing them). No-op on the CPU.
  void reserve(int64_t visual_tokens);
  // with_deepstack = false leaves `deepstack` empty (on the GPU they are then not copied back).
  EncoderOutputs run(const Batch& batch, bool with_deepstack = true);
  EncoderOutputsBf16 run_bf16(const Batch& batch, bool with_deepstack = true);
  // The same into `out`, whose vectors are reused where large enough (warm memory, no page faults:
  // the server recycles them from forward to forward).
  void run_bf16(const Batch& batch, bool with_deepstack, EncoderOutputsBf16& out);
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
  // Runs the forward; the CPU's outputs are returned, the GPU's stay on the device.
  std::optional<qwen3vl::ForwardResult> forward(const Batch& batch);
  struct Gpu;
  const qwen3vl::Model& model_;
  EngineConfig cfg_;
  std::optional<ScaleBook> book_;
  std::unique_ptr<Gpu> gpu_;
  Timings timings_;
};

// ---- outputs ----------------------------------------------------------------------------------------

// One image's tensors, appended to `out`, all fp32: "image.<j>.embeddings" [tokens, out_hidden],
// "image.<j>.deepstack.<k>" for each of t.deepstack, and "image.<j>.grid_thw" [3].
void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g,
                          const qwen3vl::VisionConfig& c, const ImageTensors& t);

}  // namespace fovea
