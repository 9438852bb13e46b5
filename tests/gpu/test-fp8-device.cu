// GPU: fovea's E4M3 encoder compiled for the device agrees with the hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32, which cuda_fp8.h uses on sm_89+) on all 2^32 floats, and the device
// decoder agrees with the host decoder on all 256 codes. Label `gpu`: runs on the GPU machine.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "fovea/fp8.h"

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

namespace {

__global__ void compare_kernel(unsigned long long* bad, unsigned int* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    const float x = fovea::bits_float(uint32_t(i));
    const uint8_t hw = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    if (fovea::e4m3_from_float(x) != hw && atomicAdd(bad, 1ull) == 0) *first = uint32_t(i);
  }
}

__global__ void decode_kernel(float* out) { out[threadIdx.x] = fovea::e4m3_to_float(uint8_t(threadIdx.x)); }

}  // namespace

TEST(Fp8Device, EncodeMatchesHardwareOnEveryFloat) {
  unsigned long long* bad;
  unsigned int* first;
  CUDA_OK(cudaMalloc(&bad, sizeof *bad));
  CUDA_OK(cudaMalloc(&first, sizeof *first));
  CUDA_OK(cudaMemset(bad, 0, sizeof *bad));
  compare_kernel<<<1024, 256>>>(bad, first);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  unsigned long long h_bad = 1;
  unsigned int h_first = 0;
  CUDA_OK(cudaMemcpy(&h_bad, bad, sizeof h_bad, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&h_first, first, sizeof h_first, cudaMemcpyDeviceToHost));
  EXPECT_EQ(h_bad, 0ull) << "first mismatch: float bits 0x" << std::hex << h_first;
  cudaFree(bad);
  cudaFree(first);
}

TEST(Fp8Device, DecodeMatchesHost) {
  float* d;
  CUDA_OK(cudaMalloc(&d, 256 * sizeof(float)));
  CUDA_OK(cudaMemset(d, 0xFF, 256 * sizeof(float)));  // poison
  decode_kernel<<<1, 256>>>(d);
  CUDA_OK(cudaGetLastError());
  float h[256];
  CUDA_OK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
  for (int c = 0; c < 256; ++c) {
    const float ref = fovea::e4m3_to_float(uint8_t(c));
    if (ref != ref) EXPECT_NE(h[c], h[c]) << c;
    else EXPECT_EQ(h[c], ref) << "code " << c;
  }
  cudaFree(d);
}
