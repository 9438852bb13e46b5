// The GPU encoder's weights in device memory (weights-cuda.cu): bf16 linears (or E4M3 with
// per-channel scales for the FP8 linears) and fp32 norms, uploaded from a host Model.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "fovea/cuda-support.h"
#include "fovea/model.h"

namespace fovea::qwen3vl::cuda {

// Device allocations freed together with the list (the weights, or one plan's buffers): every
// allocation enters its owner before anything is copied, so nothing leaks when a later step throws.
using Owner = std::vector<fovea::cuda::DeviceBuffer<uint8_t>>;
template <class T>
T* alloc_in(Owner& owner, size_t count) {
  owner.emplace_back(count * sizeof(T));
  return reinterpret_cast<T*>(owner.back().data());
}

__nv_bfloat16* upload_bf16(const std::vector<float>& v, Owner& owner);  // rounded to bf16
float* upload_f32(const std::vector<float>& v, Owner& owner);

// FP8 weights in [128, 128] blocks as a release stores them (Fp8LinearForm::STORED_BLOCKS): the
// GEMM's K is `in` rounded up to kFp8Block (codes zero past `in`), and the scales are cuBLASLt's
// block-scale layout for sm_90: [ceil(out / 128)][kFp8BlockLd(K)] row-major, the unused tail 1.
inline constexpr int kFp8Block = 128;
inline int fp8_block_ld(int k) { return (k / kFp8Block + 3) / 4 * 4; }

struct DevLinear {
  __nv_bfloat16* w = nullptr;
  __nv_bfloat16* b = nullptr;
  int out = 0, in = 0;
  uint8_t* q = nullptr;  // FP8 linears: E4M3 codes [out, k] instead of w, and
  float* qs = nullptr;   // their dequantization scales: one per output channel [out], or blocks (above)
  int k = 0;             // the product's K: in, or in rounded up to 128 with blocks
  bool blocks = false;   // qs holds [128, 128] block scales; the activations take VEC128 scales
};
struct DevNorm {
  float* w = nullptr;
  float* b = nullptr;
  int width = 0;
};
struct DevBlock {
  DevNorm norm1, norm2;
  DevLinear qkv, proj, fc1, fc2;
};
struct DevMerger {
  DevNorm norm;
  DevLinear fc1, fc2;
};

DevLinear upload(const Linear& l, Owner& owner);
// The FP8 linears' weights and the bf16 bias (no bf16 weight): E4M3 per output channel, quantized on
// the host (quantize_weight_rows, the emulation's own function) or as stored per channel; or as
// stored in [128, 128] blocks (fp8_linear_form).
DevLinear upload_fp8(const Linear& l, Owner& owner);
DevNorm upload(const Norm& n, Owner& owner);

}  // namespace fovea::qwen3vl::cuda
