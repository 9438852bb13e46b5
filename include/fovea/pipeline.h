// fovea/pipeline.h: from images to per-image visual tokens, the one path that `fovea encode`,
// `fovea serve`, `check-golden` and the benches share (src/engine/):
//   prepare_images  decode + preprocess a set of images in parallel, errors kept per image;
//   Batch           their patches and grids packed into one varlen batch;
//   EncoderRunner   the encoder forward the engine configuration selects (CPU or GPU, BF16 or FP8);
//   split_images    the packed outputs cut back into each image's rows (fp32, or bf16 views);
//   append_image_tensors  one image's tensors as `encode -o` writes them and `serve` returns them.
#pragma once
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
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
// releases its decode-memory reservation there). raw = true gives the compact uint8 patches
// (Patches::raw; what EncoderRunner::start uploads, normalized on the GPU).
std::vector<PreparedImage> prepare_images(size_t n, const std::function<image::Rgb8(size_t)>& decode,
                                          const image::PreprocessConfig& cfg,
                                          const std::function<void(size_t)>& done = {}, bool raw = false);

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

// One image's rows of EncoderOutputsBf16, as views into them (no copy): valid while they live.
struct ImageTensorsBf16 {
  std::span<const uint16_t> merged;                  // [tokens, out_hidden]
  std::vector<std::span<const uint16_t>> deepstack;  // each [tokens, out_hidden]
};
// A whole batch's bf16 outputs as views, the same shape (EncoderRunner::finish_views).
using EncoderOutputsView = ImageTensorsBf16;

// The same cut for bf16 outputs, never through fp32: each image's views into `out` (which must
// outlive them, hence no temporaries). Throws as above.
std::vector<ImageTensorsBf16> split_images(const EncoderOutputsBf16& out, const std::vector<qwen3vl::GridThw>& grids,
                                           const qwen3vl::VisionConfig& c);
std::vector<ImageTensorsBf16> split_images(EncoderOutputsBf16&&, const std::vector<qwen3vl::GridThw>&,
                                           const qwen3vl::VisionConfig&) = delete;
std::vector<ImageTensorsBf16> split_images(const EncoderOutputsView& out, const std::vector<qwen3vl::GridThw>& grids,
                                           const qwen3vl::VisionConfig& c);

// bf16 bits widened to fp32, exactly, on every core.
std::vector<float> widen_bf16(std::span<const uint16_t> v);

// ---- the encoder forward ----------------------------------------------------------------------------

class EncoderRunner {
 public:
  static constexpr size_t kInFlight = 2;  // batches started and not finished, at most (see start())
  // FP8 engines get the scale book make_scale_book() gives (dynamic, static or calibrating); every
  // forward advances calibration.
  EncoderRunner(const qwen3vl::Model& m, const EngineConfig& cfg);
  ~EncoderRunner();
  // GPU: sizes the device buffers for batches of up to `visual_tokens` once, and the pinned staging
  // of the next `batches` of them (their outputs with deepstack if asked for), so later batches of
  // any shape within it allocate nothing (a larger one still runs, growing them). No-op on the CPU.
  void reserve(int64_t visual_tokens, bool with_deepstack = false, int batches = int(kInFlight));

  // Pipelined use (serve, encode): start() packs the images' pixels straight into pinned memory
  // (raw uint8 patches as they are, normalized on the GPU; fp32 ones rounded to bf16; a batch is all
  // one or the other) and enqueues the plan, upload, forward and the outputs' copy back, without waiting for
  // the GPU; finish() waits for the oldest started batch and gives its outputs. Up to kInFlight
  // batches may be started and not finished, so the host prepares batch n+1 (and unpacks n-1)
  // while the GPU runs batch n. On the CPU, start() runs the whole forward.
  void start(const std::vector<const image::Patches*>& images, bool with_deepstack);
  void start(const Batch& batch, bool with_deepstack);
  void finish(EncoderOutputsBf16& out);  // throws if nothing is in flight
  // finish() without the copy: views of the outputs where they landed (the GPU's pinned staging; on
  // the CPU, the runner's own rounded copy), valid until the next start().
  EncoderOutputsView finish_views();
  size_t in_flight() const;

  // start() + finish(). with_deepstack = false leaves `deepstack` empty (on the GPU they are then
  // not copied back). run() gives fp32: the GPU's bf16 widened, the CPU's fp32 as computed.
  EncoderOutputs run(const Batch& batch, bool with_deepstack = true);
  EncoderOutputsBf16 run_bf16(const Batch& batch, bool with_deepstack = true);
  // The same into `out`, whose vectors are reused where large enough (warm memory, no page faults).
  void run_bf16(const Batch& batch, bool with_deepstack, EncoderOutputsBf16& out);
  ScaleBook* book() { return book_ ? &*book_ : nullptr; }  // null for BF16

  // Where the last finished batch spent its time, ms: `plan` (host: the batch shape), `upload`
  // (host: pixels packed into pinned bf16; plus the GPU's copy), `forward` (GPU), `download` (the
  // GPU's copy back; plus host: unpacking into the output vectors), and `gpu`, the GPU's time from
  // the upload's start to the copy back's end (what "GPU busy" sums). On the CPU all of it is
  // `forward` and `gpu`.
  struct Timings {
    double plan = 0, upload = 0, forward = 0, download = 0, gpu = 0;
  };
  const Timings& last_timings() const { return timings_; }
  // Non-finite amax values the scale book has ignored so far, all layers, as of the last finished
  // batch (0 for BF16 and static scales). No synchronization: the rings come back with the outputs.
  uint64_t nonfinite_amax() const;

 private:
  struct Gpu;
  struct Flight;
  void start_cpu(const Batch& batch, bool with_deepstack);
  // Pops the oldest batch, waits for it and times it: `cpu` takes the CPU forward's result (and
  // whether deepstack was asked for), `gpu` collects the GPU download's ticket (timed as download).
  void finish_oldest(const std::function<void(qwen3vl::ForwardResult&, bool)>& cpu,
                     const std::function<void(int64_t)>& gpu);
  // pack(dst) writes the batch's pixels into dst: raw uint8 samples, or bf16.
  void start_gpu(const std::vector<qwen3vl::GridThw>& grids, bool with_deepstack, bool raw,
                 const std::function<void(void*)>& pack, const image::Patches::Normalization* norm);
  const qwen3vl::Model& model_;
  EngineConfig cfg_;
  std::optional<ScaleBook> book_;
  std::vector<FineScales> fine_;  // static robust FP8: the scale file's fine scales per layer
  std::unique_ptr<Gpu> gpu_;
  std::deque<std::unique_ptr<Flight>> flights_;
  EncoderOutputsBf16 cpu_views_;  // what finish_views() points into on the CPU
  Timings timings_;
};

// ---- outputs ----------------------------------------------------------------------------------------

// One image's tensors, appended to `out`: "image.<j>.embeddings" [tokens, out_hidden],
// "image.<j>.deepstack.<k>" for each of t.deepstack (F32 from ImageTensors, BF16 from
// ImageTensorsBf16, the bits as they are, as views: the rows must outlive the write), and
// "image.<j>.grid_thw" [3] (always F32). kind "video" names a clip's the same way ("video.<j>. ...").
void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g,
                          const qwen3vl::VisionConfig& c, const ImageTensors& t, std::string_view kind = "image");
void append_image_tensors(std::vector<TensorToWrite>& out, size_t j, const qwen3vl::GridThw& g,
                          const qwen3vl::VisionConfig& c, const ImageTensorsBf16& t, std::string_view kind = "image");

}  // namespace fovea
