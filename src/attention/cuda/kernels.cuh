// Arguments of the FOVEA backend's kernels and their host launchers (src/attention/cuda/*.cu).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fovea/cuda-support.h"
#include "fovea/attention.h"
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
  const int32_t* cu_seqlens = nullptr;  // device [segments + 1]
  const int32_t* cu_padded = nullptr;   // device [segments + 1]
  int num_segments = 0;
  int heads = 0;
  int64_t total_tokens = 0;
  int64_t n_pad = 0;
  void* q = nullptr;  // outputs, layout.cuh
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

void launch_prepare(const PrepareArgs& a, bool fp8, int head_dim, cudaStream_t stream,
                    const FineLaunch* fine = nullptr);

struct FlashParams {
  const int2* tiles = nullptr;  // (segment, m_block) per CTA, longest segments first
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
void launch_flash(const FlashParams& p, const FlashMaps& maps, int num_tiles, bool fp8, int head_dim, int consumers,
                  cudaStream_t stream);

}  // namespace fovea::cuda
