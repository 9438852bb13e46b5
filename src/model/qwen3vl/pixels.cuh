// The GPU encoder's per-batch inputs (pixels.cu): the tables that depend only on the grids, and raw
// uint8 patches normalized into the bf16 pixels, each computed as the host computes it, bit for bit.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fovea::qwen3vl::cuda {

// One image of a batch for compute_grid_tables(): its first row and its grid.
struct ImageDesc {
  int64_t base;
  int32_t t, h, w, pad;
};

// For each of the batch's `rows` patch rows (images: device, in row order): the G x G position
// table [G*G, D] resampled to its image, into pe [rows, D] bf16, and its RoPE cos / sin rows
// [rows, 2 * quarter], gathered from the [side][quarter] frequency tables.
void compute_grid_tables(const ImageDesc* images, int num_images, int64_t rows, const float* table, int G, int D,
                         const float* freq_cos, const float* freq_sin, int quarter, __nv_bfloat16* pe, float* cos,
                         float* sin, cudaStream_t stream);

// Raw uint8 patches [rows, 3, plane] to bf16 pixels [rows, 3, T, plane], rescaled and normalized
// with the processor's mean and std as image::patchify does.
void normalize_pixels(const uint8_t* raw, __nv_bfloat16* px, int64_t rows, int plane, int T, const float mean[3],
                      const float std[3], cudaStream_t stream);

}  // namespace fovea::qwen3vl::cuda
