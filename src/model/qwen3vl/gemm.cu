// cuBLASLt products of the GPU encoder (gemm.cuh). Row-major D[M, N] = A[M, K] W[N, K]^T is, in
// cuBLASLt's column-major terms, D^T (N x M) = op(W) A^T with op(W) = T on the K x N view of W: its
// A operand is W (its M is the output channels), its B the activations (its N: the tokens).
#include <vector>

#include "fovea/error.h"
#include "model/qwen3vl/gemm.cuh"
#include "model/qwen3vl/rows.cuh"

namespace fovea::qwen3vl::cuda {

namespace {

template <class T>
void set_attr(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FOVEA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &value, sizeof value));
}

// The pointers a product reads besides its operands: the bias (when the epilogue adds it), and the
// FP8 scales.
void set_pointers(cublasLtMatmulDesc_t op, const DevLinear& w, const float* a_scale, bool bias) {
  if (bias) set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(w.b));
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
  const float one = 1.f;  // block-scaled products are probed with an aligned device pointer for their scales
  matmul(nullptr, w.blocks ? w.qs : &one, w, nullptr, 128,
         residual ? reinterpret_cast<const __nv_bfloat16*>(&one) : nullptr, gelu, nullptr, true);
}

namespace {

// The epilogues a product may take, best first: all fused, the GELU after, bias and GELU after.
struct Epilogue {
  cublasLtEpilogue_t op;
  bool bias_after, gelu_after;
};
std::vector<Epilogue> epilogues(bool gelu) {
  if (gelu)
    return {{CUBLASLT_EPILOGUE_GELU_BIAS, false, false},
            {CUBLASLT_EPILOGUE_BIAS, false, true},
            {CUBLASLT_EPILOGUE_DEFAULT, true, true}};
  return {{CUBLASLT_EPILOGUE_BIAS, false, false}, {CUBLASLT_EPILOGUE_DEFAULT, true, false}};
}

}  // namespace

Gemm::Plan Gemm::make_plan(const Shape& s, const DevLinear& w, const float* a_scale) const {
  const cudaDataType_t in_type = s.fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatmulPreference_t raw_pref = nullptr;
  FOVEA_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  const fovea::cuda::Handle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> pref(raw_pref);
  const size_t ws = kWorkspace;
  FOVEA_CUDA_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  // Only the blocked FP8 products fall back to an unfused epilogue: the others always had theirs.
  std::vector<Epilogue> tries = epilogues(s.gelu);
  if (!s.blocks) tries.resize(1);
  for (const Epilogue& e : tries) {
    Plan p;
    cublasLtMatmulDesc_t op = nullptr;
    FOVEA_CUDA_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    p.op = LtMatmulDesc(op);
    set_attr(op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    set_attr(op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    set_attr(op, CUBLASLT_MATMUL_DESC_EPILOGUE, e.op);
    set_attr(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, CUDA_R_16BF);
    if (s.fp8) {
      const auto a_mode =
          s.blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      const auto b_mode =
          s.blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      set_attr(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, int32_t(a_mode));
      set_attr(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(b_mode));
      set_attr(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(0));
    }
    set_pointers(op, w, a_scale, e.op != CUBLASLT_EPILOGUE_DEFAULT);  // the heuristic sees the first product's
    p.w = layout(in_type, s.in, s.out, s.in);
    p.a = layout(in_type, s.in, s.m, s.in);
    p.d = layout(CUDA_R_16BF, s.out, s.m, s.out);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_.get(), op, p.w.get(), p.a.get(), p.d.get(),
                                                             p.d.get(), pref.get(), 1, &result, &found);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) continue;
    p.algo = result.algo;
    p.bias_after = e.bias_after, p.gelu_after = e.gelu_after;
    return p;
  }
  const char* what = !s.fp8     ? "BF16 "
                     : s.blocks ? "FP8 (E4M3, [128, 128] weight blocks and 128-element activation "
                                  "blocks) "
                                : "FP8 (E4M3, per-row and per-channel scales) ";
  fail_cat("cuBLASLt (", cublasLtGetVersion(), ") has no ", what, "algorithm for [", s.m, " x ", s.in, "] x [", s.in,
           " x ", s.out, "]", s.fp8 ? " on this GPU; run without --fp8-linears" : "");
}

void Gemm::matmul(const void* a, const float* a_scale, const DevLinear& w, __nv_bfloat16* d, int64_t m,
                  const __nv_bfloat16* c, bool gelu, cudaStream_t stream, bool probe_only) {
  const Shape shape{m, w.out, a_scale ? w.k : w.in, gelu, c != nullptr, a_scale != nullptr, a_scale && w.blocks};
  auto it = plans_.find(shape);
  if (it == plans_.end()) it = plans_.emplace(shape, make_plan(shape, w, a_scale)).first;
  const Plan& p = it->second;
  if (probe_only) return;
  set_pointers(p.op.get(), w, a_scale, !p.bias_after);
  const float alpha = 1.f, beta = c ? 1.f : 0.f;
  FOVEA_CUDA_CHECK(cublasLtMatmul(handle_.get(), p.op.get(), &alpha, shape.fp8 ? static_cast<const void*>(w.q) : w.w,
                                  p.w.get(), a, p.a.get(), &beta, c ? c : d, p.d.get(), d, p.d.get(), &p.algo,
                                  workspace_.data(), kWorkspace, stream));
  bias_gelu(d, w.b, m, w.out, p.bias_after, p.gelu_after, stream);
}

}  // namespace fovea::qwen3vl::cuda
