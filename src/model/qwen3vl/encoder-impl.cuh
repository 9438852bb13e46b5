// The GPU encoder's state (fovea/encoder.h), shared by its forward (forward-cuda.cu) and its batch
// plumbing (encoder-batch.cu): weights, FP8 scale state, the batch's buffers and the host staging.
#pragma once
#include <memory>
#include <span>
#include <vector>

#include "fovea/attention.h"
#include "fovea/attention-gpu.h"
#include "fovea/cuda-support.h"
#include "fovea/encoder.h"
#include "model/qwen3vl/gemm.cuh"
#include "model/qwen3vl/pixels.cuh"
#include "model/qwen3vl/rows.cuh"
#include "model/qwen3vl/weights-cuda.cuh"

namespace fovea::qwen3vl::cuda {

struct Encoder::Impl {
  VisionConfig cfg;
  EncoderOptions opt;
  Gemm gemm;
  Owner owned;  // weights and scale state
  DevLinear patch;
  float* pos_table = nullptr;  // device [G*G, hidden], resampled to the grids per plan()
  std::vector<DevBlock> blocks;
  DevMerger merger;
  std::vector<DevMerger> deepstack;
  std::unique_ptr<fovea::cuda::Attention> attn;  // FOVEA or CUDNN
  LayerAmax* amax = nullptr;                     // FP8 dynamic / calibrate: [depth] rings on the device
  float* fixed = nullptr;                        // FP8 static: [depth][3]
  GuardCounts* guard = nullptr;                  // FP8 static: [depth] the static guard's running counts
  Fp8Plan plan;                                  // FP8: each layer's scheme
  // The robust scheme: ROBUST_STATIC layers' arrays [depth] (the others' null), and the one set every
  // ROBUST_DYNAMIC layer refills from its batch and its history on the device (the book's, copied back
  // by sync_scales).
  std::vector<fovea::cuda::FineArrays> fine_static;
  fovea::cuda::FineArrays fine_batch;
  std::vector<fovea::cuda::DeviceFineHistory> fine_hist;
  fovea::cuda::DeviceScales layer_scales(int layer) const;
  // Encoder CUDA graphs (capture_graphs()): one per budget, each with its own attention planned for
  // the budget's capacity and the device cu_seqlens its schedule step reads.
  struct BudgetGraph {
    int64_t patches = 0;
    std::unique_ptr<fovea::cuda::FlashAttention> attn;
    fovea::cuda::DeviceBuffer<int32_t> cu;  // [max_items + 1]
    std::unique_ptr<fovea::cuda::Graph> graph;
  };
  std::vector<BudgetGraph> graphs;
  GraphCounts graph_counts;
  fovea::cuda::StagingSlot cu_in[2];
  int next_cu = 0;
  // Per plan():
  std::vector<GridThw> grids;
  int64_t n = 0;
  int64_t rows = 0;        // the rows forward() computes: n, or the patches of the budget picked
  int budget = -1;         // the graph plan() picked; -1: eager
  uint8_t* raw = nullptr;  // raw uint8 patches, when uploaded in that form
  bf16 *pixels = nullptr, *pe = nullptr, *x = nullptr, *ln = nullptr, *qkv = nullptr, *att = nullptr, *h = nullptr;
  bf16 *m1 = nullptr, *m2 = nullptr, *merged = nullptr;
  uint8_t* act8 = nullptr;     // FP8 linears: the next linear's input as E4M3 codes [N, max(D, fc2's K)]
  float* act_scale = nullptr;  // and its per-row scales [N], repeated per 128 of K for blocks [K / 128][N]
  std::vector<bf16*> ds;
  float *cos = nullptr, *sin = nullptr;
  // Every per-batch device buffer is a slice of one arena, grown (never shrunk) when a batch needs
  // more than it holds, so a new set of grids allocates nothing unless it is the largest yet.
  fovea::cuda::DeviceBuffer<uint8_t> arena;
  fovea::cuda::DeviceBuffer<uint8_t> spill;  // with graphs: batches larger than the largest budget
  // The RoPE frequency tables (cos, then sin: [side][hd/4] each) for positions up to rope_side, and
  // the batch's image descriptors for grid_tables().
  fovea::cuda::DeviceBuffer<float> rope_freq;
  int rope_side = 0;
  fovea::cuda::DeviceBuffer<ImageDesc> images;
  // Host staging: pinned, reused, two of each so the host fills one batch's while the GPU copies the
  // last one's (each waits for its previous copy's event before it is written again).
  fovea::cuda::StagingSlot plan_in[2], pixels_in[2];
  int next_plan = 0, next_pixels = 0;
  void* staged = nullptr;  // the slot pixel_staging() or raw_staging() gave, until it is uploaded
  int staged_slot = -1;
  struct OutSlot {
    fovea::cuda::StagingSlot mem;
    size_t count = 0, outputs = 0;  // values per output, outputs copied
    bool amax = false;              // the FP8 rings follow the outputs
    bool fine = false;              // and, calibrating the robust scheme, its histories
    bool guard = false;             // and, static, the guard's counts
    int64_t ticket = -1;            // the download it holds until collected; -1: free
  } out[2];
  int64_t next_ticket = 0;

  // Construction (forward-cuda.cu), in this order: the FP8 scale state, the weights, the attention.
  void init_scales();
  void upload_weights(const Weights& w);
  void make_attention();
  // Bytes of the robust scheme's histories that follow a download's outputs: calibration only.
  size_t fine_history_bytes() const {
    if (fine_hist.empty() || opt.scales->mode() != ScaleMode::CALIBRATE) return 0;
    return fine_hist.size() * fine_hist[0].bytes();
  }
  // Bytes of the static guard's counts that follow them (static scales only), and those counts, copied
  // back, into the scale book.
  size_t guard_bytes() const { return guard ? sizeof(GuardCounts) * size_t(cfg.depth) : 0; }
  void take_guard_counts(const void* host);
  // The forward's steps (forward-cuda.cu).
  // LayerNorm into bf16 `out`, or with `out_scale` into E4M3 codes and per-row scales (FP8 linears).
  void layernorm(const bf16* in, void* out, const DevNorm& nrm, int64_t rows, cudaStream_t s,
                 float* out_scale = nullptr);
  void quantize_rows(const bf16* in, const DevLinear& w, int64_t rows,
                     cudaStream_t s);  // w's input, into act8, act_scale
  void run_merger(const DevMerger& mg, const bf16* in_norm, bf16* out, cudaStream_t s);
  // The forward over `rows` rows with attention `a` (planned or scheduled for them).
  void run_layers(fovea::cuda::Attention& a, cudaStream_t s);
  // plan()'s graph path: the batch into budget `k`'s buffers, its offsets padded to max_items + 1.
  void plan_budget(int k, const std::vector<int>& seqlens, int64_t patches, cudaStream_t stream);
  // The batch's plumbing (encoder-batch.cu).
  void layout_arena(int64_t n);  // points every buffer above into the arena, growing it if needed
  void grid_tables(const std::vector<GridThw>& grids, cudaStream_t stream);
  void* take_staging(size_t bytes);
  void upload_from_staging(void* to, size_t bytes, cudaStream_t stream);
  template <class T>
  void collect(int64_t ticket, std::vector<std::vector<T>>& out);
  std::vector<std::span<const uint16_t>> collect_views(int64_t ticket);
};

}  // namespace fovea::qwen3vl::cuda
