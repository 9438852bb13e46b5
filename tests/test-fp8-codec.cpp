// The E4M3 and bf16 codecs against CUDA's own host conversions (cuda_fp8.h, cuda_bf16.h), on every one
// of the 2^32 float bit patterns, and the E4M3 decoder on all 256 codes.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "fovea/bf16.h"
#include "fovea/fp8.h"
#include "fovea/threads.h"
#include "test-util.h"

using namespace fovea;

namespace {

uint8_t cuda_e4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
float cuda_e4m3_decode(uint8_t c) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(c, __NV_E4M3);
  return __half2float(__half(h));
}
uint16_t cuda_bf16(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  return __nv_bfloat16_raw(b).x;
}

// Runs check(bits) over all 2^32 patterns in parallel; returns the number of mismatches and the
// first mismatching pattern.
template <class F>
std::pair<uint64_t, uint32_t> all_floats(F&& check) {
  constexpr int64_t kChunks = 4096;
  constexpr uint64_t kPerChunk = (uint64_t(1) << 32) / kChunks;
  std::atomic<uint64_t> bad{0};
  std::atomic<uint32_t> first{0};
  parallel_for(kChunks, [&](int64_t c) {
    uint64_t local = 0;
    uint32_t local_first = 0;
    for (uint64_t i = uint64_t(c) * kPerChunk, e = i + kPerChunk; i < e; ++i) {
      if (!check(uint32_t(i))) {
        if (!local++) local_first = uint32_t(i);
      }
    }
    if (local) {
      if (!bad.fetch_add(local)) first = local_first;
    }
  });
  return {bad.load(), first.load()};
}

}  // namespace

TEST(Fp8Codec, EncodeMatchesCudaOnEveryFloat) {
  auto [bad, first] = all_floats([](uint32_t u) {
    const float x = bits_float(u);
    return e4m3_from_float(x) == cuda_e4m3(x);
  });
  EXPECT_EQ(bad, 0u) << "first mismatch: float bits 0x" << std::hex << first << " -> fovea 0x"
                     << int(e4m3_from_float(bits_float(first))) << ", cuda 0x" << int(cuda_e4m3(bits_float(first)));
}

TEST(Fp8Codec, DecodeMatchesCudaOnAllCodes) {
  for (int c = 0; c < 256; ++c) {
    const float ours = e4m3_to_float(uint8_t(c)), theirs = cuda_e4m3_decode(uint8_t(c));
    if (std::isnan(theirs)) {
      EXPECT_TRUE(std::isnan(ours)) << "code 0x" << std::hex << c;
    } else {
      EXPECT_EQ(float_bits(ours), float_bits(theirs)) << "code 0x" << std::hex << c << ": " << ours << " vs " << theirs;
    }
    // Every non-NaN code survives a round trip.
    if (!std::isnan(ours)) {
      EXPECT_EQ(e4m3_from_float(ours), uint8_t(c)) << "code 0x" << std::hex << c;
    }
  }
}

TEST(Fp8Codec, Bf16MatchesCudaOnEveryFloat) {
  auto [bad, first] = all_floats([](uint32_t u) {
    const float x = bits_float(u);
    return bf16_from_float(x) == cuda_bf16(x);
  });
  EXPECT_EQ(bad, 0u) << "first mismatch: float bits 0x" << std::hex << first;
}

// Spot checks that read like the spec, independent of CUDA.
TEST(Fp8Codec, SpecExamples) {
  EXPECT_EQ(e4m3_from_float(448.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(-448.0f), 0xFE);
  EXPECT_EQ(e4m3_from_float(1e9f), 0x7E);       // saturates
  EXPECT_EQ(e4m3_from_float(-INFINITY), 0xFE);  // no infinities in E4M3
  EXPECT_EQ(e4m3_from_float(NAN), kE4M3NaN);
  EXPECT_EQ(e4m3_from_float(1.0f), 0x38);                   // exponent 7 = bias
  EXPECT_EQ(e4m3_from_float(1.0625f), 0x38);                // halfway 1 and 1.125: to even
  EXPECT_EQ(e4m3_from_float(1.1875f), 0x3A);                // halfway 1.125 and 1.25: to even
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -9)), 0x01);   // smallest subnormal
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -10)), 0x00);  // half of it: ties to even (0)
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.5f, -9)), 0x02);   // 1.5 units: ties to even (2)
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -6)), 0x08);   // smallest normal
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
  EXPECT_EQ(e4m3_quantize(3.0f, 0.5f), e4m3_from_float(6.0f));
}

// div_by_reciprocal (the robust scheme's per-channel V quantization) equals the division, bit for
// bit: random bf16 numerators and float divisors over the whole range (the fallback regions
// included), and edge operands; the E4M3 codes agree with them.
TEST(Fp8Codec, DivisionByReciprocalIsTheDivision) {
  std::mt19937_64 rng(test::fresh_seed());
  const auto bits = [](uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  };
  std::vector<float> xs = {0.0f,      -0.0f,        1.0f,     -1.0f, 448.0f,           0x1p-100f,
                           0x1p-101f, 0x1.fep-101f, 65504.0f, 3e38f, bits(0x00010000u)};
  std::vector<float> ss = {FLT_MIN, 1.0f, 0x1p-100f, 0x1p100f, 0x1.fffffep-1f, 0x1.000002p0f, 3.0f, 1e-30f, 1e30f};
  int64_t n = 0;
  for (int i = 0; i < 4000000; ++i) {
    const float x = bits(uint32_t(rng()) & 0xFFFF0000u), s = bits(uint32_t(rng()) & 0x7FFFFFFFu);
    if (!std::isfinite(x) || !std::isfinite(s) || s < FLT_MIN) continue;
    if (xs.size() < 64) xs.push_back(x), ss.push_back(s);
    const float q = x / s, got = div_by_reciprocal(x, s, 1.0f / s);
    ASSERT_EQ(std::memcmp(&q, &got, 4), 0) << std::hexfloat << x << " / " << s << ": " << got << " against " << q;
    ++n;
  }
  for (float x : xs)
    for (float s : ss) {
      const float q = x / s, got = div_by_reciprocal(x, s, 1.0f / s);
      ASSERT_EQ(std::memcmp(&q, &got, 4), 0) << std::hexfloat << x << " / " << s << ": " << got << " against " << q;
      EXPECT_EQ(e4m3_from_float(got), e4m3_quantize(x, s));
    }
  EXPECT_GT(n, 1000000);
}
