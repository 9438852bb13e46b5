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

struct DevLinear {
  __nv_bfloat16* w = nullptr;
  __nv_bfloat16* b = nullptr;
  int out = 0, in = 0;
  uint8_t* q = nullptr;  // FP8 linears: E4M3 codes [out, in] instead of w, and
  float* qs = nullptr;   // their per-channel dequantization scales [out]
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
// The FP8 linears' weights: E4M3 per output channel, quantized on the host (quantize_weight_rows,
// the emulation's own function), and the bf16 bias; no bf16 weight.
DevLinear upload_fp8(const Linear& l, Owner& owner);
DevNorm upload(const Norm& n, Owner& owner);

}  // namespace fovea::qwen3vl::cuda
