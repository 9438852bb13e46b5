// Uploads of the GPU encoder's weights (weights-cuda.cuh).
#include <algorithm>

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
  DevLinear d{upload_bf16(l.w, owner), upload_bf16(l.b, owner), l.out, l.in};
  d.k = l.in;
  return d;
}

namespace {

// Stored [128, 128] blocks in the GEMM's layout: codes [out, k] (zeros past in), scales
// [ceil(out / 128)][fp8_block_ld(k)] (1 past the stored grid).
void block_layout(const Fp8Weight& f, int k, std::vector<uint8_t>& codes, std::vector<float>& scales) {
  const int64_t rows = (f.out + kFp8Block - 1) / kFp8Block, cols = (f.in + kFp8Block - 1) / kFp8Block;
  const int ld = fp8_block_ld(k);
  codes.assign(size_t(f.out) * size_t(k), 0);
  for (int64_t o = 0; o < f.out; ++o) std::copy_n(f.codes.data() + o * f.in, f.in, codes.data() + o * k);
  scales.assign(size_t(rows) * size_t(ld), 1.f);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(f.scales.data() + r * cols, cols, scales.data() + r * ld);
}

}  // namespace

DevLinear upload_fp8(const Linear& l, Owner& owner) {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  DevLinear d{nullptr, upload_bf16(l.b, owner), l.out, l.in};
  d.k = l.in;
  if (fp8_linear_form(l, "linear") == Fp8LinearForm::STORED_BLOCKS) {
    d.blocks = true;
    d.k = (l.in + kFp8Block - 1) / kFp8Block * kFp8Block;
    block_layout(*l.fp8, d.k, codes, scales);
  } else {
    quantize_weight_rows(l, codes, scales);
  }
  d.q = alloc_in<uint8_t>(owner, codes.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d.q, codes.data(), codes.size(), cudaMemcpyHostToDevice));
  d.qs = upload_f32(scales, owner);
  return d;
}

DevNorm upload(const Norm& n, Owner& owner) {
  return {upload_f32(n.w, owner), upload_f32(n.b, owner), int(n.w.size())};
}

}  // namespace fovea::qwen3vl::cuda
