// The GPU encoder's linears through cuBLASLt (gemm.cu): D[M, N] = A[M, K] W[N, K]^T + bias (+ C)
// (tanh-GELU), row-major bf16 with fp32 accumulation, or E4M3 A and W with outer-vector scales (the
// FP8 linears), or with block scales (an FP8 release's [128, 128] weights). The bias, GELU and
// residual are fused into cuBLASLt's epilogue where it has one for the product (else a row kernel
// adds the bias and the GELU after it).
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <compare>
#include <cstdint>
#include <map>

#include "fovea/cuda-support.h"
#include "model/qwen3vl/weights-cuda.cuh"

namespace fovea::qwen3vl::cuda {

using LtHandle = fovea::cuda::Handle<cublasLtHandle_t, cublasLtDestroy>;
using LtMatmulDesc = fovea::cuda::Handle<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = fovea::cuda::Handle<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;

class Gemm {
 public:
  Gemm();
  void run(const __nv_bfloat16* a, const DevLinear& w, __nv_bfloat16* d, int64_t m, const __nv_bfloat16* c, bool gelu,
           cudaStream_t stream) {
    matmul(a, nullptr, w, d, m, c, gelu, stream);
  }
  // The FP8 linears (docs/fp8.md §FP8 linears): a is E4M3 [M, K] with one scale per row (a_scale),
  // w.q E4M3 [N, K] with one per output channel (w.qs); cuBLASLt applies both as outer-vector
  // scales to the fp32 accumulator (no fast accumulation), then the same epilogue as run(). With
  // w.blocks, a is [M, w.k] and a_scale [w.k / 128][M] (each row's scale repeated: repeat_row_scales),
  // w.qs the [128, 128] block scales: cuBLASLt scales each 128-deep partial product by both.
  void run_fp8(const uint8_t* a, const float* a_scale, const DevLinear& w, __nv_bfloat16* d, int64_t m,
               const __nv_bfloat16* c, bool gelu, cudaStream_t stream) {
    matmul(a, a_scale, w, d, m, c, gelu, stream);
  }
  // Fails now, naming the linear, if cuBLASLt has no FP8 algorithm for w's shape and epilogue
  // (asked for 128 rows; nothing runs), rather than at the first forward.
  void check_fp8(const DevLinear& w, bool residual, bool gelu);

 private:
  // What a product's descriptors, layouts and algorithm depend on; the weight, bias and scale
  // pointers are set on the descriptor at every call.
  struct Shape {
    int64_t m;
    int out, in;
    bool gelu, residual, fp8, blocks;
    auto operator<=>(const Shape&) const = default;
  };
  // Made on a shape's first product and kept: a forward runs a few shapes many times.
  struct Plan {
    LtMatmulDesc op;
    LtLayout w, a, d;  // W: K x N, A: K x M, C and D: N x M
    cublasLtMatmulAlgo_t algo{};
    bool bias_after = false, gelu_after = false;  // the epilogue's parts left to bias_gelu()
  };
  void matmul(const void* a, const float* a_scale, const DevLinear& w, __nv_bfloat16* d, int64_t m,
              const __nv_bfloat16* c, bool gelu, cudaStream_t stream, bool probe_only = false);
  Plan make_plan(const Shape& s, const DevLinear& w, const float* a_scale) const;

  static constexpr size_t kWorkspace = size_t(32) << 20;
  LtHandle handle_;
  fovea::cuda::DeviceBuffer<uint8_t> workspace_;
  std::map<Shape, Plan> plans_;
};

}  // namespace fovea::qwen3vl::cuda
