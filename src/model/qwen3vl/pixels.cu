// The GPU encoder's per-batch input kernels (pixels.cuh). Every float operation is written as an
// explicitly rounded intrinsic in the host's order, so no contraction changes a bit.
#include "fovea/cuda-support.h"
#include "model/qwen3vl/pixels.cuh"

namespace fovea::qwen3vl::cuda {

namespace {

using bf16 = __nv_bfloat16;

// The tables that depend only on the grids, one block per patch row of the batch: the learned
// position table resampled bilinearly to the patch's image (bf16, added in the patch GEMM's epilogue)
// and its RoPE cos / sin rows, gathered from the [side][hd/4] frequency tables. Every float
// operation is the one position_embedding() does on the host, in its order and rounded alike (no
// fused multiply-adds), so both give the same bits.
__global__ void grid_tables_kernel(const ImageDesc* __restrict__ images, int num_images,
                                   const float* __restrict__ table, int G, int D, const float* __restrict__ freq_cos,
                                   const float* __restrict__ freq_sin, int quarter, bf16* __restrict__ pe,
                                   float* __restrict__ cos, float* __restrict__ sin) {
  const int64_t i = blockIdx.x;
  int lo = 0, hi = num_images - 1;  // the last image whose first row is <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (images[mid].base <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  const ImageDesc im = images[lo];
  const int64_t q = (i - im.base) % (int64_t(im.h) * im.w);  // index in its frame, merge-window order
  const int64_t window = q / 4;
  const int r = int(window / (im.w / 2)) * 2 + int(q % 4) / 2, c = int(window % (im.w / 2)) * 2 + int(q % 2);
  const float sr = im.h == 1 ? 0.f : __fmul_rn(float(r), __fdiv_rn(float(G - 1), float(im.h - 1)));
  const float sc = im.w == 1 ? 0.f : __fmul_rn(float(c), __fdiv_rn(float(G - 1), float(im.w - 1)));
  const int r0 = int(floorf(sr)), c0 = int(floorf(sc));
  const int r1 = min(r0 + 1, G - 1), c1 = min(c0 + 1, G - 1);
  const float fr = __fsub_rn(sr, float(r0)), fc = __fsub_rn(sc, float(c0));
  const float w00 = __fmul_rn(__fsub_rn(1.f, fr), __fsub_rn(1.f, fc)), w01 = __fmul_rn(__fsub_rn(1.f, fr), fc);
  const float w10 = __fmul_rn(fr, __fsub_rn(1.f, fc)), w11 = __fmul_rn(fr, fc);
  const float* e00 = table + int64_t(r0 * G + c0) * D;
  const float* e01 = table + int64_t(r0 * G + c1) * D;
  const float* e10 = table + int64_t(r1 * G + c0) * D;
  const float* e11 = table + int64_t(r1 * G + c1) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float v = __fadd_rn(__fmul_rn(w00, e00[d]), __fmul_rn(w01, e01[d]));
    v = __fadd_rn(__fadd_rn(v, __fmul_rn(w10, e10[d])), __fmul_rn(w11, e11[d]));
    pe[i * D + d] = __float2bfloat16_rn(v);
  }
  const int half = 2 * quarter;
  for (int d = threadIdx.x; d < half; d += blockDim.x) {  // dims [0, hd/4) by the row, the rest by the column
    const int at = (d < quarter ? r : c) * quarter + d % quarter;
    cos[i * half + d] = freq_cos[at];
    sin[i * half + d] = freq_sin[at];
  }
}

// Raw uint8 patches [rows, 3, plane] to the encoder's bf16 pixels [rows, 3, T, plane]: rescale and
// normalize as image::patchify does on the host, (x - mean*255) / (std*255) in float32, correctly
// rounded (no contraction), then rounded to bf16 as the host's upload does; every frame the same.
struct Normalize {
  float mean255[3], std255[3];
};
__global__ void normalize_kernel(const uint8_t* __restrict__ raw, bf16* __restrict__ px, int64_t rows, int plane, int T,
                                 Normalize nm) {
  const int64_t row = 3 * int64_t(T) * plane, total = rows * row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row;
    const int col = int(i % row), c = col / (T * plane), k = col % plane;
    const float v = float(raw[r * 3 * plane + int64_t(c) * plane + k]);
    px[i] = __float2bfloat16_rn(__fdiv_rn(__fsub_rn(v, nm.mean255[c]), nm.std255[c]));
  }
}

}  // namespace

void compute_grid_tables(const ImageDesc* images, int num_images, int64_t rows, const float* table, int G, int D,
                         const float* freq_cos, const float* freq_sin, int quarter, bf16* pe, float* cos, float* sin,
                         cudaStream_t stream) {
  grid_tables_kernel<<<unsigned(rows), 128, 0, stream>>>(images, num_images, table, G, D, freq_cos, freq_sin, quarter,
                                                         pe, cos, sin);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

void normalize_pixels(const uint8_t* raw, bf16* px, int64_t rows, int plane, int T, const float mean[3],
                      const float std[3], cudaStream_t stream) {
  Normalize nm;
  for (int c = 0; c < 3; ++c) {  // the host's float products, as patchify computes them
    nm.mean255[c] = mean[c] * 255.0f;
    nm.std255[c] = std[c] * 255.0f;
  }
  normalize_kernel<<<1024, 256, 0, stream>>>(raw, px, rows, plane, T, nm);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fovea::qwen3vl::cuda
