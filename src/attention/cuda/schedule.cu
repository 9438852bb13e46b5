// The FOVEA backend's schedule step: one CTA turns the caller's cu_seqlens (device memory, read at
// every launch) into what the prepare step and the flash kernel read: the segment offsets checked
// and normalized, the padded offsets (layout.cuh) and the work list of (segment, query tile), longest
// segments first. Nothing of the layout passes through the host, so a captured graph replays any
// layout within the plan's capacity.
#include <climits>

#include "attention/cuda/kernels.cuh"
#include "attention/cuda/layout.cuh"

namespace fovea::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kBuckets = kThreads;  // tile order: segments by KV blocks, descending (the last bucket: 1023 or more)

// Exclusive prefix sum of one value per thread over the CTA; *total gets the sum (every thread).
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int64_t up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int64_t w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += up;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int64_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + incl - v;
  *total = warp_sums[kThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

__device__ int32_t normalized(const ScheduleArgs& a, int i, int first_drop) {
  return a.cu_in[i < first_drop ? i : first_drop - 1];
}

__global__ void __launch_bounds__(kThreads) schedule_kernel(ScheduleArgs a) {
  __shared__ int first_drop, first_bad;
  __shared__ unsigned int bucket[kBuckets];
  if (threadIdx.x == 0) first_drop = INT_MAX, first_bad = INT_MAX;
  for (int b = threadIdx.x; b < kBuckets; b += kThreads) bucket[b] = 0;
  __syncthreads();
  const int n = a.segments;
  // 1. The layout: 0, then non-decreasing values up to max_tokens; after a value that drops, only
  //    zeros (a captured buffer zeroed, then the real offsets copied to its front: empty segments).
  for (int i = threadIdx.x; i <= n; i += kThreads) {
    const int32_t v = a.cu_in[i];
    if (v < 0 || int64_t(v) > a.max_tokens || (i == 0 && v != 0)) atomicMin(&first_bad, i);
    if (i > 0 && v < a.cu_in[i - 1]) atomicMin(&first_drop, i);
  }
  __syncthreads();
  for (int i = threadIdx.x; i <= n; i += kThreads)
    if (i >= first_drop && a.cu_in[i] != 0) atomicMin(&first_bad, i);
  __syncthreads();
  if (first_bad != INT_MAX) {  // nothing is attended: no tiles, no tokens, no padded rows
    for (int i = threadIdx.x; i <= n; i += kThreads) a.cu[i] = 0, a.cu_padded[i] = 0;
    if (threadIdx.x == 0) *a.num_tiles = 0, *a.status = first_bad + 1;
    return;
  }
  // 2. Offsets and padded offsets, a chunk of kThreads segments at a time.
  int64_t pad_carry = 0, tile_carry = 0;
  for (int base = 0; base <= n; base += kThreads) {
    const int i = base + threadIdx.x;
    int64_t len = 0;
    if (i <= n) a.cu[i] = normalized(a, i, first_drop);
    if (i < n) len = normalized(a, i + 1, first_drop) - normalized(a, i, first_drop);
    int64_t pad_total = 0, tile_total = 0;
    const int64_t pad_before = block_exclusive_scan(layout::round_up_tile(int(len)), &pad_total);
    const int64_t tiles = (len + a.block_m - 1) / a.block_m;
    block_exclusive_scan(tiles, &tile_total);
    if (i <= n) a.cu_padded[i] = int32_t(pad_carry + pad_before);
    if (i < n && tiles > 0) {
      const int kv_blocks = int((len + layout::kBlockN - 1) / layout::kBlockN);
      atomicAdd(&bucket[min(kv_blocks, kBuckets - 1)], unsigned(tiles));
    }
    pad_carry += pad_total;
    tile_carry += tile_total;
  }
  // 3. Each bucket's first tile, the buckets in descending order of KV blocks.
  __syncthreads();
  const int b = kBuckets - 1 - int(threadIdx.x);
  int64_t unused = 0;
  const int64_t start = block_exclusive_scan(bucket[b], &unused);
  __syncthreads();
  bucket[b] = unsigned(start);
  __syncthreads();
  // 4. The work list: each segment's tiles at its bucket's cursor (within a bucket in any order; the
  //    order changes only which SM runs a tile first, never a result).
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int64_t len = int64_t(a.cu[i + 1]) - a.cu[i];
    const int tiles = int((len + a.block_m - 1) / a.block_m);
    if (tiles == 0) continue;
    const int kv_blocks = int((len + layout::kBlockN - 1) / layout::kBlockN);
    const unsigned int at = atomicAdd(&bucket[min(kv_blocks, kBuckets - 1)], unsigned(tiles));
    for (int m = 0; m < tiles; ++m) a.tiles[at + m] = make_int2(i, m);
  }
  if (threadIdx.x == 0) *a.num_tiles = int32_t(tile_carry), *a.status = 0;
}

}  // namespace

void launch_schedule(const ScheduleArgs& a, cudaStream_t stream) {
  schedule_kernel<<<1, kThreads, 0, stream>>>(a);
  FOVEA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace fovea::cuda
