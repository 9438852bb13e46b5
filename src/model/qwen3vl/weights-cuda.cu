// Uploads of the GPU encoder's weights (weights-cuda.cuh).
#include "fovea/bf16.h"
#include "model/qwen3vl/weights-cuda.cuh"

namespace fovea::qwen3vl::cuda {

__nv_bfloat16* upload_bf16(const std::vector<float>& v, Owner& owner) {
  std::vector<uint16_t> h(v.size());
  to_bf16(v.data(), v.size(), h.data());
  auto* d = alloc_in<__nv_bfloat16>(owner, v.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

float* upload_f32(const std::vector<float>& v, Owner& owner) {
  float* d = alloc_in<float>(owner, v.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

DevLinear upload(const Linear& l, Owner& owner) {
  return {upload_bf16(l.w, owner), upload_bf16(l.b, owner), l.out, l.in};
}

DevLinear upload_fp8(const Linear& l, Owner& owner) {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  quantize_weight_rows(l, codes, scales);
  DevLinear d{nullptr, upload_bf16(l.b, owner), l.out, l.in};
  d.q = alloc_in<uint8_t>(owner, codes.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d.q, codes.data(), codes.size(), cudaMemcpyHostToDevice));
  d.qs = upload_f32(scales, owner);
  return d;
}

DevNorm upload(const Norm& n, Owner& owner) {
  return {upload_f32(n.w, owner), upload_f32(n.b, owner), int(n.w.size())};
}

}  // namespace fovea::qwen3vl::cuda
