// cuBLASLt products of the GPU encoder (gemm.cuh). Row-major D[M, N] = A[M, K] W[N, K]^T is, in
// cuBLASLt's column-major terms, D^T (N x M) = op(W) A^T with op(W) = T on the K x N view of W: its
// A operand is W (its M is the output channels), its B the activations (its N: the tokens).
#include "fovea/error.h"
#include "model/qwen3vl/gemm.cuh"

namespace fovea::qwen3vl::cuda {

namespace {

template <class T>
void set_attr(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof value));
}

// The pointers a product reads besides its operands: the bias, and the FP8 scales.
void set_pointers(cublasLtMatmulDesc_t op, const DevLinear& w, const float* a_scale) {
  set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(w.b));
  if (a_scale) {
    set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(w.qs));
    set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(a_scale));
  }
}

LtLayout layout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  FOVEA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
  return LtLayout(l);
}

}  // namespace

Gemm::Gemm() : workspace_(kWorkspace) {
  cublasLtHandle_t h = nullptr;
  FOVEA_CUDA_CHECK(cublasLtCreate(&h));
  handle_ = LtHandle(h);
}

void Gemm::check_fp8(const DevLinear& w, bool residual, bool gelu) {
  const float one = 1.f;
  matmul(nullptr, &one, w, nullptr, 128, residual ? reinterpret_cast<const __nv_bfloat16*>(&one) : nullptr, gelu, nullptr, true);
}

Gemm::Plan Gemm::make_plan(const Shape& s, const DevLinear& w, const float* a_scale) const {
  Plan p;
  cublasLtMatmulDesc_t op = nullptr;
  FOVEA_CUDA_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  p.op = LtMatmulDesc(op);
  set_attr(op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attr(op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE, s.gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS);
  set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
  if (s.fp8) {
    set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
    set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F));
    set_attr(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(0));
  }
  set_pointers(op, w, a_scale);  // the heuristic sees the first product's pointers, as it always did
  const cudaDataType_t in_type = s.fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  p.w = layout(in_type, s.in, s.out, s.in);
  p.a = layout(in_type, s.in, s.m, s.in);
  p.d = layout(CUDA_R_16BF, s.out, s.m, s.out);
  cublasLtMatmulPreference_t raw_pref = nullptr;
  FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  const fovea::cuda::Handle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> pref(raw_pref);
  const size_t ws = kWorkspace;
  FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_.get(), op, p.w.get(), p.a.get(), p.d.get(), p.d.get(),
                                                           pref.get(), 1, &result, &found);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0)
    fail_cat("cuBLASLt (", cublasLtGetVersion(), ") has no ", s.fp8 ? "FP8 (E4M3, per-row and per-channel scales) " : "BF16 ",
             "algorithm for [", s.m, " x ", s.in, "] x [", s.in, " x ", s.out, "]",
             s.fp8 ? " on this GPU; run without --fp8-linears" : "");
  p.algo = result.algo;
  return p;
}

void Gemm::matmul(const void* a, const float* a_scale, const DevLinear& w, __nv_bfloat16* d, int64_t m,
                  const __nv_bfloat16* c, bool gelu, cudaStream_t stream, bool probe_only) {
  const Shape shape{m, w.out, w.in, gelu, c != nullptr, a_scale != nullptr};
  auto it = plans_.find(shape);
  if (it == plans_.end()) it = plans_.emplace(shape, make_plan(shape, w, a_scale)).first;
  const Plan& p = it->second;
  if (probe_only) return;
  set_pointers(p.op.get(), w, a_scale);
  const float alpha = 1.f, beta = c ? 1.f : 0.f;
  FOVEA_CUDA_CHECK(cublasLtMatmul(handle_.get(), p.op.get(), &alpha, shape.fp8 ? static_cast<const void*>(w.q) : w.w,
                                  p.w.get(), a, p.a.get(), &beta, c ? c : d, p.d.get(), d, p.d.get(), &p.algo,
                                  workspace_.data(), kWorkspace, stream));
}

}  // namespace fovea::qwen3vl::cuda
