// Hopper (sm_90a) primitives used by fovea's attention kernels, as thin inline-PTX wrappers:
// mbarriers, TMA bulk tensor loads, wgmma fences and shared-memory matrix descriptors, register
// conversions. Each wrapper is the one PTX instruction its name says.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "fovea/fp8.h"

namespace fovea::cuda::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
// Makes barrier initialization visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- named barriers (bar 0 is __syncthreads) --------------------------------------------------------
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- TMA: 3D tiled bulk tensor load into shared memory, completing on an mbarrier ------------------
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// ---- warpgroup MMA bookkeeping --------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Shared-memory matrix descriptor for a K-major operand (PTX ISA "Matrix Descriptor Format"):
// start address, stride byte offset between 8-row groups, swizzle mode (1: 128B, 3: 32B).
enum Swizzle : uint64_t { kSwizzle128B = 1, kSwizzle32B = 3 };
__device__ __forceinline__ uint64_t kmajor_desc(const void* smem, uint32_t sbo_bytes, Swizzle swz) {
  const uint64_t addr = smem_addr(smem);
  return ((addr & 0x3FFFFu) >> 4) | (uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(swz) << 62);
}

// ---- conversions ----------------------------------------------------------------------------------
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Two floats to two E4M3 (RNE, saturating) in 16 bits, lo in the low byte.
// Before sm_89 (no FP8 conversion instruction) fovea's own codec, which equals it on every float
// (test-fp8-device).
__device__ __forceinline__ uint16_t e4m3x2_of_f32(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return uint16_t(e4m3_from_float(lo) | (uint16_t(e4m3_from_float(hi)) << 8));
#endif
}
// The two values of an E4M3x2 word as floats (exact: every E4M3 value is a half), lo the low byte.
__device__ __forceinline__ float2 f32x2_of_e4m3x2(uint16_t w) {
#if __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(w));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
#else
  return make_float2(e4m3_to_float(uint8_t(w)), e4m3_to_float(uint8_t(w >> 8)));
#endif
}
// Two floats to packed bf16x2, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Four floats to packed E4M3x4 (RNE, saturating), a in the lowest byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  return uint32_t(e4m3x2_of_f32(a, b)) | (uint32_t(e4m3x2_of_f32(c, d)) << 16);
}

}  // namespace fovea::cuda::ptx
