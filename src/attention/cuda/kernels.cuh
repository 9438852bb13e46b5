// Arguments of the FOVEA backend's kernels and their host launchers (src/attention/cuda/*.cu).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fovea/cuda-support.h"
#include "fovea/attention.h"
#include "fovea/attention-gpu.h"
#include "fovea/scales.h"

namespace fovea::cuda {

// Reduction state of fine_stats_kernel (device, zero between launches): per (head, channel) the sum
// of K, the largest K and -K as ordered bits (ordered_bits()), V's and Q's amax as float bits; the
// CTA counter.
struct FineScratch {
  double* k_sum = nullptr;
  unsigned int* k_max = nullptr;
  unsigned int* k_neg_max = nullptr;
  unsigned int* v_amax = nullptr;
  unsigned int* q_amax = nullptr;
  unsigned int* done = nullptr;
  unsigned int* bad = nullptr;  // nonzero once a non-finite input was seen
  // With a history: the rings' maxima before this batch, per V channel and per head of Q and K,
  // over the slots that stay if the batch is recorded ([0]) and over all filled slots ([1]).
  float* v_prev[2] = {nullptr, nullptr};  // [H * hd]
  float* q_prev[2] = {nullptr, nullptr};  // [H]
  float* k_prev[2] = {nullptr, nullptr};  // [H]
};

struct PrepareArgs {
  const __nv_bfloat16* qkv = nullptr;  // [N, 3, H, hd]
  int64_t qkv_token_stride = 0;        // elements
  const float* rope_cos = nullptr;     // [N, hd/2] or null
  const float* rope_sin = nullptr;
  const int32_t* cu_seqlens = nullptr;  // device [segments + 1], the schedule step's (cu_seqlens[segments]:
  const int32_t* cu_padded = nullptr;   // the tokens this launch attends; cu_padded[segments]: its rows)
  int num_segments = 0;
  int heads = 0;
  int64_t total_tokens = 0;  // capacity: at most this many tokens (sizes the grids)
  int64_t n_pad = 0;         // capacity: padded rows of the layout (the row stride of q, k and v^t)
  void* q = nullptr;         // outputs, layout.cuh
  void* k = nullptr;
  void* vt = nullptr;
  const float* fixed = nullptr;          // FP8 static scales [3]
  LayerAmax* dynamic = nullptr;          // FP8 dynamic state
  unsigned int* amax_scratch = nullptr;  // [3], zero between launches
  unsigned int* amax_done = nullptr;     // CTA counter, zero between launches
};

// The robust scheme: per-head Q and K scales [H], K's mean and V's scales per channel [H * hd]
// replace PrepareArgs' fixed / dynamic. With `current`, fine_stats_kernel first fills them from this
// batch through `scratch`. A separate argument, not a part of PrepareArgs: a larger PrepareArgs
// alone took the FP8 hd 72 prepare kernel from 109 to 95 registers (ptxas, same kernel text) and
// 0.104 to 0.152 ms at 3 x 3520 (H200, 2026-12-02).
struct FineLaunch {
  FineArrays arrays;
  bool current = false;
  FineScratch scratch;
  FineRing ring;  // with current: the layer's history (ScaleBook::record_fine's), or all null
};

// The static guard (docs/fp8.md §Static guard): the statistics pass in guard mode (qkv_amax_kernel
// per tensor, fine_stats_kernel<hd, true> robust) ends by writing the scales this batch quantizes
// with, the file's where the batch stays in their range and the batch's own where it passes it:
// per tensor into `scales` (PrepareArgs::fixed then points there), robust into FineLaunch::arrays'
// q_head, k_head and v_channel (its k_mean and qk_split are the file's). It adds the tensors it
// switched to `counts`. Its own argument, as FineLaunch is: PrepareArgs stays as small as it is.
struct GuardLaunch {
  const float* fixed = nullptr;   // per tensor: the file's q, k, v [3]
  float* scales = nullptr;        // per tensor: the guarded q, k, v [3]
  FineArrays file;                // robust: the file's arrays
  GuardCounts* counts = nullptr;  // the layer's counters; null: no guard
};

void launch_prepare(const PrepareArgs& a, bool fp8, int head_dim, cudaStream_t stream, const FineLaunch* fine = nullptr,
                    const GuardLaunch* guard = nullptr);

// The schedule step (schedule.cu): cu_in, the caller's [segments + 1] offsets in device memory, to
// the arrays below. A valid layout is 0, then non-decreasing offsets up to max_tokens, then only
// zeros after any drop (empty segments). Anything else attends nothing: num_tiles and every offset
// 0, *status 1 + the index of the first bad entry (0 for a valid layout).
struct ScheduleArgs {
  const int32_t* cu_in = nullptr;
  int segments = 0;
  int64_t max_tokens = 0;
  int block_m = 128;             // query rows per tile (64 x consumer warpgroups)
  int32_t* cu = nullptr;         // [segments + 1] the offsets, normalized (non-decreasing)
  int32_t* cu_padded = nullptr;  // [segments + 1] layout.cuh's padded offsets
  int2* tiles = nullptr;         // (segment, query tile), segments with the most KV blocks first
  int32_t* num_tiles = nullptr;  // [1]
  int32_t* status = nullptr;     // [1]
};

void launch_schedule(const ScheduleArgs& a, cudaStream_t stream);

struct FlashParams {
  const int2* tiles = nullptr;         // (segment, m_block) per CTA, longest segments first
  const int32_t* num_tiles = nullptr;  // device: the tiles listed; CTAs past it return at once
  const int32_t* cu_seqlens = nullptr;
  const int32_t* cu_padded = nullptr;
  __nv_bfloat16* out = nullptr;  // [N, H, hd]
  int heads = 0;
  const float* q_scale = nullptr;  // FP8 dequantization scales (device), null for BF16
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bool fine = false;             // q_scale, k_scale per head [H]; v_scale per channel [H * hd] (robust scheme)
  float softmax_scale_log2 = 0;  // log2(e) / sqrt(hd)
};

struct FlashMaps {
  CUtensorMap q, k, v;
};

// consumers: 2, or 3 where layout::max_consumer_warpgroups allows (tiles of 64 * consumers rows).
// max_tiles: the grid (the most tiles the schedule can list); *p.num_tiles of them run. wide: Q and K
// in the robust scheme's wider rows (layout::has_wide_rows; maps.q and maps.k over that width).
void launch_flash(const FlashParams& p, const FlashMaps& maps, int max_tiles, bool fp8, int head_dim, int consumers,
                  bool wide, cudaStream_t stream);

}  // namespace fovea::cuda
