// The GPU encoder's row kernels (rows.cu): LayerNorm, the FP8 linears' row quantization and the
// mergers' exact GELU, bf16 activations, launched on a stream.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fovea::qwen3vl::cuda {

using bf16 = __nv_bfloat16;

// Rows the LayerNorm and quantization kernels take: widths that are multiples of 8 up to this.
inline constexpr int kRowMaxWidth = 8 * 1024 * 8;  // 8 columns a thread, 1024 threads, 8 runs each
bool row_kernels_take(int width);

// LayerNorm over `width` columns of `rows` rows (fp32 weight and bias, eps 1e-6) into bf16 `out`,
// or, with `out_scale`, into E4M3 codes [rows, width] and one scale per row (the bf16-rounded
// result quantized: the qkv and fc1 inputs of the FP8 linears).
void layernorm(const bf16* in, void* out, float* out_scale, const float* w, const float* b, int width, int64_t rows,
               cudaStream_t stream);
// bf16 rows to E4M3 codes and one scale per row (amax / 448; the proj and fc2 inputs). Code rows are
// `ld` apart (ld >= width, a multiple of 16), zeros in [width, ld).
void quantize_rows(const bf16* in, uint8_t* codes, float* scales, int width, int64_t rows, cudaStream_t stream,
                   int ld = 0);
// The per-row scales [rows] copied `copies - 1` times after themselves: [copies][rows], the layout
// of cuBLASLt's 128-element (VEC128) activation scales, one row's scale for all its K blocks.
void repeat_row_scales(float* scales, int64_t rows, int copies, cudaStream_t stream);
// x = GELU(x), the exact (erf) form, in place.
void gelu_erf(bf16* x, int64_t n, cudaStream_t stream);
// y [rows, cols] += bias (bf16, per column), then the tanh-GELU when `gelu`, in place: the epilogue
// of a product whose cuBLASLt algorithm has no such epilogue (block-scaled FP8 on sm_90).
void bias_gelu(bf16* y, const bf16* bias, int64_t rows, int cols, bool add_bias, bool gelu, cudaStream_t stream);

}  // namespace fovea::qwen3vl::cuda
