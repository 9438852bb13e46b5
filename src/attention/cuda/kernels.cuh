// Arguments of the FOVEA backend's kernels and their host launchers (src/attention/cuda/*.cu).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fovea/cuda-support.h"
#include "fovea/scales.h"

namespace fovea::cuda {

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
  const float* fixed = nullptr;      // FP8 static scales [3]
  LayerAmax* dynamic = nullptr;      // FP8 dynamic state
  unsigned int* amax_scratch = nullptr;  // [3], zero between launches
  unsigned int* amax_done = nullptr;     // CTA counter, zero between launches
};

void launch_prepare(const PrepareArgs& a, bool fp8, int head_dim, cudaStream_t stream);

struct FlashParams {
  const int2* tiles = nullptr;  // (segment, m_block) per CTA, longest segments first
  const int32_t* cu_seqlens = nullptr;
  const int32_t* cu_padded = nullptr;
  __nv_bfloat16* out = nullptr;  // [N, H, hd]
  int heads = 0;
  const float* q_scale = nullptr;  // FP8 dequantization scales (device), null for BF16
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  float softmax_scale_log2 = 0;  // log2(e) / sqrt(hd)
};

struct FlashMaps {
  CUtensorMap q, k, v;
};

// consumers: 2, or 3 where layout::max_consumer_warpgroups allows (tiles of 64 * consumers rows).
void launch_flash(const FlashParams& p, const FlashMaps& maps, int num_tiles, bool fp8, int head_dim,
                  int consumers, cudaStream_t stream);

}  // namespace fovea::cuda
