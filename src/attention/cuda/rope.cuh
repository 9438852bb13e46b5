// 2D RoPE on the device, one rotation for every kernel that applies it (the FOVEA prepare step, the
// CUDNN backend's copy).
#pragma once

namespace fovea::cuda {

// Rotates the column pair (x1, x2) = (d, d + hd/2) by the angle whose cosine and sine are c and s.
// Unfused multiplies and adds, each rounded, as the CPU reference (and transformers' fp32 RoPE)
// computes them, so every rotated value, and so every amax and quantized code, agrees bit for bit
// with the host.
__device__ __forceinline__ void rope_pair(float& x1, float& x2, float c, float s) {
  const float y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  const float y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  x1 = y1, x2 = y2;
}

}  // namespace fovea::cuda
