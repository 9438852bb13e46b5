// GPU tests of the FOVEA backend (prepare step + Hopper flash attention) against the CPU reference:
// every head_dim x dtype, ragged packed batches, fresh random inputs, poisoned outputs, the tolerance
// rule of docs/fp8.md §Correctness; dynamic FP8 scaling replayed from a CUDA graph against the CPU scale book.
// Label `gpu`: runs on the GPU machine.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <optional>
#include <random>

#include "fovea/attention.h"
#include "fovea/attention-gpu.h"
#include "fovea/attention-ref.h"
#include "fovea/bf16.h"
#include "fovea/cuda-support.h"
#include "fovea/error.h"
#include "fovea/random.h"
#include "fovea/rope.h"
#include "fovea/scales.h"
#include "test-util.h"

using namespace fovea;
using fovea::test::fresh_seed;

namespace {

using cuda::DeviceBuffer;

template <class T>
void upload(DeviceBuffer<T>& d, const std::vector<T>& h) {
  FOVEA_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), d.bytes(), cudaMemcpyHostToDevice));
}
template <class T>
std::vector<T> download(const DeviceBuffer<T>& d) {
  std::vector<T> h(d.count());
  FOVEA_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// One random problem: fused qkv (bf16 values), RoPE tables of a 2D grid, and the rotated q, k in fp32
// exactly as prepare() computes them (unfused multiply and add).
struct Problem {
  VarlenShape shape;
  std::vector<float> qkv;       // [N, 3, H, hd], bf16 values
  std::vector<float> cos, sin;  // [N, hd/2]
  std::vector<float> rot;       // [N, 3, H, hd]: q, k rotated; v copied

  // rope = false: no RoPE tables (the kernels take none), q and k as drawn.
  Problem(const std::vector<int>& seqlens, int heads, int hd, uint64_t seed, float magnitude = 1.0f,
          Dist dist = Dist::NORMAL, bool rope = true) {
    shape = varlen_from_seqlens(seqlens, heads, hd);
    const int64_t N = shape.total_tokens();
    qkv = dist == Dist::NORMAL ? random_values(N * 3 * heads * hd, Dist::NORMAL, seed, false)
                               : random_qkv(N, heads, hd, dist, seed);
    for (auto& x : qkv) x = bf16_round(x * magnitude);
    rot = qkv;
    if (!rope) return;
    rope_tables_grid(shape, cos, sin);
    apply_rope_qk(shape, cos, sin, rot);
  }
  ThdView<const float> view(int w) const {
    const int64_t H = shape.heads, hd = shape.head_dim;
    return {rot.data() + w * H * hd, 3 * H * hd, hd};
  }
  std::vector<uint16_t> qkv_bf16() const {
    std::vector<uint16_t> b(qkv.size());
    for (size_t i = 0; i < b.size(); ++i) b[i] = bf16_from_float(qkv[i]);
    return b;
  }
  std::vector<double> reference(const cpu::RefOptions& o) const {
    std::vector<double> out(size_t(shape.total_tokens() * shape.heads * shape.head_dim));
    cpu::attention(shape, view(0), view(1), view(2), o, out.data());
    return out;
  }
};

// Device copies of a problem's inputs and an output buffer.
struct DeviceProblem {
  DeviceBuffer<uint16_t> qkv;
  DeviceBuffer<float> cos, sin;
  DeviceBuffer<uint16_t> out;
  explicit DeviceProblem(const Problem& p)
      : qkv(p.qkv.size()),
        cos(p.cos.size()),
        sin(p.sin.size()),
        out(size_t(p.shape.total_tokens()) * p.shape.heads * p.shape.head_dim) {
    upload(qkv, p.qkv_bf16());
    if (!p.cos.empty()) upload(cos, p.cos), upload(sin, p.sin);
  }
  const float* cos_or_null() const { return cos.count() ? cos.data() : nullptr; }
  const float* sin_or_null() const { return sin.count() ? sin.data() : nullptr; }
  std::vector<double> output() const {
    const auto h = download(out);
    std::vector<double> d(h.size());
    for (size_t i = 0; i < h.size(); ++i) d[i] = bf16_to_float(h[i]);
    return d;
  }
};

float amax_of(const struct Problem& p, int w);
struct Checked;
Checked check_output(const Problem& p, const std::vector<double>& out, const cpu::RefOptions& o);
std::string fmt_name(int hd, AttnDtype d, const char* what) {
  return std::string(dtype_name(d)) + " hd" + std::to_string(hd) + " " + what;
}

// prepare + attend captured once in a CUDA graph on a stream of its own; replay() runs it on
// whatever d holds then and waits.
struct CapturedAttention {
  cuda::Stream stream;
  cuda::Graph graph;
  CapturedAttention(cuda::Attention& attn, DeviceProblem& d, const cuda::DeviceScales& scales)
      : graph(stream, [&] {
          const VarlenShape& sh = attn.shape();
          attn.prepare(d.qkv.data(), 3 * int64_t(sh.heads) * sh.head_dim, d.cos_or_null(), d.sin_or_null(), scales,
                       stream);
          attn.attend(d.out.data(), stream);
        }) {}
  void replay() {
    graph.launch(stream);
    stream.synchronize();
  }
};

// One layer's dynamic-scaling state in device memory, starting from an empty ring.
struct DynamicScales {
  DeviceBuffer<LayerAmax> buf{1};
  DynamicScales() {
    LayerAmax fresh;
    for (auto& t : fresh.t) amax_history_reset(t);
    upload(buf, {fresh});
  }
  cuda::DeviceScales scales() const { return cuda::tensor_dynamic_scales(buf.data()); }
  LayerAmax download() const { return ::download(buf)[0]; }
};

struct Checked {
  ErrorStats gpu, emu, vs_emu;
};

std::unique_ptr<cuda::Attention> make_attention(AttnBackend backend, AttnDtype dtype, int H, int hd) {
  if (backend == AttnBackend::CUDNN) return cuda::make_cudnn_attention(dtype, H, hd);
  return std::make_unique<cuda::FlashAttention>(dtype, H, hd);
}

// Runs a GPU backend's attention (dynamic FP8 scaling from a fresh ring, or BF16) and checks it
// against the CPU.
Checked run_and_check(const Problem& p, AttnDtype dtype, AttnBackend backend = AttnBackend::FOVEA) {
  const int64_t H = p.shape.heads, hd = p.shape.head_dim;
  DeviceProblem d(p);
  const auto attn_ptr = make_attention(backend, dtype, int(H), int(hd));
  cuda::Attention& attn = *attn_ptr;
  attn.plan(p.shape.cu_seqlens);
  DynamicScales amax;
  const cuda::DeviceScales scales = amax.scales();
  FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));  // poison: bf16 NaN
  attn.prepare(d.qkv.data(), 3 * H * hd, d.cos_or_null(), d.sin_or_null(), scales, nullptr);
  attn.attend(d.out.data(), nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = d.output();

  cpu::RefOptions o;
  o.mode = dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
  if (dtype == AttnDtype::FP8) {
    ScaleBook book = ScaleBook::dynamic(1);
    o.fp8_scales = book.record(0, amax_of(p, 0), amax_of(p, 1), amax_of(p, 2));
    const LayerAmax g = amax.download();
    EXPECT_EQ(g.t[0].scale, o.fp8_scales.q);  // the device ring saw the same amax as the host
    EXPECT_EQ(g.t[1].scale, o.fp8_scales.k);
    EXPECT_EQ(g.t[2].scale, o.fp8_scales.v);
  }
  return check_output(p, out, o);
}

float amax_of(const Problem& p, int w) { return amax(p.shape, p.view(w)); }

// docs/fp8.md §Correctness: a fast path's error against fp64 is at most 2x the same-precision CPU emulation's,
// plus a small atol; NaN never passes (compare() makes rel_l2 NaN, and NaN <= x is false).
void expect_within_rule(const Checked& c, const std::string& what) {
  std::printf("%-28s gpu rel %.3e max %.3e | emu rel %.3e max %.3e | gpu-vs-emu rel %.3e\n", what.c_str(), c.gpu.rel_l2,
              c.gpu.max_abs, c.emu.rel_l2, c.emu.max_abs, c.vs_emu.rel_l2);
  EXPECT_EQ(c.gpu.nonfinite, 0) << what;
  EXPECT_LE(c.gpu.rel_l2, 2 * c.emu.rel_l2 + 1e-3) << what;
  EXPECT_LE(c.gpu.max_abs, 2 * c.emu.max_abs + 1e-2) << what;
  // Same scheme as the emulation (scales, P quantization, block order): the two differ by far less
  // than either differs from fp64 (measured: at most 0.12x for FP8, 0.1x for BF16).
  EXPECT_LE(c.vs_emu.rel_l2, 0.25 * c.emu.rel_l2) << what;
}

// The robust scheme's rule: expect_within_rule's, except where pairs are split (fovea/scales.h §split
// pairs). The split takes the emulation's own error down to where the kernel and the emulation no
// longer agree that closely: measured (H200, 2026-12-04, 3 runs) gpu / emu error 0.87-1.39 and
// gpu-vs-emu up to 0.77x the emulation's error (peaked rows, inputs x8), against <= 0.12x without the
// split, the GPU as often better as worse. The emulation sums QK^T in fp32 in order, which the FP8
// tensor cores do not (not modelled). There, the kernel is held to 1.6x the emulation's error (the
// general rule: 2x), and the two to being closer than either is to fp64.
void expect_within_robust_rule(const Checked& c, const cpu::Fp8Fine& used, const std::string& what) {
  const bool split = std::any_of(used.qk_split.begin(), used.qk_split.end(), [](int32_t p) { return p >= 0; });
  if (!split) return expect_within_rule(c, what);
  std::printf("%-28s gpu rel %.3e max %.3e | emu rel %.3e max %.3e | gpu-vs-emu rel %.3e (split pairs)\n", what.c_str(),
              c.gpu.rel_l2, c.gpu.max_abs, c.emu.rel_l2, c.emu.max_abs, c.vs_emu.rel_l2);
  EXPECT_EQ(c.gpu.nonfinite, 0) << what;
  EXPECT_LE(c.gpu.rel_l2, 1.6 * c.emu.rel_l2 + 1e-3) << what;
  EXPECT_LE(c.gpu.max_abs, 2 * c.emu.max_abs + 1e-2) << what;
  // The GPU and the emulation share the quantization; their roundings of P and their summation orders
  // are separate draws, so their distance is a random fraction of the error they share: below 1x in
  // every run but one, which saw 1.07x (H100, 2026-12-06, random seeds). A wrong pair split or scale
  // puts it far above, and the GPU's own error past the bounds above.
  EXPECT_LE(c.vs_emu.rel_l2, 1.5 * c.emu.rel_l2) << what;
}

// A GPU output against fp64 and against the CPU emulation with options o.
Checked check_output(const Problem& p, const std::vector<double>& out, const cpu::RefOptions& o) {
  const auto exact = p.reference({}), emu = p.reference(o);
  const int64_t n = int64_t(exact.size());
  return {compare(out.data(), exact.data(), n), compare(emu.data(), exact.data(), n),
          compare(out.data(), emu.data(), n)};
}

// A GPU FP8 output against fp64 and against the FP8 emulation with the same scales.
Checked check_fp8(const Problem& p, const std::vector<double>& out, const QkvScales& s) {
  cpu::RefOptions o;
  o.mode = cpu::RefMode::FP8;
  o.fp8_scales = s;
  return check_output(p, out, o);
}

const std::vector<int> kRagged = {1, 7, 64, 127, 128, 129, 1000};

// Every head_dim x dtype, named "hd72_fp8".
std::string hd_dtype_name(const ::testing::TestParamInfo<std::tuple<int, AttnDtype>>& info) {
  return "hd" + std::to_string(std::get<0>(info.param)) + "_" + dtype_name(std::get<1>(info.param));
}

}  // namespace

class FlashAttentionGpu : public ::testing::TestWithParam<std::tuple<int, AttnDtype>> {};

TEST_P(FlashAttentionGpu, RaggedBatchMatchesReference) {
  const auto [hd, dtype] = GetParam();
  const Problem p(kRagged, 3, hd, fresh_seed());
  expect_within_rule(run_and_check(p, dtype), fmt_name(hd, dtype, "ragged"));
}

TEST_P(FlashAttentionGpu, LongSegmentsMatchReference) {
  const auto [hd, dtype] = GetParam();
  const Problem p({4096, 16384, 5}, 1, hd, fresh_seed());
  expect_within_rule(run_and_check(p, dtype), fmt_name(hd, dtype, "4096+16384+5"));
}

INSTANTIATE_TEST_SUITE_P(All, FlashAttentionGpu,
                         ::testing::Combine(::testing::ValuesIn(cuda::kFlashHeadDims),
                                            ::testing::Values(AttnDtype::BF16, AttnDtype::FP8)),
                         hd_dtype_name);

// ---- the CUDNN backend (BF16) ---------------------------------------------------------------------

// Its blocking is cuDNN's, not the emulation's, so the rule is on the error against fp64 alone: at
// most 2x the BF16 emulation's (plus the same atol), finite, poisoned output overwritten.
void expect_bf16_rule(const Checked& c, const std::string& what) {
  std::printf("%-28s gpu rel %.3e max %.3e | emu rel %.3e max %.3e | gpu-vs-emu rel %.3e\n", what.c_str(), c.gpu.rel_l2,
              c.gpu.max_abs, c.emu.rel_l2, c.emu.max_abs, c.vs_emu.rel_l2);
  EXPECT_EQ(c.gpu.nonfinite, 0) << what;
  EXPECT_LE(c.gpu.rel_l2, 2 * c.emu.rel_l2 + 1e-3) << what;
  EXPECT_LE(c.gpu.max_abs, 2 * c.emu.max_abs + 1e-2) << what;
}

class CudnnAttentionGpu : public ::testing::TestWithParam<int> {};

// Ragged segments (1 to 1000 tokens) and long ones, every head_dim the FOVEA kernels take.
TEST_P(CudnnAttentionGpu, RaggedAndLongBatchesMatchReference) {
  const int hd = GetParam();
  const Problem ragged(kRagged, 3, hd, fresh_seed()), longer({4096, 16384, 5}, 1, hd, fresh_seed());
  expect_bf16_rule(run_and_check(ragged, AttnDtype::BF16, AttnBackend::CUDNN),
                   fmt_name(hd, AttnDtype::BF16, "cudnn ragged"));
  expect_bf16_rule(run_and_check(longer, AttnDtype::BF16, AttnBackend::CUDNN),
                   fmt_name(hd, AttnDtype::BF16, "cudnn 4096+16384+5"));
}

INSTANTIATE_TEST_SUITE_P(All, CudnnAttentionGpu, ::testing::ValuesIn(cuda::kFlashHeadDims),
                         [](const auto& info) { return "hd" + std::to_string(info.param); });

// One object, several batches: a second batch of the same bucket (the cached plan, new offsets and
// lengths), one of another bucket, and replays of a captured graph on new values.
TEST(CudnnAttentionGpuPlans, BatchesReusePlansAndGraphsReplay) {
  const int H = 2, hd = 72;
  const auto attn = cuda::make_cudnn_attention(AttnDtype::BF16, H, hd);
  std::string fp8;
  try {
    cuda::make_cudnn_attention(AttnDtype::FP8, H, hd);
  } catch (const Error& e) {
    fp8 = e.what();
  }
  EXPECT_NE(fp8.find("runs BF16"), std::string::npos) << fp8;
  // {300, 17, 100} and {400, 17, 260} share a bucket (4 segments of up to 512 tokens).
  for (const std::vector<int>& lens :
       std::vector<std::vector<int>>{{300, 17, 100}, {400, 17, 260}, {2000, 1, 900, 33, 7}}) {
    const Problem p(lens, H, hd, fresh_seed());
    DeviceProblem d(p);
    attn->plan(p.shape.cu_seqlens);
    FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
    attn->prepare(d.qkv.data(), 3 * H * hd, d.cos.data(), d.sin.data(), {}, nullptr);
    attn->attend(d.out.data(), nullptr);
    FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
    cpu::RefOptions o;
    o.mode = cpu::RefMode::BF16;
    expect_bf16_rule(check_output(p, d.output(), o), "cudnn batch of " + std::to_string(lens.size()));
  }
  const std::vector<int> lens = {100, 300, 17};
  Problem p(lens, H, hd, fresh_seed());
  DeviceProblem d(p);
  attn->plan(p.shape.cu_seqlens);
  CapturedAttention graph(*attn, d, {});
  std::mt19937 rng{unsigned(fresh_seed())};
  for (int replay = 0; replay < 4; ++replay) {
    p = Problem(lens, H, hd, rng(), 1.0f + float(replay));
    upload(d.qkv, p.qkv_bf16());
    FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
    graph.replay();
    cpu::RefOptions o;
    o.mode = cpu::RefMode::BF16;
    expect_bf16_rule(check_output(p, d.output(), o), "cudnn graph replay " + std::to_string(replay));
  }
}

// Image-like values: V = a per-channel mean plus small noise (neighbouring patches of a photograph
// are alike), Q and K with a wide logit spread, one long segment (a 4K image is 32640 tokens). The
// unnormalized O then grows with every KV block while each block adds a small share, which exposes
// the precision of the PV accumulation; random N(0,1) values cancel instead and do not.
TEST(FlashAttentionGpuLong, CorrelatedValuesMatchTheEmulation) {
  for (AttnDtype dtype : {AttnDtype::FP8, AttnDtype::BF16}) {
    Problem p({32768}, 1, 72, fresh_seed(), 2.0f);
    const int64_t hd = 72;
    for (int64_t i = 0; i < p.shape.total_tokens(); ++i)
      for (int64_t d = 0; d < hd; ++d) {
        float& v = p.qkv[size_t((i * 3 + 2) * hd + d)];
        v = bf16_round((d % 3 == 0 ? -1.0f : 0.7f) + 0.05f * v);
        p.rot[size_t((i * 3 + 2) * hd + d)] = v;
      }
    const Checked c = run_and_check(p, dtype);
    const std::string what = fmt_name(72, dtype, "32768 correlated V");
    std::printf("%-28s gpu rel %.3e max %.3e | emu rel %.3e max %.3e | gpu-vs-emu rel %.3e\n", what.c_str(),
                c.gpu.rel_l2, c.gpu.max_abs, c.emu.rel_l2, c.emu.max_abs, c.vs_emu.rel_l2);
    // Here both errors are dominated by the bf16 rounding of outputs near +-1 (ties flip either
    // way), so the rule is on the error against fp64: no more than the emulation's, plus 10%.
    EXPECT_EQ(c.gpu.nonfinite, 0) << what;
    EXPECT_LE(c.gpu.rel_l2, 1.1 * c.emu.rel_l2) << what;
    EXPECT_LE(c.gpu.max_abs, 1.1 * c.emu.max_abs + 1e-2) << what;
  }
}

// Static scales: the kernel uses exactly the given scales (one launch, no amax work).
TEST(FlashAttentionGpuStatic, UsesTheGivenScales) {
  const Problem p({300, 77}, 2, 72, fresh_seed());
  const int64_t H = 2, hd = 72;
  DeviceProblem d(p);
  const QkvScales s = {amax_of(p, 0) / 300.0f, amax_of(p, 1) / 448.0f * 1.5f, amax_of(p, 2) / 200.0f};
  DeviceBuffer<float> fixed(3);
  upload(fixed, {s.q, s.k, s.v});
  cuda::FlashAttention attn(AttnDtype::FP8, int(H), int(hd));
  attn.plan(p.shape.cu_seqlens);
  const cuda::DeviceScales scales = cuda::tensor_static_scales(fixed.data());
  FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
  attn.prepare(d.qkv.data(), 3 * H * hd, d.cos.data(), d.sin.data(), scales, nullptr);
  attn.attend(d.out.data(), nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  expect_within_rule(check_fp8(p, d.output(), s), "static hd72");
}

// Dynamic scaling in a CUDA graph: capture prepare + attend once, replay 20 times on changing inputs
// (magnitudes vary so the ring's max moves), and check ring and scales against the CPU scale book
// after every replay, plus the output against the FP8 emulation with the book's scales.
TEST(FlashAttentionGpuGraph, DynamicScalingReplays) {
  const std::vector<int> lens = {100, 300, 17};
  const int H = 2, hd = 72;
  Problem p(lens, H, hd, fresh_seed());
  DeviceProblem d(p);
  DynamicScales amax;
  const cuda::DeviceScales scales = amax.scales();
  cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
  attn.plan(p.shape.cu_seqlens);
  CapturedAttention graph(attn, d, scales);

  ScaleBook book = ScaleBook::dynamic(1);
  std::mt19937 rng{unsigned(fresh_seed())};
  std::uniform_real_distribution<float> mag(0.25f, 8.0f);
  for (int replay = 0; replay < 20; ++replay) {
    p = Problem(lens, H, hd, rng(), mag(rng));
    upload(d.qkv, p.qkv_bf16());
    FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
    graph.replay();
    const QkvScales s = book.record(0, amax_of(p, 0), amax_of(p, 1), amax_of(p, 2));
    const LayerAmax g = amax.download();
    const LayerAmax& want = book.amax_state()[0];
    for (int w = 0; w < 3; ++w) {
      EXPECT_EQ(g.t[w].pos, want.t[w].pos) << "replay " << replay;
      EXPECT_EQ(g.t[w].filled, want.t[w].filled) << "replay " << replay;
      EXPECT_EQ(g.t[w].updates, want.t[w].updates) << "replay " << replay;
      EXPECT_EQ(std::memcmp(g.t[w].ring, want.t[w].ring, sizeof g.t[w].ring), 0)
          << "replay " << replay << " tensor " << w;
      EXPECT_EQ(g.t[w].scale, s[w]) << "replay " << replay << " tensor " << w;
    }
    expect_within_rule(check_fp8(p, d.output(), s), "graph replay " + std::to_string(replay));
  }
}

// ---- segments read on the device: one capture, any layout -----------------------------------------

// One random layout for a capacity: `segments` entries of offsets (some segments empty), the
// tokens after the last offset belonging to none, the buffer's tail either repeats of the last
// offset or zeros (vLLM's two ways of padding a captured cu_seqlens).
struct DeviceLayout {
  std::vector<int32_t> cu;  // [segments + 1], as the device reads it
  std::vector<int> lens;    // the non-empty segments' lengths, in order
  int64_t tokens = 0;
};

DeviceLayout random_layout(std::mt19937_64& rng, int64_t capacity, int segments) {
  DeviceLayout l;
  const int used = int(rng() % uint64_t(segments)) + 1;  // segments holding the offsets; the rest: padding
  // Lengths 1 to the capacity: sometimes one segment takes it all, else a random total cut at random points.
  const int64_t total = rng() % 8 == 0 ? capacity : int64_t(rng() % uint64_t(capacity)) + (rng() % 16 == 0 ? 0 : 1);
  std::vector<int64_t> cuts = {0, total};
  for (int i = 1; i < used; ++i) cuts.push_back(int64_t(rng() % uint64_t(total + 1)));
  std::sort(cuts.begin(), cuts.end());
  for (int64_t c : cuts) l.cu.push_back(int32_t(c));
  for (size_t i = 1; i < l.cu.size(); ++i)
    if (l.cu[i] > l.cu[i - 1]) l.lens.push_back(l.cu[i] - l.cu[i - 1]);
  const bool zeros = rng() % 2 == 0;
  while (int(l.cu.size()) < segments + 1) l.cu.push_back(zeros ? 0 : int32_t(total));
  l.tokens = total;
  return l;
}

// The device buffers of a capacity: qkv and the RoPE tables for every token of it, the tokens past
// a layout's offsets NaN (read by nothing that is stored), the output poisoned.
struct CapacityBuffers {
  int64_t capacity;
  int H, hd;
  DeviceBuffer<int32_t> cu;
  DeviceBuffer<uint16_t> qkv, out;
  DeviceBuffer<float> cos, sin, fixed{3};
  CapacityBuffers(int64_t cap, int segments, int heads, int head_dim)
      : capacity(cap),
        H(heads),
        hd(head_dim),
        cu(size_t(segments) + 1),
        qkv(size_t(cap * 3 * heads * head_dim)),
        out(size_t(cap * heads * head_dim)),
        cos(size_t(cap * head_dim / 2)),
        sin(size_t(cap * head_dim / 2)) {}
  void load(const DeviceLayout& l, const Problem* p, const QkvScales& s) {
    upload(cu, l.cu);
    std::vector<uint16_t> x(qkv.count(), 0x7FC0);  // bf16 NaN
    std::vector<float> c(cos.count(), 0.f), sn(sin.count(), 0.f);
    if (p) {
      const auto b = p->qkv_bf16();
      std::copy(b.begin(), b.end(), x.begin());
      std::copy(p->cos.begin(), p->cos.end(), c.begin());
      std::copy(p->sin.begin(), p->sin.end(), sn.begin());
    }
    upload(qkv, x), upload(cos, c), upload(sin, sn), upload(fixed, {s.q, s.k, s.v});
    FOVEA_CUDA_CHECK(cudaMemset(out.data(), 0xFF, out.bytes()));
  }
  void run(cuda::FlashAttention& attn, cudaStream_t stream) {
    const cuda::DeviceScales scales = cuda::tensor_static_scales(fixed.data());
    attn.schedule(cu.data(), int(cu.count()) - 1, stream);
    attn.prepare(qkv.data(), 3 * int64_t(H) * hd, cos.data(), sin.data(), scales, stream);
    attn.attend(out.data(), stream);
  }
  std::vector<uint16_t> output() const { return download(out); }
};

// The output's first `tokens` rows as doubles; every row after them must still hold the poison.
std::vector<double> attended_rows(const std::vector<uint16_t>& out, int64_t tokens, int64_t row,
                                  int64_t* written_past) {
  std::vector<double> d(size_t(tokens * row));
  for (size_t i = 0; i < d.size(); ++i) d[i] = bf16_to_float(out[i]);
  *written_past = 0;
  for (size_t i = d.size(); i < out.size(); ++i) *written_past += out[i] != 0xFFFF;
  return d;
}

class FlashAttentionGpuDeviceLayout : public ::testing::TestWithParam<std::tuple<int, AttnDtype>> {};

// Planned by capacity, schedule + prepare + attend captured once, then replayed on 200 random
// layouts (1 to 64 segments, empty ones included, lengths up to the capacity, no tokens at all at
// times): each replay equals an eager run of the same three calls bit for bit, writes no row past
// the layout's tokens, and (every 4th, the CPU's share of the time) matches the emulation under the
// usual rule.
TEST_P(FlashAttentionGpuDeviceLayout, OneCaptureReplaysEveryLayout) {
  const auto [hd, dtype] = GetParam();
  const int H = 2, kSegments = 64;
  const int64_t kCapacity = 640;
  cuda::FlashAttention attn(dtype, H, hd);
  attn.plan_capacity(kCapacity, kSegments);
  CapacityBuffers b(kCapacity, kSegments, H, hd);
  std::mt19937_64 rng(fresh_seed());
  b.load(random_layout(rng, kCapacity, kSegments), nullptr, {1.f, 1.f, 1.f});
  cuda::Stream stream;
  cuda::Graph graph(stream, [&] { b.run(attn, stream); });
  for (int step = 0; step < 200; ++step) {
    const DeviceLayout l = random_layout(rng, kCapacity, kSegments);
    const std::string what = fmt_name(hd, dtype, "layout ") + std::to_string(step) + " (" +
                             std::to_string(l.lens.size()) + " segments, " + std::to_string(l.tokens) + " tokens)";
    std::optional<Problem> p;
    if (!l.lens.empty()) p.emplace(l.lens, H, hd, rng());
    const QkvScales s =
        p ? QkvScales{amax_of(*p, 0) / 448.f * 1.5f, amax_of(*p, 1) / 448.f * 1.5f, amax_of(*p, 2) / 448.f * 1.5f}
          : QkvScales{1.f, 1.f, 1.f};
    b.load(l, p ? &*p : nullptr, s);
    graph.launch(stream);
    stream.synchronize();
    const auto replayed = b.output();
    EXPECT_EQ(attn.layout_error(stream), 0) << what;
    FOVEA_CUDA_CHECK(cudaMemset(b.out.data(), 0xFF, b.out.bytes()));
    b.run(attn, stream);
    stream.synchronize();
    ASSERT_TRUE(b.output() == replayed) << what << ": the replay differs from an eager run of the same calls";
    int64_t written_past = 0;
    const auto out = attended_rows(replayed, l.tokens, int64_t(H) * hd, &written_past);
    EXPECT_EQ(written_past, 0) << what << ": rows past the layout's tokens were written";
    if (!p || step % 4 != 0) continue;
    cpu::RefOptions o;
    o.mode = dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    if (dtype == AttnDtype::FP8) o.fp8_scales = s;
    expect_within_rule(check_output(*p, out, o), what);
  }
}

INSTANTIATE_TEST_SUITE_P(All, FlashAttentionGpuDeviceLayout,
                         ::testing::Combine(::testing::ValuesIn(cuda::kFlashHeadDims),
                                            ::testing::Values(AttnDtype::BF16, AttnDtype::FP8)),
                         hd_dtype_name);

// More segments than the schedule step's threads (it walks them in chunks), most of them tiny or
// empty, a few long: against the emulation; and layouts that break the rules attend nothing and
// name their first bad entry.
TEST(FlashAttentionGpuDeviceLayoutRules, ManySegmentsAndBadLayouts) {
  const int H = 2, hd = 72, kSegments = 2600;
  const int64_t kCapacity = 6000;
  cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
  attn.plan_capacity(kCapacity, kSegments, 300);
  CapacityBuffers b(kCapacity, kSegments, H, hd);
  std::mt19937_64 rng(fresh_seed());
  DeviceLayout l;
  l.cu = {0};
  for (int i = 0; i < kSegments; ++i) {
    const int len = i % 1000 == 7 ? 300 + int(rng() % 200) : int(rng() % 4);
    l.cu.push_back(l.cu.back() + len);
    if (len > 0) l.lens.push_back(len);
  }
  l.tokens = l.cu.back();
  ASSERT_LE(l.tokens, kCapacity);
  const Problem p(l.lens, H, hd, rng());
  const QkvScales s = {amax_of(p, 0) / 448.f * 1.5f, amax_of(p, 1) / 448.f * 1.5f, amax_of(p, 2) / 448.f * 1.5f};
  b.load(l, &p, s);
  cuda::Stream stream;
  b.run(attn, stream);
  EXPECT_EQ(attn.layout_error(stream), 0);
  int64_t written_past = 0;
  const auto out = attended_rows(b.output(), l.tokens, int64_t(H) * hd, &written_past);
  EXPECT_EQ(written_past, 0);
  cpu::RefOptions o;
  o.mode = cpu::RefMode::FP8;
  o.fp8_scales = s;
  expect_within_rule(check_output(p, out, o), "2600 segments");

  // Bad layouts: a first entry not 0, a drop to a value other than 0, a value after the zeros, an
  // offset past the capacity, a negative one.
  const auto bad = [&](std::vector<std::pair<int, int32_t>> edits, int first_bad) {
    DeviceLayout x = l;
    for (auto [i, v] : edits) x.cu[size_t(i)] = v;
    b.load(x, &p, s);
    b.run(attn, stream);
    EXPECT_EQ(attn.layout_error(stream), first_bad + 1) << "first bad entry " << first_bad;
    int64_t written = 0;
    attended_rows(b.output(), 0, int64_t(H) * hd, &written);
    EXPECT_EQ(written, 0) << "a bad layout (first bad entry " << first_bad << ") wrote output";
  };
  bad({{0, 5}}, 0);
  bad({{1500, l.cu[1499] - 1}}, 1500);
  bad({{2000, 0}, {2001, 0}, {2002, 7}}, 2002);
  bad({{kSegments, int32_t(kCapacity + 1)}}, kSegments);
  bad({{3, -1}}, 3);
}

// ---- the robust FP8 scheme (K smoothing, per-head Q/K, per-channel V scales) ----------------------

// One layer's robust-scheme arrays in device memory.
struct DeviceFine {
  DeviceBuffer<float> k_mean, q_head, k_head, v_channel;
  DeviceBuffer<int32_t> qk_split;  // none at head_dim 64 / 128
  DeviceFine(int H, int hd)
      : k_mean(size_t(H) * hd),
        q_head(size_t(H)),
        k_head(size_t(H)),
        v_channel(size_t(H) * hd),
        qk_split(size_t(H) * fp8_split_pairs(hd)) {
    for (auto* b : {&k_mean, &q_head, &k_head, &v_channel})  // poison: NaN until written
      FOVEA_CUDA_CHECK(cudaMemset(b->data(), 0xFF, b->bytes()));
    if (qk_split.count()) FOVEA_CUDA_CHECK(cudaMemset(qk_split.data(), 0x7F, qk_split.bytes()));  // no pair index
  }
  cuda::DeviceScales scales(bool current) {
    const cuda::FineArrays a{k_mean.data(), q_head.data(), k_head.data(), v_channel.data(), qk_split.data()};
    return current ? cuda::robust_dynamic_scales(a) : cuda::robust_static_scales(a);
  }
  void set(const cpu::Fp8Fine& f) {
    upload(k_mean, f.k_mean), upload(q_head, f.q_head), upload(k_head, f.k_head), upload(v_channel, f.v_channel);
    ASSERT_EQ(f.qk_split.size(), qk_split.count());
    if (qk_split.count()) upload(qk_split, f.qk_split);
  }
  cpu::Fp8Fine get() const {
    cpu::Fp8Fine f;
    f.k_mean = download(k_mean), f.q_head = download(q_head), f.k_head = download(k_head),
    f.v_channel = download(v_channel);
    if (qk_split.count()) f.qk_split = download(qk_split);
    return f;
  }
};

constexpr cpu::Fp8FineParts kRobust = cpu::kRobustParts;

// The device's current-scaling arrays against cpu::current_fine_scales on the same inputs: the
// maxima bit for bit; K's mean (a double sum in another order, then float) and the K scales built on
// it within one float ulp; the split pairs exactly.
void expect_same_fine(const cpu::Fp8Fine& gpu, const cpu::Fp8Fine& cpu, const std::string& what) {
  ASSERT_EQ(gpu.k_mean.size(), cpu.k_mean.size()) << what;
  EXPECT_EQ(gpu.qk_split, cpu.qk_split) << what << " qk_split";
  for (size_t i = 0; i < cpu.q_head.size(); ++i) {
    EXPECT_EQ(gpu.q_head[i], cpu.q_head[i]) << what << " q_head " << i;
    EXPECT_NEAR(gpu.k_head[i], cpu.k_head[i], 2 * std::nextafter(cpu.k_head[i], INFINITY) - 2 * cpu.k_head[i])
        << what << " k_head " << i;
  }
  for (size_t i = 0; i < cpu.k_mean.size(); ++i) {
    EXPECT_EQ(gpu.v_channel[i], cpu.v_channel[i]) << what << " v_channel " << i;
    EXPECT_NEAR(gpu.k_mean[i], cpu.k_mean[i],
                std::fabs(std::nextafter(cpu.k_mean[i], INFINITY) - cpu.k_mean[i]) + 1e-30)
        << what << " k_mean " << i;
  }
}

// Runs the robust scheme once (current scaling on the device, or the given static arrays) and checks
// the output against fp64 and against the emulation run with the arrays the device used.
Checked run_robust(const Problem& p, const cpu::Fp8Fine* fixed, cpu::Fp8Fine* used = nullptr) {
  const int H = p.shape.heads, hd = p.shape.head_dim;
  DeviceProblem d(p);
  DeviceFine fine(H, hd);
  if (fixed) fine.set(*fixed);
  cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
  attn.plan(p.shape.cu_seqlens);
  FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
  attn.prepare(d.qkv.data(), 3 * int64_t(H) * hd, d.cos_or_null(), d.sin_or_null(), fine.scales(!fixed), nullptr);
  attn.attend(d.out.data(), nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = d.output();
  cpu::RefOptions o;
  o.mode = cpu::RefMode::FP8;
  o.fp8_scales = {1.0f, 1.0f, 1.0f};  // replaced by the fine arrays
  o.fp8_fine = fine.get();
  if (used) *used = o.fp8_fine;
  return check_output(p, out, o);
}

class FlashAttentionGpuRobust : public ::testing::TestWithParam<int> {};

// Outlier channels (Dist::CHANNELS), ragged segments: the device computes the batch's arrays as the
// CPU does and follows the emulation, with RoPE and without. Without it the outlier channels are
// fixed offsets, which K smoothing removes, and robust FP8 beats per-tensor FP8 by far (CPU, 22
// seeds: by 1.9-21x); with RoPE on random channels the offsets rotate with the position, the mean
// no longer holds them, and the gain is small or none: measured 1.2-2x better, and once 5% worse
// (H200, 2026-12-03, hd 64, seed 1392536446: robust 0.759 against per-tensor 0.723, the GPU within
// 1e-2 of its emulation), so with RoPE only "not far worse" (1.25x) is asserted.
TEST_P(FlashAttentionGpuRobust, OutlierChannelsMatchTheEmulation) {
  const int hd = GetParam();
  for (const bool rope : {false, true}) {
    const Problem p(kRagged, 3, hd, fresh_seed(), 1.0f, Dist::CHANNELS, rope);
    const std::string what = fmt_name(hd, AttnDtype::FP8, rope ? "robust channels rope" : "robust channels");
    cpu::Fp8Fine used;
    const Checked robust = run_robust(p, nullptr, &used);
    expect_same_fine(used, cpu::current_fine_scales(p.shape, p.view(0), p.view(1), p.view(2), kRobust), what);
    expect_within_robust_rule(robust, used, what);
    if (fp8_split_pairs(hd) > 0) {  // the split on the device: the emulation without it is far worse
      cpu::RefOptions o;
      o.mode = cpu::RefMode::FP8;
      o.fp8_fine = used;
      o.fp8_fine.qk_split.clear();
      const auto exact = p.reference({}), ns = p.reference(o);
      const double nosplit = compare(ns.data(), exact.data(), int64_t(exact.size())).rel_l2;
      std::printf("%-28s emu rel %.3e\n", (what + " nosplit").c_str(), nosplit);
      if (rope) EXPECT_LT(robust.gpu.rel_l2, 0.5 * nosplit) << what;
    }
    const Checked tensor = run_and_check(p, AttnDtype::FP8);
    std::printf("%-28s gpu rel %.3e (per-tensor scales)\n", (what + " tensor").c_str(), tensor.gpu.rel_l2);
    EXPECT_LT(robust.gpu.rel_l2, (rope ? 1.25 : 1.0 / 1.5) * tensor.gpu.rel_l2) << what;
  }
}

// Well-spread inputs: the robust scheme is no worse than per-tensor scales beyond noise.
TEST_P(FlashAttentionGpuRobust, WellSpreadInputsStayAsGood) {
  const int hd = GetParam();
  const Problem p(kRagged, 3, hd, fresh_seed());
  cpu::Fp8Fine used;
  const Checked robust = run_robust(p, nullptr, &used);
  expect_within_robust_rule(robust, used, fmt_name(hd, AttnDtype::FP8, "robust normal"));
  EXPECT_LE(robust.gpu.rel_l2, 1.1 * run_and_check(p, AttnDtype::FP8).gpu.rel_l2) << "hd" << hd;
}

INSTANTIATE_TEST_SUITE_P(All, FlashAttentionGpuRobust, ::testing::ValuesIn(cuda::kFlashHeadDims),
                         [](const auto& info) { return "hd" + std::to_string(info.param); });

// Static robust arrays (a calibrated file's, with a 1.5x margin and another batch's K mean): the
// kernels use exactly these, on a long segment too.
TEST(FlashAttentionGpuRobustStatic, UsesTheGivenArrays) {
  const uint64_t seed = fresh_seed();  // one seed: the same outlier channels, other tokens
  const Problem calib({500, 300}, 2, 72, seed, 1.0f, Dist::CHANNELS, false);
  cpu::Fp8Fine f = cpu::current_fine_scales(calib.shape, calib.view(0), calib.view(1), calib.view(2), kRobust);
  for (auto* v : {&f.q_head, &f.k_head, &f.v_channel})
    for (float& x : *v) x *= 1.5f;
  const Problem p({4096, 77, 1}, 2, 72, seed, 1.0f, Dist::CHANNELS, false);
  cpu::Fp8Fine used;
  // How well another batch's arrays fit varies with the draw (rel. L2 against fp64 0.21 and 0.61 in
  // two runs), so the check is on following the emulation with exactly these arrays.
  const Checked c = run_robust(p, &f, &used);
  expect_within_robust_rule(c, used, "robust static hd72");
  EXPECT_EQ(used.k_mean, f.k_mean);
  EXPECT_EQ(used.v_channel, f.v_channel);
  EXPECT_EQ(used.qk_split, f.qk_split);
  EXPECT_EQ(f.qk_split.size(), 2u * fp8_split_pairs(72));
}

// Current scaling replayed from a CUDA graph: stats, prepare and attend captured once, replayed on
// changing inputs; the arrays and the output follow each replay's batch.
TEST(FlashAttentionGpuRobustGraph, CurrentScalingReplays) {
  const std::vector<int> lens = {100, 300, 17};
  const int H = 2, hd = 80;
  Problem p(lens, H, hd, fresh_seed(), 1.0f, Dist::CHANNELS);
  DeviceProblem d(p);
  DeviceFine fine(H, hd);
  const cuda::DeviceScales scales = fine.scales(true);
  cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
  attn.plan(p.shape.cu_seqlens);
  CapturedAttention graph(attn, d, scales);
  std::mt19937 rng{unsigned(fresh_seed())};
  std::uniform_real_distribution<float> mag(0.25f, 8.0f);
  for (int replay = 0; replay < 8; ++replay) {
    p = Problem(lens, H, hd, rng(), mag(rng), Dist::CHANNELS);  // new channels and magnitude: every array moves
    upload(d.qkv, p.qkv_bf16());
    FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
    graph.replay();
    const std::string what = "robust replay " + std::to_string(replay);
    const cpu::Fp8Fine used = fine.get();
    expect_same_fine(used, cpu::current_fine_scales(p.shape, p.view(0), p.view(1), p.view(2), kRobust), what);
    cpu::RefOptions o;
    o.mode = cpu::RefMode::FP8;
    o.fp8_scales = {1.0f, 1.0f, 1.0f};
    o.fp8_fine = used;
    expect_within_robust_rule(check_output(p, d.output(), o), used, what);
  }
}

// The robust scheme's history in a CUDA graph, every head_dim: 20 replays on changing inputs (the
// ring wraps), one of them with a NaN in V; after each the arrays the device used against
// ScaleBook::record_fine of the CPU's statistics of the same inputs, and at the end the whole device
// history against the book's, and the output against the emulation with the arrays used.
TEST(FlashAttentionGpuRobustGraph, HistoryReplaysAsTheHostBook) {
  const std::vector<int> lens = {100, 300, 17};
  for (const int hd : cuda::kFlashHeadDims) {
    const int H = 3;
    Problem p(lens, H, hd, fresh_seed(), 1.0f, Dist::CHANNELS);
    DeviceProblem d(p);
    DeviceFine fine(H, hd);
    ScaleBook book = ScaleBook::dynamic(1);
    book.enable_fine(H, hd);
    cuda::DeviceFineHistory history(book.fine_state()[0]);
    cuda::DeviceScales scales = fine.scales(true);
    scales.ring = history.ring();
    cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
    attn.plan(p.shape.cu_seqlens);
    CapturedAttention graph(attn, d, scales);
    std::mt19937 rng{unsigned(fresh_seed())};
    std::uniform_real_distribution<float> mag(0.25f, 8.0f);
    for (int replay = 0; replay < 20; ++replay) {
      p = Problem(lens, H, hd, rng(), mag(rng), Dist::CHANNELS);
      if (replay == 9)
        p.qkv[size_t(5 * 3 * H * hd + 2 * H * hd + 1)] = p.rot[size_t(5 * 3 * H * hd + 2 * H * hd + 1)] = NAN;
      upload(d.qkv, p.qkv_bf16());
      FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
      graph.replay();
      const std::string what = fmt_name(hd, AttnDtype::FP8, "robust history replay ") + std::to_string(replay);
      const FineScales want = book.record_fine(0, cpu::fine_batch(p.shape, p.view(0), p.view(1), p.view(2)));
      const cpu::Fp8Fine used = fine.get();
      cpu::Fp8Fine w;
      w.k_mean = want.k_mean, w.q_head = want.q_head, w.k_head = want.k_head, w.v_channel = want.v_channel;
      w.qk_split = want.qk_split;
      expect_same_fine(used, w, what);
      if (replay == 19) {
        cpu::RefOptions o;
        o.mode = cpu::RefMode::FP8;
        o.fp8_fine = used;
        expect_within_robust_rule(check_output(p, d.output(), o), used, what);
      }
    }
    FineHistory got(H, hd);
    history.download(got);
    const FineHistory& host = book.fine_state()[0];
    EXPECT_EQ(got.counts.pos, host.counts.pos);
    EXPECT_EQ(got.counts.filled, 16);
    EXPECT_EQ(got.counts.updates, 20u);
    EXPECT_EQ(got.counts.nonfinite, 1u) << "the NaN replay";
    EXPECT_EQ(got.counts.tokens, host.counts.tokens);
    EXPECT_EQ(got.q_ring, host.q_ring);
    EXPECT_EQ(got.v_ring, host.v_ring);
    EXPECT_EQ(got.k_hi, host.k_hi);
    EXPECT_EQ(got.k_lo, host.k_lo);
    EXPECT_EQ(got.q_hi, host.q_hi);
    for (size_t i = 0; i < host.k_sum.size(); ++i)
      EXPECT_NEAR(got.k_sum[i], host.k_sum[i], 1e-9 * (1 + std::fabs(host.k_sum[i])));
    for (size_t i = 0; i < host.k_ring.size(); ++i)
      EXPECT_NEAR(got.k_ring[i], host.k_ring[i], 4 * (std::nextafter(host.k_ring[i], INFINITY) - host.k_ring[i]))
          << "k ring " << i;
  }
}

// ---- the static guard (docs/fp8.md §Static guard) ---------------------------------------------------

namespace {

// n floats of device memory.
std::vector<float> download_floats(const float* p, size_t n) {
  std::vector<float> h(n);
  FOVEA_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

// The per-tensor scales a guarded attention quantized with.
QkvScales tensor_in_use(const cuda::FlashAttention& attn) {
  const auto p = attn.scales_in_use();
  return {download_floats(p[0], 1)[0], download_floats(p[1], 1)[0], download_floats(p[2], 1)[0]};
}

// The robust arrays a guarded attention quantized with: its scales, the file's K mean and split pairs.
FineScales fine_in_use(const cuda::FlashAttention& attn, const FineScales& file) {
  const auto p = attn.scales_in_use();
  FineScales f = file;
  f.q_head = download_floats(p[0], file.q_head.size());
  f.k_head = download_floats(p[1], file.k_head.size());
  f.v_channel = download_floats(p[2], file.v_channel.size());
  return f;
}

GuardCounts device_counts(const DeviceBuffer<GuardCounts>& c) { return download(c)[0]; }

// A robust scale file that p's batch passes in some heads and channels and not in others: K's mean
// and the split pairs of another draw (`calib`); each head's Q and K scale and each V channel's at
// 0.5x (passed) or 1.5x (kept) of what p's batch needs, K's about that mean, alternating.
FineScales mixed_file(const Problem& p, const Problem& calib) {
  const int H = p.shape.heads, hd = p.shape.head_dim;
  const cpu::Fp8Fine c = cpu::current_fine_scales(calib.shape, calib.view(0), calib.view(1), calib.view(2), kRobust);
  const FineBatch b = cpu::fine_batch(p.shape, p.view(0), p.view(1), p.view(2));
  FineScales f;
  f.k_mean = c.k_mean, f.qk_split = c.qk_split;
  for (int h = 0; h < H; ++h) {
    float q = 0.0f, k = 0.0f;
    for (int d = 0; d < hd; ++d) {
      const size_t i = size_t(h * hd + d);
      q = std::max(q, b.q_amax[i]);
      k = std::max(k, smoothed_amax(b.k_hi[i], b.k_lo[i], f.k_mean[i]));
    }
    f.q_head.push_back(q / 448.0f * (h % 2 ? 1.5f : 0.5f));
    f.k_head.push_back(k / 448.0f * (h % 2 ? 0.5f : 1.5f));
  }
  for (size_t i = 0; i < b.v_amax.size(); ++i) f.v_channel.push_back(b.v_amax[i] / 448.0f * (i % 3 ? 1.5f : 0.5f));
  return f;
}

cpu::RefOptions fp8_fine_options(const FineScales& f) {
  cpu::RefOptions o;
  o.mode = cpu::RefMode::FP8;
  o.fp8_scales = {1.0f, 1.0f, 1.0f};  // replaced by the fine arrays
  o.fp8_fine = cpu::robust_fine(f);
  return o;
}

}  // namespace

// Per tensor: a file whose q and v scales this batch passes and whose k scale it does not. The scales
// the attention quantizes with are ScaleBook::record's on the CPU's amax of the same inputs, bit for
// bit; the counts (running totals) move as the book's; the file's buffer is not written; the output
// follows the emulation with those scales. The same file without counters is used as given.
TEST(FlashAttentionGpuStaticGuard, PerTensorAsTheBook) {
  const int H = 2, hd = 72;
  const Problem p(kRagged, H, hd, fresh_seed());
  const QkvScales file = {amax_of(p, 0) / 448.0f * 0.5f, amax_of(p, 1) / 448.0f * 1.5f, amax_of(p, 2) / 448.0f * 0.1f};
  DeviceBuffer<float> fixed(3);
  upload(fixed, {file.q, file.k, file.v});
  DeviceBuffer<GuardCounts> counts(1);
  upload(counts, {GuardCounts{3, 4, 5}});
  DeviceProblem d(p);
  cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
  attn.plan(p.shape.cu_seqlens);
  auto run = [&](const cuda::DeviceScales& scales) {
    FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
    attn.prepare(d.qkv.data(), 3 * int64_t(H) * hd, d.cos.data(), d.sin.data(), scales, nullptr);
    attn.attend(d.out.data(), nullptr);
    FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  };
  run(cuda::tensor_static_scales(fixed.data(), counts.data()));
  ScaleBook book = ScaleBook::fixed({file});
  const QkvScales want = book.record(0, amax_of(p, 0), amax_of(p, 1), amax_of(p, 2));
  ASSERT_NE(want.q, file.q);  // the case is what it says: q and v switched, k not
  ASSERT_EQ(want.k, file.k);
  ASSERT_NE(want.v, file.v);
  EXPECT_EQ(tensor_in_use(attn), want);
  EXPECT_EQ(download(fixed), (std::vector<float>{file.q, file.k, file.v})) << "the file's scales are not written";
  EXPECT_EQ(book.guarded(0), (GuardCounts{1, 0, 1}));
  EXPECT_EQ(device_counts(counts), (GuardCounts{4, 4, 6}));
  const Checked guarded = check_fp8(p, d.output(), want);
  expect_within_rule(guarded, "guarded static hd72");

  run(cuda::tensor_static_scales(fixed.data()));  // no counters: as given, nothing counted
  EXPECT_EQ(tensor_in_use(attn), file);
  EXPECT_EQ(device_counts(counts), (GuardCounts{4, 4, 6}));
  const Checked clipped = check_fp8(p, d.output(), file);
  expect_within_rule(clipped, "unguarded static hd72");
  EXPECT_GT(clipped.gpu.rel_l2, 2 * guarded.gpu.rel_l2) << "q at 2x and v at 10x the file's range clip";
}

// Robust, every head_dim: a file the batch passes in some heads and channels and not in others
// (mixed_file). The arrays the attention quantizes with are ScaleBook::guard_fine's on the CPU's
// statistics of the same inputs, bit for bit (K's mean and split pairs the file's), the counts move
// as the book's, the file's arrays are not written, and the output follows the emulation with the
// arrays used. A batch with a NaN keeps the file's arrays, uncounted.
TEST(FlashAttentionGpuStaticGuard, RobustAsTheBook) {
  for (const int hd : cuda::kFlashHeadDims) {
    const int H = 3;
    const uint64_t seed = fresh_seed();
    const Problem calib({500, 300}, H, hd, seed, 1.0f, Dist::CHANNELS);
    Problem p(kRagged, H, hd, seed + 1, 1.0f, Dist::CHANNELS);
    const FineScales file = mixed_file(p, calib);
    DeviceFine fine(H, hd);
    fine.set(cpu::robust_fine(file));
    DeviceBuffer<GuardCounts> counts(1);
    upload(counts, {GuardCounts{3, 4, 5}});
    cuda::DeviceScales scales = fine.scales(false);
    scales.guard = counts.data();
    DeviceProblem d(p);
    cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
    attn.plan(p.shape.cu_seqlens);
    auto run = [&] {
      FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
      attn.prepare(d.qkv.data(), 3 * int64_t(H) * hd, d.cos.data(), d.sin.data(), scales, nullptr);
      attn.attend(d.out.data(), nullptr);
      FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
    };
    run();
    const std::string what = fmt_name(hd, AttnDtype::FP8, "robust guarded");
    ScaleBook book = ScaleBook::fixed({QkvScales{}});
    const FineScales want = book.guard_fine(0, file, cpu::fine_batch(p.shape, p.view(0), p.view(1), p.view(2)));
    // The case is what it says: each tensor raised somewhere and kept somewhere.
    ASSERT_NE(want.q_head[0], file.q_head[0]) << what;
    ASSERT_EQ(want.q_head[1], file.q_head[1]) << what;
    ASSERT_EQ(want.k_head[0], file.k_head[0]) << what;
    ASSERT_NE(want.k_head[1], file.k_head[1]) << what;
    ASSERT_NE(want.v_channel[0], file.v_channel[0]) << what;
    ASSERT_EQ(want.v_channel[1], file.v_channel[1]) << what;
    const FineScales used = fine_in_use(attn, file);
    EXPECT_EQ(used.q_head, want.q_head) << what;
    EXPECT_EQ(used.k_head, want.k_head) << what;
    EXPECT_EQ(used.v_channel, want.v_channel) << what;
    const cpu::Fp8Fine stored = fine.get();
    EXPECT_EQ(stored.q_head, file.q_head) << what << ": the file's arrays are not written";
    EXPECT_EQ(stored.k_head, file.k_head) << what;
    EXPECT_EQ(stored.v_channel, file.v_channel) << what;
    EXPECT_EQ(book.guarded(0), (GuardCounts{1, 1, 1})) << what;
    EXPECT_EQ(device_counts(counts), (GuardCounts{4, 5, 6})) << what;
    expect_within_robust_rule(check_output(p, d.output(), fp8_fine_options(used)), cpu::robust_fine(used), what);

    const size_t at = size_t(5 * 3 * H * hd + 2 * H * hd + 1);  // a NaN in V: the file's arrays, uncounted
    p.qkv[at] = p.rot[at] = NAN;
    upload(d.qkv, p.qkv_bf16());
    run();
    EXPECT_EQ(book.guard_fine(0, file, cpu::fine_batch(p.shape, p.view(0), p.view(1), p.view(2))), file) << what;
    EXPECT_EQ(fine_in_use(attn, file), file) << what << " NaN";
    EXPECT_EQ(device_counts(counts), (GuardCounts{4, 5, 6})) << what << " NaN";
  }
}

// The guard in a CUDA graph, per tensor and robust: prepare (the guard's pass included) and attend
// captured once, replayed on the calibration batch itself (within the file: x 1.5) and on other
// draws and magnitudes (most pass it). After every replay the scales in use and the counts are the
// book's, and the output follows the emulation with those scales.
TEST(FlashAttentionGpuStaticGuardGraph, ReplaysAndCounts) {
  const std::vector<int> lens = {100, 300, 17};
  const int H = 3, hd = 72;
  for (const bool robust : {false, true}) {
    const Problem calib(lens, H, hd, fresh_seed(), 1.0f, Dist::CHANNELS);
    const cpu::Fp8Fine c = cpu::current_fine_scales(calib.shape, calib.view(0), calib.view(1), calib.view(2), kRobust);
    FineScales file;
    file.k_mean = c.k_mean, file.qk_split = c.qk_split;
    for (float x : c.q_head) file.q_head.push_back(x * 1.5f);
    for (float x : c.k_head) file.k_head.push_back(x * 1.5f);
    for (float x : c.v_channel) file.v_channel.push_back(x * 1.5f);
    const QkvScales tensor = {amax_of(calib, 0) / 448.0f * 1.5f, amax_of(calib, 1) / 448.0f * 1.5f,
                              amax_of(calib, 2) / 448.0f * 1.5f};
    DeviceBuffer<float> fixed(3);
    upload(fixed, {tensor.q, tensor.k, tensor.v});
    DeviceFine fine(H, hd);
    fine.set(cpu::robust_fine(file));
    DeviceBuffer<GuardCounts> counts(1);
    upload(counts, {GuardCounts{}});
    cuda::DeviceScales scales = robust ? fine.scales(false) : cuda::tensor_static_scales(fixed.data());
    scales.guard = counts.data();
    Problem p = calib;
    DeviceProblem d(p);
    cuda::FlashAttention attn(AttnDtype::FP8, H, hd);
    attn.plan(p.shape.cu_seqlens);
    CapturedAttention graph(attn, d, scales);
    EXPECT_EQ(device_counts(counts), GuardCounts{}) << "a capture runs nothing";
    ScaleBook book = ScaleBook::fixed({tensor});
    std::mt19937 rng{unsigned(fresh_seed())};
    std::uniform_real_distribution<float> mag(0.25f, 8.0f);
    for (int replay = 0; replay < 9; ++replay) {
      const bool own = replay % 3 == 0;
      p = own ? calib : Problem(lens, H, hd, rng(), mag(rng), Dist::CHANNELS);
      upload(d.qkv, p.qkv_bf16());
      FOVEA_CUDA_CHECK(cudaMemset(d.out.data(), 0xFF, d.out.bytes()));
      graph.replay();
      const std::string what = std::string(robust ? "robust" : "tensor") + " guarded replay " + std::to_string(replay);
      const GuardCounts before = book.guarded(0);
      if (robust) {
        const FineScales want = book.guard_fine(0, file, cpu::fine_batch(p.shape, p.view(0), p.view(1), p.view(2)));
        const FineScales used = fine_in_use(attn, file);
        EXPECT_EQ(used, want) << what;
        if (own) {
          EXPECT_EQ(want, file) << what << ": the calibration batch fits its file";
        }
        expect_within_robust_rule(check_output(p, d.output(), fp8_fine_options(used)), cpu::robust_fine(used), what);
      } else {
        const QkvScales want = book.record(0, amax_of(p, 0), amax_of(p, 1), amax_of(p, 2));
        EXPECT_EQ(tensor_in_use(attn), want) << what;
        if (own) {
          EXPECT_EQ(want, tensor) << what << ": the calibration batch fits its file";
        }
        expect_within_rule(check_fp8(p, d.output(), want), what);
      }
      if (own) {
        EXPECT_EQ(book.guarded(0), before) << what;
      }
      EXPECT_EQ(device_counts(counts), book.guarded(0)) << what;
    }
    EXPECT_GT(book.guarded(0).total(), 0u) << (robust ? "robust" : "tensor") << ": some replay passed the file";
  }
}

// A small case for compute-sanitizer (scripts/gpu-tests.sh runs it under memcheck).
TEST(FlashAttentionGpuSmall, SanitizerCase) {
  const Problem p({1, 130, 64}, 2, 72, fresh_seed());
  expect_within_rule(run_and_check(p, AttnDtype::FP8), "small fp8");
  expect_within_rule(run_and_check(p, AttnDtype::BF16), "small bf16");
  const Problem r({1, 130, 64}, 2, 64, fresh_seed(), 1.0f, Dist::CHANNELS);  // robust: hd 64's wide rows
  cpu::Fp8Fine used;
  const Checked c = run_robust(r, nullptr, &used);
  expect_within_robust_rule(c, used, "small robust hd64");
}

// fovea/cuda-support.h: a pinned -> device -> pinned round trip on a stream through a moved buffer,
// a failed allocation that leaves the buffer empty, and the check macro on CUDA and cuBLAS statuses.
TEST(CudaSupport, BuffersAndChecks) {
  cuda::PinnedBuffer<int> host(1000), back(1000);
  for (size_t i = 0; i < host.count(); ++i) host.data()[i] = int(i * 7);
  DeviceBuffer<int> dev(host.count());
  cuda::Stream s;
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(dev.data(), host.data(), host.bytes(), cudaMemcpyHostToDevice, s));
  DeviceBuffer<int> moved = std::move(dev);
  EXPECT_TRUE(dev.empty());
  EXPECT_EQ(dev.data(), nullptr);
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(back.data(), moved.data(), moved.bytes(), cudaMemcpyDeviceToHost, s));
  s.synchronize();
  EXPECT_EQ(std::memcmp(host.data(), back.data(), host.bytes()), 0);

  EXPECT_THROW(moved.reset(size_t(1) << 60), Error);
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(moved.data(), nullptr);
  cudaGetLastError();  // the failed cudaMalloc is the last error: clear it for the tests that follow
  EXPECT_THROW(FOVEA_CUDA_CHECK(cudaErrorInvalidValue), Error);
  EXPECT_THROW(FOVEA_CUDA_CHECK(CUBLAS_STATUS_NOT_INITIALIZED), Error);
}
