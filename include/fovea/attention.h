// fovea/attention.h: packed varlen ("THD") attention for vision encoders, names and shapes: the
// backend and dtype enums, the views and the batch description every backend takes, the head sizes
// the FOVEA kernels are built for, and the error measure of the tests. The CPU reference (the oracle
// for every other backend) is fovea/attention-ref.h; the GPU backends and their device-side FP8
// structs are fovea/attention-gpu.h (docs/architecture.md §Public headers).
//
// Layout: q, k, v are [total_tokens, heads, head_dim] views (token and head strides in elements, the
// last dimension contiguous), so they can be read straight out of a fused qkv [N, 3, H, hd] tensor.
// cu_seqlens is int32 [num_segments + 1], 0 = cu[0] < cu[1] < ... = total_tokens. Attention is
// non-causal within each segment and never crosses segments.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

typedef struct CUstream_st* cudaStream_t;  // as cuda_runtime_api.h declares it

namespace fovea {

enum class AttnBackend { AUTO, FOVEA, CUDNN, CPU };
enum class AttnDtype { AUTO, BF16, FP8 };

const char* backend_name(AttnBackend b);
const char* dtype_name(AttnDtype d);
// Case-insensitive; FLASHINFER is an alias of CUDNN (vLLM's FLASHINFER encoder backend is cuDNN).
std::optional<AttnBackend> parse_backend(const std::string& s);
std::optional<AttnDtype> parse_dtype(const std::string& s);

// A [tokens, heads, head_dim] view with the last dimension contiguous.
template <class T>
struct ThdView {
  T* data = nullptr;
  int64_t stride_token = 0;  // elements between consecutive tokens
  int64_t stride_head = 0;   // elements between consecutive heads
  T* row(int64_t token, int64_t head) const { return data + token * stride_token + head * stride_head; }
};

struct VarlenShape {
  std::vector<int32_t> cu_seqlens;
  int heads = 0;
  int head_dim = 0;
  int64_t total_tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
  int num_segments() const { return int(cu_seqlens.size()) - 1; }
  int max_seqlen() const;
  double flops() const;  // 4 * sum(S_i^2) * head_dim * heads: QK^T and PV, non-causal
  // Throws fovea::Error naming the offending value: cu_seqlens must start at 0 and strictly
  // increase (every segment has >= 1 token); heads and head_dim must be > 0.
  void validate() const;
};

VarlenShape varlen_from_seqlens(const std::vector<int>& seqlens, int heads, int head_dim);

namespace cuda {

// Head dims the FOVEA kernels are built for: the one list the kernel dispatch
// (src/attention/cuda/head-dims.cuh), the tests and the benches iterate.
inline constexpr int kFlashHeadDims[] = {64, 72, 80, 128};

constexpr bool flash_supports_head_dim(int head_dim) {
  for (int d : kFlashHeadDims)
    if (d == head_dim) return true;
  return false;
}

}  // namespace cuda

struct ErrorStats {
  double rel_l2 = 0;   // ||out - ref||_2 / ||ref||_2; NaN if out has a non-finite value
  double max_abs = 0;  // max |out - ref|; NaN likewise
  double mean_abs = 0;
  int64_t nonfinite = 0;  // non-finite values in out
};
ErrorStats compare(const double* out, const double* ref, int64_t n);

}  // namespace fovea
