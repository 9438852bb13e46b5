// The C ABI (include/fovea/fovea_attn.h) called from C++ as any C caller would, on the CPU reference:
// what the Python tests check through ctypes, here also under ASan + UBSan (scripts/sanitize.sh),
// plus the hostile calls a C caller can make (null pointers, bad enums and strides, calls out of order).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "fovea/attention.h"
#include "fovea/bf16.h"
#include "fovea/fovea_attn.h"
#include "fovea/random.h"
#include "test-util.h"

using namespace fovea;

namespace {

struct Handle {
  fovea_attn* h = nullptr;
  ~Handle() { fovea_attn_destroy(h); }
};

std::string last() { return fovea_attn_last_error(); }

// A fused [N, 3, H, hd] bf16 batch and the same values as floats.
struct Batch {
  VarlenShape shape;
  std::vector<uint16_t> bits;
  std::vector<float> values;
  Batch(std::vector<int> seqlens, int heads, int hd, uint64_t seed) : shape(varlen_from_seqlens(seqlens, heads, hd)) {
    values = random_qkv(shape.total_tokens(), heads, hd, Dist::NORMAL, seed);
    for (float& v : values) v = bf16_round(v);
    bits.resize(values.size());
    to_bf16(values.data(), values.size(), bits.data());
  }
  int64_t row() const { return int64_t(shape.heads) * shape.head_dim; }
  fovea_attn_view view(int w) { return {bits.data() + w * row(), 3 * row(), shape.head_dim}; }
  ThdView<const float> fview(int w) const { return {values.data() + w * row(), 3 * row(), shape.head_dim}; }
};

TEST(CApi, VersionAndFreshState) {
  EXPECT_EQ(fovea_attn_abi_version(), FOVEA_ATTN_ABI_VERSION);
  EXPECT_STREQ(fovea_attn_version(), FOVEA_VERSION);
  fovea_attn_amax_state st;
  std::memset(&st, 0x7F, sizeof st);
  fovea_attn_amax_state_init(&st);
  for (const auto& t : st.t) {
    EXPECT_EQ(t.filled, 0);
    EXPECT_EQ(t.updates, 0u);
    EXPECT_EQ(t.scale, kMinScale);
  }
  fovea_attn_amax_state_init(nullptr);  // a no-op
}

// Through the ABI, the CPU backend computes exactly what cpu::attention computes on the same values.
TEST(CApi, CpuMatchesTheReferenceBitForBit) {
  for (auto dtype : {FOVEA_ATTN_BF16, FOVEA_ATTN_FP8}) {
    Batch b({37, 1, 90}, 2, 72, test::fresh_seed());
    Handle h;
    ASSERT_EQ(fovea_attn_create(dtype, FOVEA_ATTN_AUTO, 2, 72, FOVEA_ATTN_DEVICE_CPU, &h.h), FOVEA_ATTN_OK) << last();
    EXPECT_EQ(fovea_attn_backend_of(h.h), FOVEA_ATTN_CPU);
    ASSERT_EQ(fovea_attn_plan(h.h, b.shape.cu_seqlens.data(), b.shape.num_segments(), nullptr), FOVEA_ATTN_OK) << last();
    const float fixed[3] = {0.004f, 0.005f, 0.006f};
    const fovea_attn_scales sc{dtype == FOVEA_ATTN_FP8 ? FOVEA_ATTN_SCALES_STATIC : FOVEA_ATTN_SCALES_NONE, fixed, nullptr};
    fovea_attn_view q = b.view(0), k = b.view(1), v = b.view(2);
    ASSERT_EQ(fovea_attn_prepare(h.h, &q, &k, &v, &sc, 0.0f, nullptr), FOVEA_ATTN_OK) << last();
    std::vector<uint16_t> out(size_t(b.shape.total_tokens() * b.row()), 0x7FC0);  // NaN
    fovea_attn_view o{out.data(), b.row(), 72};
    ASSERT_EQ(fovea_attn_attend(h.h, &o, nullptr), FOVEA_ATTN_OK) << last();
    cpu::RefOptions opt;
    opt.mode = dtype == FOVEA_ATTN_FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    opt.fp8_scales = {fixed[0], fixed[1], fixed[2]};
    std::vector<double> ref(out.size());
    cpu::attention(b.shape, b.fview(0), b.fview(1), b.fview(2), opt, ref.data());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(bf16_to_float(out[i]), float(ref[i])) << i;
  }
}

TEST(CApi, HostileCallsFailWithMessages) {
  fovea_attn* h = nullptr;
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_create(7, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("unknown dtype 7"), std::string::npos) << last();
  EXPECT_EQ(h, nullptr);
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, 9, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 0, 64, FOVEA_ATTN_DEVICE_CPU, &h), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, -7, &h), FOVEA_ATTN_INVALID);
  EXPECT_NE(fovea_attn_create(FOVEA_ATTN_FP8, FOVEA_ATTN_AUTO, 2, 64, 0, &h), FOVEA_ATTN_OK);  // no GPU here
  EXPECT_FALSE(last().empty());
  EXPECT_EQ(fovea_attn_plan(nullptr, nullptr, 1, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_prepare(nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_attend(nullptr, nullptr, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_backend_of(nullptr), -1);
  fovea_attn_destroy(nullptr);

  Batch b({5, 9}, 2, 64, 1);
  Handle hh;
  ASSERT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, &hh.h), FOVEA_ATTN_OK);
  fovea_attn_view q = b.view(0), k = b.view(1), v = b.view(2);
  EXPECT_EQ(fovea_attn_prepare(hh.h, &q, &k, &v, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("prepare before plan"), std::string::npos) << last();
  const int32_t bad[] = {0, 4, 3};
  EXPECT_EQ(fovea_attn_plan(hh.h, bad, 2, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_plan(hh.h, bad, 0, nullptr), FOVEA_ATTN_INVALID);
  ASSERT_EQ(fovea_attn_plan(hh.h, b.shape.cu_seqlens.data(), 2, nullptr), FOVEA_ATTN_OK) << last();
  fovea_attn_view null_v{nullptr, 384, 64}, overlap{q.data, 1, 1};
  EXPECT_EQ(fovea_attn_prepare(hh.h, &null_v, &k, &v, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_prepare(hh.h, &overlap, &k, &v, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("overlap"), std::string::npos) << last();
  const fovea_attn_scales dyn{FOVEA_ATTN_SCALES_DYNAMIC, nullptr, nullptr};
  EXPECT_EQ(fovea_attn_prepare(hh.h, &q, &k, &v, &dyn, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_prepare(hh.h, &q, &k, &v, nullptr, 0.3f, nullptr), FOVEA_ATTN_UNSUPPORTED);
  EXPECT_EQ(fovea_attn_prepare_fused(hh.h, b.bits.data(), 5, nullptr, nullptr, nullptr, nullptr), FOVEA_ATTN_INVALID);
  float cos = 1;
  EXPECT_EQ(fovea_attn_prepare_fused(hh.h, b.bits.data(), 3 * 128, &cos, nullptr, nullptr, nullptr), FOVEA_ATTN_INVALID);
  std::vector<uint16_t> out(size_t(14 * 128));
  fovea_attn_view o{out.data(), 128, 64};
  EXPECT_EQ(fovea_attn_attend(hh.h, &o, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("attend before prepare"), std::string::npos) << last();
  ASSERT_EQ(fovea_attn_prepare(hh.h, &q, &k, &v, nullptr, 0.125f, nullptr), FOVEA_ATTN_OK) << last();
  EXPECT_TRUE(last().empty()) << "a call that succeeds clears the last error";
  EXPECT_EQ(fovea_attn_attend(hh.h, &o, nullptr), FOVEA_ATTN_OK) << last();
}

TEST(CApi, ScaleFilesAndCalibration) {
  test::TempDir dir;
  const std::string path = dir.file("s.json");
  const float qkv[6] = {0.5f, 0.25f, 0.125f, 1, 2, 4};
  ASSERT_EQ(fovea_attn_scale_file_write(path.c_str(), 2, qkv), FOVEA_ATTN_OK) << last();
  float back[6] = {};
  ASSERT_EQ(fovea_attn_scale_file_read(path.c_str(), 2, back), FOVEA_ATTN_OK) << last();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(back[i], qkv[i]);
  EXPECT_EQ(fovea_attn_scale_file_read(path.c_str(), 3, back), FOVEA_ATTN_RUNTIME);
  EXPECT_EQ(fovea_attn_scale_file_read(path.c_str(), 0, back), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_scale_file_read(nullptr, 1, back), FOVEA_ATTN_INVALID);
  const std::string bad = dir.write("bad.json", "{\"visual.blocks.0.attn.attn\": {\"q\": 1, \"k\": 1");
  EXPECT_EQ(fovea_attn_scale_file_read(bad.c_str(), 1, back), FOVEA_ATTN_RUNTIME);
  EXPECT_NE(last().find("bad.json"), std::string::npos) << last();
  const float nan3[3] = {NAN, 1, 1};
  EXPECT_EQ(fovea_attn_scale_file_write(path.c_str(), 1, nan3), FOVEA_ATTN_INVALID);
  EXPECT_EQ(dir.list(), std::vector<std::string>({"bad.json", "s.json"})) << "no temporary file left";

  fovea_attn_amax_state st[2];
  fovea_attn_amax_state_init(&st[0]);
  fovea_attn_amax_state_init(&st[1]);
  float out[6];
  EXPECT_EQ(fovea_attn_calibrated_scales(st, 2, 1.5f, out), FOVEA_ATTN_RUNTIME);  // empty rings
  for (auto& s : st)
    for (int i = 0; i < 3; ++i) {
      AmaxHistory h;
      std::memcpy(&h, &s.t[i], sizeof h);
      amax_history_record(h, 448.0f * float(i + 1));
      std::memcpy(&s.t[i], &h, sizeof h);
    }
  ASSERT_EQ(fovea_attn_calibrated_scales(st, 2, 1.5f, out), FOVEA_ATTN_OK) << last();
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(out[i], 1.5f * float(i % 3 + 1));
  EXPECT_EQ(fovea_attn_calibrated_scales(st, 2, -1.0f, out), FOVEA_ATTN_INVALID);
}

}  // namespace
