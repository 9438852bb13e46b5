// The C ABI (include/fovea/fovea_attn.h) called from C++ as any C caller would, on the CPU reference:
// what the Python tests check through ctypes, here also under ASan + UBSan (scripts/sanitize.sh),
// plus the hostile calls a C caller can make (null pointers, bad enums and strides, calls out of order,
// corrupt FP8 state, sizes whose products overflow), each refused with the field named and nothing
// written out of bounds (outputs sit between poisoned guards).
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "fovea/attention.h"
#include "fovea/attention-ref.h"
#include "fovea/bf16.h"
#include "fovea/fovea_attn.h"
#include "fovea/random.h"
#include "fovea/scales.h"
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
// The device allocator hook: both callbacks (installed) or neither (cudaMalloc again); one alone is
// refused naming both. (Its use is tested on the GPU: python/tests/test_vllm_double.py, test 7.)
TEST(CApi, AllocatorIsBothCallbacksOrNeither) {
  const fovea_attn_alloc_fn alloc = +[](size_t, int32_t, void*) -> void* { return nullptr; };
  const fovea_attn_free_fn release = +[](void*, size_t, int32_t, void*) {};
  EXPECT_EQ(fovea_attn_set_allocator(alloc, nullptr, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("alloc and free must both be set"), std::string::npos) << last();
  EXPECT_EQ(fovea_attn_set_allocator(nullptr, release, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_set_allocator(alloc, release, nullptr), FOVEA_ATTN_OK);
  EXPECT_EQ(fovea_attn_set_allocator(nullptr, nullptr, nullptr), FOVEA_ATTN_OK);
}

TEST(CApi, CpuMatchesTheReferenceBitForBit) {
  for (auto dtype : {FOVEA_ATTN_BF16, FOVEA_ATTN_FP8}) {
    Batch b({37, 1, 90}, 2, 72, test::fresh_seed());
    Handle h;
    ASSERT_EQ(fovea_attn_create(dtype, FOVEA_ATTN_AUTO, 2, 72, FOVEA_ATTN_DEVICE_CPU, &h.h), FOVEA_ATTN_OK) << last();
    EXPECT_EQ(fovea_attn_backend_of(h.h), FOVEA_ATTN_CPU);
    ASSERT_EQ(fovea_attn_plan(h.h, b.shape.cu_seqlens.data(), b.shape.num_segments(), nullptr), FOVEA_ATTN_OK)
        << last();
    const float fixed[3] = {0.004f, 0.005f, 0.006f};
    const fovea_attn_scales sc{dtype == FOVEA_ATTN_FP8 ? FOVEA_ATTN_SCALES_STATIC : FOVEA_ATTN_SCALES_NONE, fixed,
                               nullptr, nullptr, nullptr};
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
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_create(7, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("unknown dtype 7"), std::string::npos) << last();
  EXPECT_EQ(h, nullptr);
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, 9, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 0, 64, FOVEA_ATTN_DEVICE_CPU, &h), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, -7, &h), FOVEA_ATTN_INVALID);
  // A GPU no machine has (device 0 exists where the GPU tests run this binary too).
  EXPECT_NE(fovea_attn_create(FOVEA_ATTN_FP8, FOVEA_ATTN_AUTO, 2, 64, 4096, &h), FOVEA_ATTN_OK);
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
  const fovea_attn_scales dyn{FOVEA_ATTN_SCALES_DYNAMIC, nullptr, nullptr, nullptr, nullptr};
  EXPECT_EQ(fovea_attn_prepare(hh.h, &q, &k, &v, &dyn, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_prepare(hh.h, &q, &k, &v, nullptr, 0.3f, nullptr), FOVEA_ATTN_UNSUPPORTED);
  EXPECT_EQ(fovea_attn_prepare_fused(hh.h, b.bits.data(), 5, nullptr, nullptr, nullptr, nullptr), FOVEA_ATTN_INVALID);
  float cos = 1;
  EXPECT_EQ(fovea_attn_prepare_fused(hh.h, b.bits.data(), 3 * 128, &cos, nullptr, nullptr, nullptr),
            FOVEA_ATTN_INVALID);
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

// ---- hostile states and sizes (issue 45): INVALID, the field named, nothing written ------------------

constexpr uint32_t kPoison = 0xDEADBEEFu;

// A state between poisoned guards: a forward that indexes past it, or writes it when refused, shows.
struct GuardedState {
  uint32_t before[32];
  fovea_attn_amax_state st;
  uint32_t after[32];
  GuardedState() {
    std::fill(std::begin(before), std::end(before), kPoison);
    std::fill(std::begin(after), std::end(after), kPoison);
    fovea_attn_amax_state_init(&st);
  }
  bool guards_intact() const {
    return std::all_of(std::begin(before), std::end(before), [](uint32_t x) { return x == kPoison; }) &&
           std::all_of(std::begin(after), std::end(after), [](uint32_t x) { return x == kPoison; });
  }
};

struct BadState {
  const char* what;
  std::function<void(fovea_attn_amax_history&)> corrupt;
  int tensor;
  std::string message;
};

std::vector<BadState> bad_states() {
  return {
      {"pos 2^30 (was SIGSEGV)", [](auto& t) { t.pos = 1 << 30; }, 1,
       "amax_state.t[1].pos (k's ring position) = 1073741824 is outside [0, 16)"},
      {"pos 17 (overwrote filled)", [](auto& t) { t.pos = 17; }, 0,
       "amax_state.t[0].pos (q's ring position) = 17 is outside [0, 16)"},
      {"pos 16", [](auto& t) { t.pos = 16; }, 2, "amax_state.t[2].pos (v's ring position) = 16 is outside [0, 16)"},
      {"pos -1", [](auto& t) { t.pos = -1; }, 2, "amax_state.t[2].pos (v's ring position) = -1 is outside [0, 16)"},
      {"filled 17", [](auto& t) { t.filled = 17; }, 2,
       "amax_state.t[2].filled (v's fill count) = 17 is outside [0, 16]"},
      {"filled INT32_MIN", [](auto& t) { t.filled = INT32_MIN; }, 0,
       "amax_state.t[0].filled (q's fill count) = -2147483648 is outside [0, 16]"},
      {"pos ahead of filled", [](auto& t) { t.pos = 7, t.filled = 3; }, 1,
       "amax_state.t[1].pos (k's ring position) = 7 with filled = 3"},
      {"a NaN amax", [](auto& t) { t.pos = t.filled = 2, t.ring[1] = NAN; }, 1,
       "amax_state.t[1].ring[1] (k's amax) = nan"},
      {"an infinite amax", [](auto& t) { t.pos = t.filled = 1, t.ring[0] = INFINITY; }, 0,
       "amax_state.t[0].ring[0] (q's amax) = inf"},
      {"a negative amax", [](auto& t) { t.pos = t.filled = 1, t.ring[0] = -2.0f; }, 2,
       "amax_state.t[2].ring[0] (v's amax) = -2"},
  };
}

// A planned FP8 CPU handle with one batch; prepare through the views or the fused path.
struct Fp8Cpu {
  Batch b{{5, 9}, 2, 64, 11};
  Handle h;
  Fp8Cpu() {
    EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_FP8, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h.h), FOVEA_ATTN_OK)
        << last();
    EXPECT_EQ(fovea_attn_plan(h.h, b.shape.cu_seqlens.data(), b.shape.num_segments(), nullptr), FOVEA_ATTN_OK)
        << last();
  }
  int32_t prepare(const fovea_attn_scales& sc, bool fused) {
    if (fused) return fovea_attn_prepare_fused(h.h, b.bits.data(), 3 * b.row(), nullptr, nullptr, &sc, nullptr);
    fovea_attn_view q = b.view(0), k = b.view(1), v = b.view(2);
    return fovea_attn_prepare(h.h, &q, &k, &v, &sc, 0.0f, nullptr);
  }
};

TEST(CApi, CorruptDynamicStateIsRefusedAndNotWritten) {
  Fp8Cpu f;
  for (bool fused : {false, true})
    for (const BadState& bad : bad_states()) {
      SCOPED_TRACE(std::string(bad.what) + (fused ? " (fused)" : " (views)"));
      GuardedState g;
      bad.corrupt(g.st.t[bad.tensor]);
      const fovea_attn_amax_state before = g.st;
      const fovea_attn_scales sc{FOVEA_ATTN_SCALES_DYNAMIC, nullptr, &g.st, nullptr, nullptr};
      EXPECT_EQ(f.prepare(sc, fused), FOVEA_ATTN_INVALID);
      EXPECT_NE(last().find(bad.message), std::string::npos) << last();
      EXPECT_EQ(std::memcmp(&before, &g.st, sizeof before), 0) << "a refused state is left as it was";
      EXPECT_TRUE(g.guards_intact());
      std::vector<uint16_t> out(size_t(f.b.shape.total_tokens() * f.b.row()));
      fovea_attn_view o{out.data(), f.b.row(), 64};
      EXPECT_EQ(fovea_attn_attend(f.h.h, &o, nullptr), FOVEA_ATTN_INVALID) << "nothing was prepared";
    }
  // What fovea's forwards leave is accepted: a wrapped ring goes on at any position.
  GuardedState g;
  for (auto& t : g.st.t) t.filled = 16, t.pos = 5, t.updates = UINT32_MAX, t.nonfinite = UINT32_MAX, t.scale = NAN;
  const fovea_attn_scales sc{FOVEA_ATTN_SCALES_DYNAMIC, nullptr, &g.st, nullptr, nullptr};
  ASSERT_EQ(f.prepare(sc, false), FOVEA_ATTN_OK) << last();
  EXPECT_TRUE(g.guards_intact());
  for (const auto& t : g.st.t) {
    EXPECT_EQ(t.pos, 6);
    EXPECT_EQ(t.filled, 16);
    EXPECT_EQ(t.updates, 0u);  // a counter wraps
  }
}

TEST(CApi, MisalignedOrBadStaticScalesAreRefused) {
  Fp8Cpu f;
  alignas(4) unsigned char raw[sizeof(fovea_attn_amax_state) + 8] = {};
  const fovea_attn_scales odd{FOVEA_ATTN_SCALES_DYNAMIC, nullptr, raw + 1, nullptr, nullptr};
  EXPECT_EQ(f.prepare(odd, false), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("`state` is not 4-byte aligned"), std::string::npos) << last();
  const float zero_k[3] = {0.01f, 0.0f, 0.01f}, nan_v[3] = {0.01f, 0.01f, NAN};
  const fovea_attn_scales s0{FOVEA_ATTN_SCALES_STATIC, zero_k, nullptr, nullptr, nullptr},
      s1{FOVEA_ATTN_SCALES_STATIC, nan_v, nullptr, nullptr, nullptr};
  EXPECT_EQ(f.prepare(s0, true), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("fixed[1] (k) = 0 is not a finite number > 0"), std::string::npos) << last();
  EXPECT_EQ(f.prepare(s1, false), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("fixed[2] (v) = nan"), std::string::npos) << last();
}

TEST(CApi, HeadSizesWhoseProductOverflowsAreRefusedAtCreate) {
  for (auto dtype : {FOVEA_ATTN_BF16, FOVEA_ATTN_FP8}) {
    fovea_attn* h = reinterpret_cast<fovea_attn*>(uintptr_t(0x1));  // must be reset to null
    // 2^30 x 2^30: the products wrapped to 0 and prepare wrote into an empty buffer (SIGSEGV).
    EXPECT_EQ(fovea_attn_create(dtype, FOVEA_ATTN_CPU, 1 << 30, 1 << 30, FOVEA_ATTN_DEVICE_CPU, &h),
              FOVEA_ATTN_INVALID);
    EXPECT_EQ(h, nullptr);
    EXPECT_NE(last().find("heads x head_dim = 1073741824 x 1073741824"), std::string::npos) << last();
    EXPECT_NE(last().find("PTRDIFF_MAX"), std::string::npos) << last();
    EXPECT_EQ(fovea_attn_create(dtype, FOVEA_ATTN_CPU, INT32_MAX, 1 << 30, FOVEA_ATTN_DEVICE_CPU, &h),
              FOVEA_ATTN_INVALID);
    // The bound is 3 x heads x head_dim x 8 bytes <= PTRDIFF_MAX: 2^30 x 2^29 is over, 2^30 x 2^28 within.
    EXPECT_EQ(fovea_attn_create(dtype, FOVEA_ATTN_CPU, 1 << 30, 1 << 29, FOVEA_ATTN_DEVICE_CPU, &h),
              FOVEA_ATTN_INVALID);
    Handle ok;
    EXPECT_EQ(fovea_attn_create(dtype, FOVEA_ATTN_CPU, 1 << 30, 1 << 28, FOVEA_ATTN_DEVICE_CPU, &ok.h), FOVEA_ATTN_OK)
        << last();
  }
}

TEST(CApi, TokenCountsWhoseBuffersOverflowAreRefusedAtPlan) {
  Handle h;
  ASSERT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 1 << 15, 1 << 15, FOVEA_ATTN_DEVICE_CPU, &h.h),
            FOVEA_ATTN_OK);
  const int32_t cu[] = {0, 7, INT32_MAX};
  EXPECT_EQ(fovea_attn_plan(h.h, cu, 2, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("cu_seqlens[2] = 2147483647 tokens of 32768 heads x 32768"), std::string::npos) << last();
  EXPECT_NE(last().find("PTRDIFF_MAX"), std::string::npos) << last();
  const int32_t few[] = {0, 7};  // 7 x 3 x 2^30 x 8 bytes: within
  EXPECT_EQ(fovea_attn_plan(h.h, few, 1, nullptr), FOVEA_ATTN_OK) << last();
  EXPECT_EQ(fovea_attn_plan(h.h, cu, 2, nullptr), FOVEA_ATTN_INVALID);
  uint16_t x[64] = {};
  fovea_attn_view v{x, 1 << 15, 1};
  EXPECT_EQ(fovea_attn_prepare(h.h, &v, &v, &v, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("prepare before plan"), std::string::npos) << "a refused plan drops the last one: " << last();
}

TEST(CApi, SegmentOffsetsAreReadUpToTheFirstBadEntry) {
  Handle h;
  ASSERT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h.h), FOVEA_ATTN_OK);
  // A heap array of exactly three entries: under ASan a read past cu[2] fails the test.
  const std::vector<int32_t> cu = {0, 5, 3};
  EXPECT_EQ(fovea_attn_plan(h.h, cu.data(), INT32_MAX, nullptr),
            FOVEA_ATTN_INVALID);  // was: num_segments + 1 overflowed
  EXPECT_NE(last().find("cu_seqlens[2] = 3 is not above cu_seqlens[1] = 5"), std::string::npos) << last();
  const std::vector<int32_t> neg = {-4, 5};
  EXPECT_EQ(fovea_attn_plan(h.h, neg.data(), INT32_MAX, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("cu_seqlens[0] = -4 must be 0"), std::string::npos) << last();
  const std::vector<int32_t> wrapped = {0, 5, INT32_MIN + 5};  // 2^32 + 5 truncated to int32 by a careless caller
  EXPECT_EQ(fovea_attn_plan(h.h, wrapped.data(), 2, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("cu_seqlens[2] = -2147483643"), std::string::npos) << last();
  EXPECT_EQ(
      fovea_attn_plan(h.h, reinterpret_cast<const int32_t*>(reinterpret_cast<uintptr_t>(cu.data()) + 2), 1, nullptr),
      FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("cu_seqlens is not 4-byte aligned"), std::string::npos) << last();
}

TEST(CApi, ViewsThatReachPastTheAddressSpaceAreRefused) {
  Batch b({5, 9}, 2, 64, 3);  // 14 tokens
  Handle h;
  ASSERT_EQ(fovea_attn_create(FOVEA_ATTN_BF16, FOVEA_ATTN_CPU, 2, 64, FOVEA_ATTN_DEVICE_CPU, &h.h), FOVEA_ATTN_OK);
  ASSERT_EQ(fovea_attn_plan(h.h, b.shape.cu_seqlens.data(), 2, nullptr), FOVEA_ATTN_OK) << last();
  fovea_attn_view q = b.view(0), k = b.view(1), v = b.view(2);
  // 13 tokens x 2^61 elements wraps int64; one head 2^62 elements on is 2^63 bytes, past PTRDIFF_MAX (a
  // view within it is the caller's word for its buffer, as any pointer is).
  const int64_t big = int64_t(1) << 61;
  fovea_attn_view far_tokens{q.data, big, 64}, far_heads{q.data, 64, 2 * big},
      odd{reinterpret_cast<char*>(q.data) + 1, 384, 64},
      at_the_end{reinterpret_cast<void*>(UINTPTR_MAX - 1023), 384, 64};
  EXPECT_EQ(fovea_attn_prepare(h.h, &far_tokens, &k, &v, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("q: 14 tokens at stride_token 2305843009213693952"), std::string::npos) << last();
  EXPECT_EQ(fovea_attn_prepare(h.h, &q, &far_heads, &v, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);  // heads outer
  EXPECT_NE(last().find("k: 14 tokens at stride_token 64 and 2 heads at stride_head 4611686018427387904"),
            std::string::npos)
      << last();
  EXPECT_EQ(fovea_attn_prepare(h.h, &q, &k, &odd, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("v is not 2-byte aligned"), std::string::npos) << last();
  EXPECT_EQ(fovea_attn_prepare(h.h, &q, &k, &at_the_end, nullptr, 0, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("end of the address space"), std::string::npos) << last();
  EXPECT_EQ(fovea_attn_prepare_fused(h.h, b.bits.data(), int64_t(1) << 62, nullptr, nullptr, nullptr, nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("qkv: 14 tokens at stride_token 4611686018427387904"), std::string::npos) << last();
  float table[64];
  EXPECT_EQ(fovea_attn_prepare_fused(h.h, b.bits.data(), 3 * b.row(), table,
                                     reinterpret_cast<float*>(reinterpret_cast<char*>(table) + 2), nullptr, nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("rope_sin is not 4-byte aligned"), std::string::npos) << last();

  // The output: refused before a single element is written; a good call writes inside the guards only.
  ASSERT_EQ(fovea_attn_prepare(h.h, &q, &k, &v, nullptr, 0, nullptr), FOVEA_ATTN_OK) << last();
  const size_t n = size_t(14 * b.row()), guard = 256;
  std::vector<uint16_t> buf(n + 2 * guard, 0xBEEF);
  fovea_attn_view wide{buf.data() + guard, big, 64};
  EXPECT_EQ(fovea_attn_attend(h.h, &wide, nullptr), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("out: 14 tokens at stride_token"), std::string::npos) << last();
  EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](uint16_t x) { return x == 0xBEEF; }));
  fovea_attn_view o{buf.data() + guard, b.row(), 64};
  ASSERT_EQ(fovea_attn_attend(h.h, &o, nullptr), FOVEA_ATTN_OK) << last();
  EXPECT_TRUE(std::all_of(buf.begin(), buf.begin() + guard, [](uint16_t x) { return x == 0xBEEF; }));
  EXPECT_TRUE(std::all_of(buf.end() - guard, buf.end(), [](uint16_t x) { return x == 0xBEEF; }));
}

TEST(CApi, LayerCountsOutOfRangeWriteNothing) {
  test::TempDir dir;
  const std::string path = dir.file("s.json");
  const float one[3] = {1, 1, 1};
  ASSERT_EQ(fovea_attn_scale_file_write(path.c_str(), 1, one), FOVEA_ATTN_OK) << last();
  std::vector<float> buf(64, -7.0f);  // a caller that sized nothing for 10^9 layers
  fovea_attn_amax_state st[2];
  fovea_attn_amax_state_init(&st[0]), fovea_attn_amax_state_init(&st[1]);
  for (int32_t n : {1000000000, FOVEA_ATTN_MAX_LAYERS + 1, 0, -1, INT32_MIN}) {
    SCOPED_TRACE(n);
    const std::string want = "num_layers = " + std::to_string(n) + " is outside [1, 4096]";
    EXPECT_EQ(fovea_attn_scale_file_read(path.c_str(), n, buf.data() + 16), FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find(want), std::string::npos) << last();
    EXPECT_EQ(fovea_attn_scale_file_write(path.c_str(), n, buf.data() + 16), FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find(want), std::string::npos) << last();
    EXPECT_EQ(fovea_attn_calibrated_scales(st, n, 1.5f, buf.data() + 16), FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find(want), std::string::npos) << last();
    EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [](float x) { return x == -7.0f; }));
  }
  EXPECT_EQ(FOVEA_ATTN_MAX_LAYERS, kMaxScaleLayers);
  EXPECT_EQ(fovea_attn_scale_file_read(path.c_str(), FOVEA_ATTN_MAX_LAYERS, buf.data()), FOVEA_ATTN_RUNTIME)
      << "the largest count passes the range check; the file then lacks layers: " << last();
  float* odd = reinterpret_cast<float*>(reinterpret_cast<char*>(buf.data()) + 2);
  EXPECT_EQ(fovea_attn_scale_file_read(path.c_str(), 1, odd), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("qkv is not 4-byte aligned"), std::string::npos) << last();
}

TEST(CApi, CalibrationRefusesACorruptStateNamingTheLayer) {
  for (const BadState& bad : bad_states()) {
    SCOPED_TRACE(bad.what);
    std::vector<fovea_attn_amax_state> st(3);
    for (auto& s : st) {
      fovea_attn_amax_state_init(&s);
      for (auto& t : s.t) t.ring[0] = 448.0f, t.pos = t.filled = 1;
    }
    bad.corrupt(st[2].t[bad.tensor]);
    std::vector<float> out(3 * 3 + 32, -7.0f);
    EXPECT_EQ(fovea_attn_calibrated_scales(st.data(), 3, 1.5f, out.data() + 16), FOVEA_ATTN_INVALID);
    std::string want = bad.message;
    want.replace(0, std::string("amax_state").size(), "states[2]");
    EXPECT_NE(last().find(want), std::string::npos) << last();
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));
  }
}

// ---- the robust scheme through the ABI (issue 49): the same arrays, history and file as C++ ---------

// Random robust arrays for heads x hd: any k_mean, positive scales near the batch's, valid split pairs.
FineScales random_fine(int heads, int hd, uint64_t seed) {
  const size_t cells = size_t(heads) * size_t(hd);
  const std::vector<float> u = random_values(int64_t(3 * cells + 2 * size_t(heads)), Dist::NORMAL, seed, false);
  const auto scale = [&](size_t i) { return 0.006f + 0.001f * std::fabs(u[i]); };  // near a N(0, 1) batch's
  FineScales f;
  for (size_t i = 0; i < cells; ++i) f.k_mean.push_back(0.3f * u[i]);
  for (size_t i = 0; i < cells; ++i) f.v_channel.push_back(scale(cells + i));
  for (int h = 0; h < heads; ++h) f.q_head.push_back(scale(2 * cells + size_t(h)));
  for (int h = 0; h < heads; ++h) f.k_head.push_back(scale(2 * cells + size_t(heads + h)));
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < fp8_split_pairs(hd); ++i) f.qk_split.push_back(i == 0 ? -1 : (h * 7 + i * 5) % (hd / 2));
  return f;
}

fovea_attn_fine abi_fine(const FineScales& f) {
  return {f.k_mean.data(), f.q_head.data(), f.k_head.data(), f.v_channel.data(),
          f.qk_split.empty() ? nullptr : f.qk_split.data()};
}

struct Robust {
  int heads, hd;
  Handle h;
  Robust(int heads_, int hd_) : heads(heads_), hd(hd_) {
    EXPECT_EQ(fovea_attn_create(FOVEA_ATTN_FP8, FOVEA_ATTN_CPU, heads, hd, FOVEA_ATTN_DEVICE_CPU, &h.h), FOVEA_ATTN_OK)
        << last();
  }
  // One forward of `b` through the ABI (views or fused), its output as floats; NaN-poisoned first.
  std::vector<float> run(Batch& b, const fovea_attn_scales& sc, bool fused) {
    EXPECT_EQ(fovea_attn_plan(h.h, b.shape.cu_seqlens.data(), b.shape.num_segments(), nullptr), FOVEA_ATTN_OK);
    fovea_attn_view q = b.view(0), k = b.view(1), v = b.view(2);
    const int32_t rc = fused ? fovea_attn_prepare_fused(h.h, b.bits.data(), 3 * b.row(), nullptr, nullptr, &sc, nullptr)
                             : fovea_attn_prepare(h.h, &q, &k, &v, &sc, 0.0f, nullptr);
    EXPECT_EQ(rc, FOVEA_ATTN_OK) << last();
    std::vector<uint16_t> out(size_t(b.shape.total_tokens() * b.row()), 0x7FC0);
    fovea_attn_view o{out.data(), b.row(), hd};
    EXPECT_EQ(fovea_attn_attend(h.h, &o, nullptr), FOVEA_ATTN_OK) << last();
    std::vector<float> r(out.size());
    for (size_t i = 0; i < out.size(); ++i) r[i] = bf16_to_float(out[i]);
    return r;
  }
};

std::vector<float> reference(const Batch& b, const FineScales& f) {
  cpu::RefOptions opt;
  opt.mode = cpu::RefMode::FP8;
  opt.fp8_fine = cpu::robust_fine(f);
  std::vector<double> ref(size_t(b.shape.total_tokens() * b.row()));
  cpu::attention(b.shape, b.fview(0), b.fview(1), b.fview(2), opt, ref.data());
  return std::vector<float>(ref.begin(), ref.end());
}

// A null qk_split splits no pair (a caller written before head_dim 64 and 128 had room for pairs):
// the output of all -1s.
TEST(CApi, RobustStaticIsTheReferenceWithTheFilesArrays) {
  for (int hd : {64, 72, 128}) {
    SCOPED_TRACE(hd);
    Robust r(2, hd);
    Batch b({37, 1, 60}, 2, hd, test::fresh_seed());
    const FineScales f = random_fine(2, hd, test::fresh_seed());
    ASSERT_EQ(f.qk_split.size(), 2u * fp8_split_pairs(hd));
    const fovea_attn_fine fine = abi_fine(f);
    const fovea_attn_scales sc{FOVEA_ATTN_SCALES_ROBUST_STATIC, nullptr, nullptr, &fine, nullptr};
    const std::vector<float> want = reference(b, f);
    for (bool fused : {false, true}) {
      const std::vector<float> got = r.run(b, sc, fused);
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << i << (fused ? " fused" : " views");
    }
    FineScales none = f;
    none.qk_split.assign(none.qk_split.size(), -1);
    fovea_attn_fine null_split = abi_fine(f);
    null_split.qk_split = nullptr;
    const fovea_attn_scales sn{FOVEA_ATTN_SCALES_ROBUST_STATIC, nullptr, nullptr, &null_split, nullptr};
    const std::vector<float> got = r.run(b, sn, false), all_none = reference(b, none);
    bool differs = false;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], all_none[i]) << i << " null qk_split";
      differs |= got[i] != want[i];
    }
    EXPECT_TRUE(differs) << "the split pairs change the output";
  }
}

// The static guard through the ABI: the scales the scale book's guard picks, the caller's counts
// added to, the file's scales never written; without `guard`, the file's scales as given.
TEST(CApi, TheStaticGuardSwitchesAsTheScaleBookAndCounts) {
  const int H = 2, hd = 72;
  Robust r(H, hd);
  Batch b({37, 1, 60}, H, hd, test::fresh_seed());
  const float amax_q = amax(b.shape, b.fview(0)), amax_k = amax(b.shape, b.fview(1)),
              amax_v = amax(b.shape, b.fview(2));
  // q's and v's ranges (448 s) are passed by the batch, k's is not.
  const float fixed[3] = {0.25f * amax_q / 448.0f, 2.0f * amax_k / 448.0f, 0.5f * amax_v / 448.0f};
  const float kept[3] = {fixed[0], fixed[1], fixed[2]};
  alignas(8) uint64_t counts[3] = {5, 0, 7};
  const fovea_attn_scales guarded{FOVEA_ATTN_SCALES_STATIC, fixed, nullptr, nullptr, counts};
  ScaleBook book = ScaleBook::fixed({{fixed[0], fixed[1], fixed[2]}});
  const QkvScales picked = book.record(0, amax_q, amax_k, amax_v);
  ASSERT_NE(picked.q, fixed[0]);
  ASSERT_EQ(picked.k, fixed[1]);
  const auto reference_at = [&](const QkvScales& sc) {
    cpu::RefOptions opt;
    opt.mode = cpu::RefMode::FP8;
    opt.fp8_scales = sc;
    std::vector<double> ref(size_t(b.shape.total_tokens() * b.row()));
    cpu::attention(b.shape, b.fview(0), b.fview(1), b.fview(2), opt, ref.data());
    return std::vector<float>(ref.begin(), ref.end());
  };
  const std::vector<float> want = reference_at(picked), clipped = reference_at({fixed[0], fixed[1], fixed[2]});
  ASSERT_NE(want, clipped);
  for (bool fused : {false, true}) {
    const std::vector<float> got = r.run(b, guarded, fused);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << i << (fused ? " fused" : " views");
  }
  EXPECT_EQ(counts[0], 7u);  // two forwards, each switched q and v
  EXPECT_EQ(counts[1], 0u);
  EXPECT_EQ(counts[2], 9u);
  EXPECT_EQ(std::memcmp(fixed, kept, sizeof fixed), 0);
  const fovea_attn_scales plain{FOVEA_ATTN_SCALES_STATIC, fixed, nullptr, nullptr, nullptr};
  EXPECT_EQ(r.run(b, plain, true), clipped);

  // Robust: each head's and channel's scales as ScaleBook::guard_fine picks them.
  FineScales f = random_fine(H, hd, test::fresh_seed());
  f.q_head[1] *= 0.01f, f.v_channel[3] *= 0.01f;  // below the batch: the guard raises them
  f.k_head[0] *= 100.0f, f.k_head[1] *= 100.0f;   // far above: kept
  const fovea_attn_fine fine = abi_fine(f);
  uint64_t fine_counts[3] = {0, 0, 0};
  const fovea_attn_scales robust{FOVEA_ATTN_SCALES_ROBUST_STATIC, nullptr, nullptr, &fine, fine_counts};
  ScaleBook fine_book = ScaleBook::fixed({{1.0f, 1.0f, 1.0f}});
  const FineScales g = fine_book.guard_fine(0, f, cpu::fine_batch(b.shape, b.fview(0), b.fview(1), b.fview(2)));
  ASSERT_NE(g.q_head[1], f.q_head[1]);
  ASSERT_NE(g.v_channel[3], f.v_channel[3]);
  EXPECT_EQ(fine_book.guarded(0), (GuardCounts{1, 0, 1}));
  const std::vector<float> robust_want = reference(b, g), robust_clipped = reference(b, f);
  ASSERT_NE(robust_want, robust_clipped);
  const std::vector<float> got = r.run(b, robust, true);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], robust_want[i]) << i;
  EXPECT_EQ(fine_counts[0], 1u);
  EXPECT_EQ(fine_counts[1], 0u);
  EXPECT_EQ(fine_counts[2], 1u);

  // Counts are for static scales only, and 8-byte aligned.
  alignas(LayerAmax) unsigned char st[sizeof(LayerAmax)];
  fovea_attn_amax_state_init(reinterpret_cast<fovea_attn_amax_state*>(st));
  const fovea_attn_scales dynamic{FOVEA_ATTN_SCALES_DYNAMIC, nullptr, st, nullptr, counts};
  EXPECT_EQ(fovea_attn_prepare_fused(r.h.h, b.bits.data(), 3 * b.row(), nullptr, nullptr, &dynamic, nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("`guard`) are for static or robust static scales, not dynamic ones"), std::string::npos)
      << last();
  alignas(8) unsigned char raw[32] = {};
  const fovea_attn_scales odd{FOVEA_ATTN_SCALES_STATIC, fixed, nullptr, nullptr, reinterpret_cast<uint64_t*>(raw + 4)};
  EXPECT_EQ(fovea_attn_prepare_fused(r.h.h, b.bits.data(), 3 * b.row(), nullptr, nullptr, &odd, nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("is not 8-byte aligned"), std::string::npos) << last();
}

TEST(CApi, RobustDynamicRecordsAsTheScaleBookAndCalibratesTheSameFile) {
  const int H = 2, hd = 72;
  Robust r(H, hd);
  const int64_t bytes = fovea_attn_robust_state_bytes(H, hd);
  ASSERT_GT(bytes, 0);
  std::vector<double> block(size_t(bytes + 7) / 8);  // 8-byte aligned
  ASSERT_EQ(fovea_attn_robust_state_init(block.data(), bytes, H, hd), FOVEA_ATTN_OK) << last();
  ScaleBook book = ScaleBook::dynamic(1);
  book.enable_fine(H, hd);
  const fovea_attn_scales sc{FOVEA_ATTN_SCALES_ROBUST_DYNAMIC, nullptr, block.data(), nullptr, nullptr};
  for (int i = 0; i < 3; ++i) {
    Batch b({20 + 9 * i, 33}, H, hd, test::fresh_seed());
    const FineScales f = book.record_fine(0, cpu::fine_batch(b.shape, b.fview(0), b.fview(1), b.fview(2)));
    const std::vector<float> got = r.run(b, sc, i == 1), want = reference(b, f);
    for (size_t j = 0; j < got.size(); ++j) ASSERT_EQ(got[j], want[j]) << "forward " << i << ", value " << j;
  }
  const FineHistory abi = unpack_fine_state(block.data(), H, hd, "test");
  const FineHistory& cpp = book.fine_state()[0];
  EXPECT_EQ(abi.counts.filled, 3);
  EXPECT_EQ(abi.counts.updates, cpp.counts.updates);
  uint32_t forwards = 0;
  ASSERT_EQ(fovea_attn_robust_state_forwards(block.data(), bytes, H, hd, &forwards), FOVEA_ATTN_OK) << last();
  EXPECT_EQ(forwards, 3u);
  EXPECT_EQ(fovea_attn_robust_state_forwards(block.data(), bytes, H + 1, hd, &forwards), FOVEA_ATTN_INVALID);
  EXPECT_EQ(fovea_attn_robust_state_forwards(block.data(), bytes, H, hd, nullptr), FOVEA_ATTN_INVALID);
  std::vector<double> other(block);
  reinterpret_cast<uint8_t*>(other.data())[0] ^= 0xFF;  // the header's magic
  EXPECT_EQ(fovea_attn_robust_state_forwards(other.data(), bytes, H, hd, &forwards), FOVEA_ATTN_INVALID);
  EXPECT_EQ(forwards, 3u);  // left as it was
  EXPECT_EQ(abi.q_ring, cpp.q_ring);
  EXPECT_EQ(abi.v_ring, cpp.v_ring);
  EXPECT_EQ(abi.k_sum, cpp.k_sum);
  EXPECT_EQ(abi.k_hi, cpp.k_hi);
  test::TempDir dir;
  const std::string a = dir.file("abi.json"), c = dir.file("cpp.json");
  ASSERT_EQ(fovea_attn_robust_calibrate(block.data(), 1, H, hd, 1.5f, a.c_str()), FOVEA_ATTN_OK) << last();
  book.save(c, 1.5f);
  EXPECT_EQ(test::slurp(a), test::slurp(c));
  const ScaleFile file = read_scale_file(a);
  ASSERT_EQ(file.fine.size(), 1u);
  EXPECT_GT(file.fine.at(0).robust_gain, 0.0f);
}

TEST(CApi, CorruptRobustStatesAndArraysAreRefusedAndNotWritten) {
  const int H = 2, hd = 72;
  Robust r(H, hd);
  Batch b({11, 5}, H, hd, 3);
  const int64_t bytes = fovea_attn_robust_state_bytes(H, hd);
  std::vector<double> fresh(size_t(bytes + 7) / 8);
  ASSERT_EQ(fovea_attn_robust_state_init(fresh.data(), bytes, H, hd), FOVEA_ATTN_OK);
  const FineStateLayout l(H, hd);
  struct Bad {
    const char* message;
    std::function<void(uint8_t*)> corrupt;
  };
  const auto at = [](uint8_t* p, size_t off, auto v) { std::memcpy(p + off, &v, sizeof v); };
  const std::vector<Bad> bads = {
      {"not a robust state", [&](uint8_t* p) { at(p, 0, int32_t(0)); }},
      {"a robust state for 3 heads of 72, not 2 of 72", [&](uint8_t* p) { at(p, 4, int32_t(3)); }},
      {"pos = 16 is outside [0, 16)", [&](uint8_t* p) { at(p, l.counts, int32_t(16)); }},
      {"pos = 2 with filled = 0", [&](uint8_t* p) { at(p, l.counts, int32_t(2)); }},
      {"filled = 17", [&](uint8_t* p) { at(p, l.counts + 4, int32_t(17)), at(p, l.counts, int32_t(3)); }},
      {"V's ring slot 0 cell 5 = nan",
       [&](uint8_t* p) { at(p, l.counts, int32_t(1)), at(p, l.counts + 4, int32_t(1)), at(p, l.v + 20, NAN); }},
      {"tokens = -1", [&](uint8_t* p) { at(p, l.counts + 16, -1.0); }},
      {"K's statistics of cell 3", [&](uint8_t* p) { at(p, l.k_hi + 12, 1.0f), at(p, l.k_lo + 12, 2.0f); }},
  };
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.message);
    std::vector<double> block = fresh;
    bad.corrupt(reinterpret_cast<uint8_t*>(block.data()));
    const std::vector<double> before = block;
    const fovea_attn_scales sc{FOVEA_ATTN_SCALES_ROBUST_DYNAMIC, nullptr, block.data(), nullptr, nullptr};
    fovea_attn_view q = b.view(0), k = b.view(1), v = b.view(2);
    ASSERT_EQ(fovea_attn_plan(r.h.h, b.shape.cu_seqlens.data(), 2, nullptr), FOVEA_ATTN_OK);
    EXPECT_EQ(fovea_attn_prepare(r.h.h, &q, &k, &v, &sc, 0.0f, nullptr), FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find(bad.message), std::string::npos) << last();
    EXPECT_EQ(std::memcmp(before.data(), block.data(), size_t(bytes)), 0) << "a refused state is left as it was";
    test::TempDir dir;
    EXPECT_EQ(fovea_attn_robust_calibrate(block.data(), 1, H, hd, 1.5f, dir.file("s.json").c_str()),
              FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find("states[0]"), std::string::npos) << last();
    EXPECT_TRUE(dir.list().empty()) << "nothing written";
  }
  EXPECT_EQ(fovea_attn_split_pairs(INT32_MAX), 0);
  EXPECT_EQ(fovea_attn_split_pairs(-72), 0);
  {  // a head wider than any robust state: refused before a size is computed from it
    const int wide = 1 << 17;
    Handle hw;
    ASSERT_EQ(fovea_attn_create(FOVEA_ATTN_FP8, FOVEA_ATTN_CPU, 1, wide, FOVEA_ATTN_DEVICE_CPU, &hw.h), FOVEA_ATTN_OK);
    const int32_t cu[2] = {0, 1};
    ASSERT_EQ(fovea_attn_plan(hw.h, cu, 1, nullptr), FOVEA_ATTN_OK) << last();
    std::vector<uint16_t> x(size_t(wide), 0);
    fovea_attn_view w{x.data(), wide, wide};
    const fovea_attn_scales sc{FOVEA_ATTN_SCALES_ROBUST_DYNAMIC, nullptr, fresh.data(), nullptr, nullptr};
    EXPECT_EQ(fovea_attn_prepare(hw.h, &w, &w, &w, &sc, 0.0f, nullptr), FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find("the robust scheme holds at most 65536"), std::string::npos) << last();
  }
  EXPECT_EQ(fovea_attn_robust_state_bytes(0, 72), -1);
  EXPECT_EQ(fovea_attn_robust_state_bytes(1 << 20, 72), -1);
  EXPECT_EQ(fovea_attn_robust_state_init(fresh.data(), bytes - 8, H, hd), FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("is " + std::to_string(bytes) + " bytes, not"), std::string::npos) << last();
  std::vector<double> empty = fresh;
  test::TempDir dir;
  EXPECT_EQ(fovea_attn_robust_calibrate(empty.data(), 1, H, hd, 1.5f, dir.file("s.json").c_str()), FOVEA_ATTN_RUNTIME);
  EXPECT_NE(last().find("layer 0"), std::string::npos) << last();

  // Robust static arrays: checked values, and the split pairs this head_dim has room for.
  FineScales f = random_fine(H, hd, 5);
  const auto refused = [&](const FineScales& g, const char* message, const int32_t* split) {
    fovea_attn_fine fine = abi_fine(g);
    fine.qk_split = split;
    const fovea_attn_scales sc{FOVEA_ATTN_SCALES_ROBUST_STATIC, nullptr, nullptr, &fine, nullptr};
    ASSERT_EQ(fovea_attn_prepare_fused(r.h.h, b.bits.data(), 3 * b.row(), nullptr, nullptr, &sc, nullptr),
              FOVEA_ATTN_INVALID);
    EXPECT_NE(last().find(message), std::string::npos) << last();
  };
  FineScales g = f;
  g.q_head[1] = 0.0f;
  refused(g, "q_head[1] = 0 is not a finite number > 0", g.qk_split.data());
  g = f, g.k_mean[7] = INFINITY;
  refused(g, "k_mean[7] = inf", g.qk_split.data());
  g = f, g.qk_split[2] = g.qk_split[3] = 4;
  refused(g, "split pair 4 is given twice", g.qk_split.data());
  const fovea_attn_scales none{FOVEA_ATTN_SCALES_ROBUST_STATIC, nullptr, nullptr, nullptr, nullptr};
  EXPECT_EQ(fovea_attn_prepare_fused(r.h.h, b.bits.data(), 3 * b.row(), nullptr, nullptr, &none, nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("`fine` is null"), std::string::npos) << last();
}

TEST(CApi, TheFp8PlanIsTheEnginesRule) {
  const int L = 2, H = 2, hd = 72, n = H * fovea_attn_split_pairs(hd);
  ASSERT_EQ(n, 12);
  test::TempDir dir;
  std::vector<FineScales> fine = {random_fine(H, hd, 1), random_fine(H, hd, 2)};
  fine[0].robust_gain = 1.2f;  // well spread: auto keeps per-tensor scales
  fine[1].robust_gain = 6.0f;  // outlier channels: auto runs robust
  const std::string both = dir.file("both.json"), plain = dir.file("plain.json");
  write_scale_file(both, {{0.1f, 0.2f, 0.3f}, {0.4f, 0.5f, 0.6f}}, &fine);
  write_scale_file(plain, {{0.1f, 0.2f, 0.3f}, {0.4f, 0.5f, 0.6f}});
  std::vector<float> km(size_t(L * H * hd), NAN), qh(size_t(L * H), NAN), kh(size_t(L * H), NAN),
      vc(size_t(L * H * hd), NAN), qkv(size_t(L * 3), NAN);
  std::vector<int32_t> split(size_t(L * n), 99), modes(size_t(L), 99);
  const fovea_attn_fine_rows rows{km.data(), qh.data(), kh.data(), vc.data(), split.data()};
  const auto plan = [&](const char* scheme, const char* path, int calibrating) {
    const int32_t rc = fovea_attn_fp8_plan(scheme, path, calibrating, L, H, hd, modes.data(), qkv.data(), &rows);
    return rc == FOVEA_ATTN_OK ? modes : std::vector<int32_t>{-rc};
  };
  using V = std::vector<int32_t>;
  constexpr int32_t S = FOVEA_ATTN_SCALES_STATIC, D = FOVEA_ATTN_SCALES_DYNAMIC, RS = FOVEA_ATTN_SCALES_ROBUST_STATIC,
                    RD = FOVEA_ATTN_SCALES_ROBUST_DYNAMIC;
  EXPECT_EQ(plan("auto", both.c_str(), 0), V({S, RS}));
  EXPECT_EQ(qkv, std::vector<float>({0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f}));
  EXPECT_EQ(std::vector<float>(km.begin(), km.begin() + H * hd), std::vector<float>(size_t(H * hd), 0.0f));
  EXPECT_EQ(std::vector<float>(km.begin() + H * hd, km.end()), fine[1].k_mean);
  EXPECT_EQ(std::vector<float>(qh.begin() + H, qh.end()), fine[1].q_head);
  EXPECT_EQ(std::vector<float>(vc.begin() + H * hd, vc.end()), fine[1].v_channel);
  EXPECT_EQ(V(split.begin(), split.begin() + n), V(size_t(n), -1));
  EXPECT_EQ(V(split.begin() + n, split.end()), fine[1].qk_split);
  EXPECT_EQ(plan("robust", both.c_str(), 0), V({RS, RS}));
  EXPECT_EQ(V(split.begin(), split.begin() + n), fine[0].qk_split);
  EXPECT_EQ(plan("tensor", both.c_str(), 0), V({S, S}));
  EXPECT_EQ(plan("auto", plain.c_str(), 0), V({S, S}));
  EXPECT_EQ(plan("auto", nullptr, 0), V({D, D}));
  EXPECT_EQ(plan("auto", nullptr, 1), V({RD, RD}));
  EXPECT_EQ(plan("robust", nullptr, 0), V({RD, RD}));
  EXPECT_EQ(plan("tensor", nullptr, 1), V({D, D}));
  EXPECT_EQ(plan("robust", plain.c_str(), 0), V({-FOVEA_ATTN_INVALID}));
  EXPECT_NE(last().find("has per-layer q/k/v only"), std::string::npos) << last();
  EXPECT_NE(last().find("plain.json"), std::string::npos) << last();
  EXPECT_EQ(plan("fast", nullptr, 0), V({-FOVEA_ATTN_INVALID}));
  EXPECT_NE(last().find("'fast' is not one of auto, tensor, robust"), std::string::npos) << last();
  const int32_t rc = fovea_attn_fp8_plan("robust", both.c_str(), 0, L, 3, hd, modes.data(), qkv.data(), &rows);
  EXPECT_EQ(rc, FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("layer 0's fine scales are for 2 heads"), std::string::npos) << last();
  EXPECT_EQ(fovea_attn_fp8_plan("auto", both.c_str(), 0, L, H, hd, modes.data(), qkv.data(), nullptr),
            FOVEA_ATTN_INVALID);
  EXPECT_NE(last().find("fine is null"), std::string::npos) << last();
}

}  // namespace
