// fovea/encoder.h: the Qwen3-VL vision encoder on the GPU: bf16 activations, cuBLASLt GEMMs with
// bias / GELU / residual fused into their epilogues, attention through the FOVEA backend (BF16 or
// FP8, Hopper) or the CUDNN one (BF16).
//   plan(grids)  once per set of image grids: lays every activation buffer out in one device
//                arena (allocating only when the batch is the largest yet; nothing is allocated in
//                the layer loop); the position-embedding and RoPE tables are computed on the GPU
//                and the attention plan's uploads are enqueued, all without waiting. Not capturable.
//   forward()    the whole encoder from the device pixel buffer; no host synchronization, so it can
//                be captured in a CUDA graph and replayed (dynamic FP8 scaling included).
// Pipelining: everything up to download() only enqueues work on the stream, from pinned staging
// that is double-buffered, so the host plans and stages batch n+1 while the GPU runs batch n;
// collect() is the one wait, for that batch's outputs.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "fovea/attention.h"
#include "fovea/model.h"
#include "fovea/scales.h"

namespace fovea::qwen3vl {

// A model of any configuration with fovea's deterministic synthetic weights (what the
// synthetic:<preset> models use), e.g. an 8B-shaped encoder with fewer blocks for tests.
Model synthetic_model(const VisionConfig& config);
// Outlier channels as trained ViTs carry them, put into every block's qkv: per head, K channels 2, 13
// and hd/2 - 6 (three rotary pairs, fast to slow frequency; two at head_dim 16) offset by +40 through the bias, Q's
// channel 7 by +15, V's channel 5 scaled x20 (weights and bias). What the synthetic:<preset>-outliers
// models are; the FP8 schemes are measured on them (docs/fp8.md §Outlier channels).
void add_outlier_channels(Model& m);

// Encoder CUDA graphs (vLLM's compilation config: cudagraph_mm_encoder,
// encoder_cudagraph_token_budgets, encoder_cudagraph_max_vision_items_per_batch): one graph per budget
// of merged (output) tokens, captured once, replayed for every batch that fits one; the attention
// reads the batch's segments on the device (docs/architecture.md §Encoder CUDA graphs).
struct GraphBudgets {
  std::vector<int64_t> tokens;  // ascending, distinct; empty: no graphs
  // Attention segments per graph batch: an image is one, a clip one per temporal patch of frames.
  int max_items = 0;
  bool on() const { return !tokens.empty(); }
  // The smallest budget a batch of `tokens` merged tokens in `segments` segments fits, or -1 (eager).
  int pick(int64_t tokens, int64_t segments) const;
};
// Small batches only, in steps of at most 2x (1.5x above 1024): there the host's planning and launches
// are what a graph saves, while a large batch's padding would cost GPU time that an eager forward,
// planned on the host behind the batch before it, does not (bench/RESULTS.md, issue 48's ladders).
inline constexpr int64_t kDefaultGraphBudgets[] = {256, 512, 1024, 1536, 2048, 3072, 4096};
inline constexpr int kDefaultGraphItems = 32;
inline constexpr int64_t kMaxGraphBudget = int64_t(1) << 20;  // merged tokens (4M patches)
inline constexpr size_t kMaxGraphBudgets = 32;

// What the encoder's graphs did: captured, batches replayed through one, batches run eagerly because
// none fit them (more merged tokens than the largest budget, or more segments than max_items).
struct GraphCounts {
  int64_t captured = 0, replays = 0, eager = 0;
  double capture_ms = 0;  // host time of capture_graphs()
};

namespace cuda {

struct EncoderOptions {
  AttnDtype dtype = AttnDtype::BF16;  // BF16 or FP8 attention
  // FP8 only: the scale book; DYNAMIC and CALIBRATE keep their rings in device memory (copied back
  // to the book after each forward only when calibrating), STATIC uploads its scales once and keeps
  // the static guard's counts on the device (docs/fp8.md §Static guard), copied back into the book
  // with every download's outputs.
  ScaleBook* scales = nullptr;
  // The blocks' qkv, proj, fc1 and fc2 as FP8 GEMMs (E4M3, per-token activation and per-channel
  // weight scales, fp32 accumulation; docs/fp8.md §FP8 linears). fovea's own option, off by default.
  bool fp8_linears = false;
  // FP8 only: what each layer quantizes with (fovea/fp8-plan.h; copied; the book's mode and layers
  // must match it): per tensor, or the robust scheme (docs/fp8.md §Outlier channels) with the file's
  // arrays (static) or with arrays from each batch and the layer's history, kept on the device
  // (sync_scales() copies it back). Null: every layer per tensor, as the book's mode says.
  const Fp8Plan* fp8_plan = nullptr;
  AttnBackend backend = AttnBackend::FOVEA;  // FOVEA (Hopper) or CUDNN (BF16, sm_80 and later)
  // Encoder CUDA graphs per token budget (FOVEA only): capture_graphs() captures them, plan() picks one.
  GraphBudgets graphs = {};
};

class Encoder {
 public:
  Encoder(const Model& model, const EncoderOptions& options);
  ~Encoder();
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  // Sizes the device arena every per-batch buffer lives in for batches of up to `patches` patches
  // (plan() grows it when a batch needs more, and never shrinks it), and the pinned staging of the
  // next `batches` (1 or 2) such batches: raw pixels in, outputs back (deepstack included if asked
  // for). The first batches then allocate and fault in nothing. Call it between batches.
  void reserve(int64_t patches, bool with_deepstack = false, int batches = 2);
  void plan(const std::vector<GridThw>& grids, cudaStream_t stream = nullptr);
  // The current plan's tables as the GPU computed them, copied back (synchronous; for checks):
  // position embedding bf16 bits [N, hidden], RoPE cos and sin [N, hd/2].
  void grid_tables(std::vector<uint16_t>& pe, std::vector<float>& cos, std::vector<float>& sin) const;
  // Pinned host memory for this plan's pixels, bf16 bits [N, patch_dim] (docs/encoder.md §Patch
  // embedding: rounded from fp32 as transformers does); fill it, then upload_staged() enqueues the
  // copy. Two stagings alternate: the one before last must have been uploaded (it waits for that).
  uint16_t* pixel_staging();
  void upload_staged(cudaStream_t stream);
  // The compact form: pinned memory for this plan's raw uint8 patches [N, 3*patch*patch]
  // (image::Patches::raw); upload_raw() enqueues their copy and, on the device, the rescale /
  // normalize / temporal copies image::patchify does on the host, with the same float32 arithmetic.
  uint8_t* raw_staging();
  void upload_raw(const float mean[3], const float std[3], cudaStream_t stream);
  // pixels [N, patch_dim] fp32, rounded to bf16 into the staging and uploaded (enqueued).
  void upload_pixels(const std::vector<float>& pixels, cudaStream_t stream);
  // Runs the planned batch: the graph of its budget when plan() picked one, else eagerly.
  void forward(cudaStream_t stream);
  // options.graphs: one CUDA graph per budget, each the schedule step (reading the segments the next
  // plan() uploads) and the forward over the budget's rows, the arena sized once for the largest
  // budget (its graphs' buffers never move: a batch larger than it gets an arena of its own). Nothing
  // runs while capturing, so the FP8 scale state is untouched. Call once, before the first plan();
  // returns the number captured. plan() then picks the smallest budget that holds the batch (its
  // merged tokens and segments), zero-fills the rows past the batch, and forward() replays the graph.
  int capture_graphs(cudaStream_t stream);
  GraphCounts graph_counts() const;
  // Copies the device rings and scales (static: the guard's counts) into the scale book (syncs). The
  // calibration step after a forward (ScaleBook::after_forward) is the caller's: EncoderRunner's.
  void sync_scales(cudaStream_t stream);
  // Enqueues the copy of the outputs (merged, then each deepstack output if asked for, each
  // [N/4, out_hidden] bf16) and of the FP8 rings into pinned memory, and returns its ticket; two
  // downloads may wait to be collected at once.
  int64_t download(bool with_deepstack, cudaStream_t stream);
  // Waits for download `ticket` and gives its outputs as bf16 bits into `out` (resized; vectors
  // large enough are reused without reallocation); the rings go to the scale book.
  void collect(int64_t ticket, std::vector<std::vector<uint16_t>>& out);
  // The same without a copy: views of the outputs where they landed in pinned memory (merged
  // first), valid until the download after next (ticket + 2) reuses that memory.
  std::vector<std::span<const uint16_t>> collect_views(int64_t ticket);
  // download() and collect() at once: bf16 bits, or widened to fp32.
  void outputs_bf16(bool with_deepstack, std::vector<std::vector<uint16_t>>& out, cudaStream_t stream);
  std::vector<float> merged(cudaStream_t stream);                  // [N/4, out_hidden]
  std::vector<std::vector<float>> deepstack(cudaStream_t stream);  // each [N/4, out_hidden]
  int64_t tokens() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// For checks: y = x W^T + b (+ residual) (tanh-GELU) through the encoder's own GEMM path on the
// GPU, in FP8 as EncoderOptions::fp8_linears runs it (x quantized on the device) or in BF16. x and
// residual are rounded to bf16 on the way in; y is the bf16 result, widened. Synchronous.
std::vector<float> linear_on_gpu(const Linear& l, const std::vector<float>& x, int64_t rows, bool fp8,
                                 const std::vector<float>* residual = nullptr, bool gelu = false);

}  // namespace cuda
}  // namespace fovea::qwen3vl
