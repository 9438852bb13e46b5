// GPU: fovea's E4M3 encoder compiled for the device agrees with the hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32, which cuda_fp8.h uses on sm_89+) on all 2^32 floats, and the device
// decoder agrees with the host decoder on all 256 codes. Label `gpu`: runs on the GPU machine.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include "fovea/cuda-support.h"
#include "fovea/fp8.h"

using fovea::cuda::DeviceBuffer;

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
  DeviceBuffer<unsigned long long> bad(1);
  DeviceBuffer<unsigned int> first(1);
  FOVEA_CUDA_CHECK(cudaMemset(bad.data(), 0, bad.bytes()));
  compare_kernel<<<1024, 256>>>(bad.data(), first.data());
  FOVEA_CUDA_CHECK(cudaGetLastError());
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  unsigned long long h_bad = 1;
  unsigned int h_first = 0;
  FOVEA_CUDA_CHECK(cudaMemcpy(&h_bad, bad.data(), sizeof h_bad, cudaMemcpyDeviceToHost));
  FOVEA_CUDA_CHECK(cudaMemcpy(&h_first, first.data(), sizeof h_first, cudaMemcpyDeviceToHost));
  EXPECT_EQ(h_bad, 0ull) << "first mismatch: float bits 0x" << std::hex << h_first;
}

TEST(Fp8Device, DecodeMatchesHost) {
  DeviceBuffer<float> d(256);
  FOVEA_CUDA_CHECK(cudaMemset(d.data(), 0xFF, d.bytes()));  // poison
  decode_kernel<<<1, 256>>>(d.data());
  FOVEA_CUDA_CHECK(cudaGetLastError());
  float h[256];
  FOVEA_CUDA_CHECK(cudaMemcpy(h, d.data(), sizeof h, cudaMemcpyDeviceToHost));
  for (int c = 0; c < 256; ++c) {
    const float ref = fovea::e4m3_to_float(uint8_t(c));
    if (ref != ref) EXPECT_NE(h[c], h[c]) << c;
    else EXPECT_EQ(h[c], ref) << "code " << c;
  }
}
