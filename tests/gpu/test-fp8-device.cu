// GPU: fovea's E4M3 encoder compiled for the device agrees with the hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32, which cuda_fp8.h uses on sm_89+) on all 2^32 floats, and the device
// decoder agrees with the host decoder on all 256 codes, as does the hardware decode the prepare step
// uses (ptx::f32x2_of_e4m3x2, cvt.rn.f16x2.e4m3x2) on all 2^16 code pairs; the flash kernel's FMA-pipe exponential
// (fovea/flash-p.h) gives the host's bits, and the MUFU's ex2.approx, which the emulation stands in for
// with std::exp2, stays within 2^-21 of it. Label `gpu`: runs on the GPU machine.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "attention/cuda/ptx.cuh"
#include "fovea/cuda-support.h"
#include "fovea/flash-p.h"
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

__global__ void decode_pairs_kernel(float2* out) {
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  out[w] = fovea::cuda::ptx::f32x2_of_e4m3x2(uint16_t(w));
}

__global__ void exp2_kernel(const float* x, float* poly, float* mufu, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  poly[i] = fovea::exp2_poly3(x[i]);
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[i]));  // as the flash kernel's ptx::exp2_approx
  mufu[i] = y;
}

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
    if (ref != ref)
      EXPECT_NE(h[c], h[c]) << c;
    else
      EXPECT_EQ(h[c], ref) << "code " << c;
  }
}

TEST(Fp8Device, HardwarePairDecodeMatchesHost) {
  constexpr int kWords = 1 << 16;
  DeviceBuffer<float2> d(kWords);
  FOVEA_CUDA_CHECK(cudaMemset(d.data(), 0xFF, d.bytes()));  // poison
  decode_pairs_kernel<<<kWords / 256, 256>>>(d.data());
  FOVEA_CUDA_CHECK(cudaGetLastError());
  std::vector<float2> h(kWords);
  FOVEA_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int w = 0; w < kWords; ++w) {
    const float got[2] = {h[w].x, h[w].y};
    for (int e = 0; e < 2; ++e) {
      const float ref = fovea::e4m3_to_float(uint8_t(w >> (8 * e)));
      const bool same = ref != ref ? got[e] != got[e] : got[e] == ref && std::signbit(got[e]) == std::signbit(ref);
      if (!same && bad++ < 5)
        ADD_FAILURE() << "word 0x" << std::hex << w << " byte " << e << ": " << got[e] << " != " << ref;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(FlashPDevice, PolynomialGivesTheHostsBitsAndTheMufuStaysNearExp2) {
  std::vector<float> x = {-INFINITY, -1000.0f, -120.5f, -0.0f, 0.0f, 0.5f, -0.5f, 8.0f, 8.5f};
  for (float v = -126.0f; v <= 9.0f; v += 0.000173f) x.push_back(v);  // ~780k arguments, all rounding cases
  const int n = int(x.size());
  DeviceBuffer<float> dx{size_t(n)}, dpoly{size_t(n)}, dmufu{size_t(n)};
  FOVEA_CUDA_CHECK(cudaMemcpy(dx.data(), x.data(), dx.bytes(), cudaMemcpyHostToDevice));
  FOVEA_CUDA_CHECK(cudaMemset(dpoly.data(), 0xFF, dpoly.bytes()));  // poison
  exp2_kernel<<<(n + 255) / 256, 256>>>(dx.data(), dpoly.data(), dmufu.data(), n);
  FOVEA_CUDA_CHECK(cudaGetLastError());
  std::vector<float> poly(x.size()), mufu(x.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(poly.data(), dpoly.data(), dpoly.bytes(), cudaMemcpyDeviceToHost));
  FOVEA_CUDA_CHECK(cudaMemcpy(mufu.data(), dmufu.data(), dmufu.bytes(), cudaMemcpyDeviceToHost));
  int64_t differ = 0;
  double worst = 0;
  for (int i = 0; i < n; ++i) {
    differ += fovea::float_bits(poly[size_t(i)]) != fovea::float_bits(fovea::exp2_poly3(x[size_t(i)]));
    if (x[size_t(i)] >= -100.0f) {
      const double ref = std::exp2(double(x[size_t(i)]));
      worst = std::max(worst, std::fabs(double(mufu[size_t(i)]) - ref) / ref);
    }
  }
  EXPECT_EQ(differ, 0) << "of " << n;
  EXPECT_LT(worst, std::ldexp(1.0, -21));
  std::printf("ex2.approx relative error against exp2 on [-100, 9]: %.3g (2^%.1f)\n", worst, std::log2(worst));
}
