// GPU: the encoder forward (bf16 activations, cuBLASLt, FOVEA attention) against the fp32 CPU
// reference forward, on the 8B architecture's shapes (hd 72) cut to two blocks with both taps, BF16
// and FP8; CUDA-graph replay equals the eager forward. Label `gpu`.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <unistd.h>

#include "fovea/bf16.h"
#include "fovea/cuda-support.h"
#include "fovea/encoder.h"
#include "fovea/engine.h"
#include "fovea/image.h"
#include "fovea/pipeline.h"
#include "fovea/random.h"
#include "fovea/scales.h"
#include "test-util.h"

using namespace fovea;
using namespace fovea::qwen3vl;
using namespace fovea::test;

namespace {

const std::vector<GridThw> kGrids = {{1, 16, 16}, {1, 12, 20}, {2, 4, 6}};

std::vector<float> random_pixels(int64_t n) {
  std::vector<float> p = random_values(n * 1536, Dist::NORMAL, fresh_seed());
  for (auto& x : p) x = std::tanh(x);  // pixels live in [-1, 1]
  return p;
}

int64_t patches(const std::vector<GridThw>& grids) {
  int64_t n = 0;
  for (const auto& g : grids) n += int64_t(g[0]) * g[1] * g[2];
  return n;
}

std::vector<float> widen(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_float(bits[i]);
  return v;
}

// One forward of `m` on the GPU over kGrids, synchronized: each deepstack output (with_deepstack),
// then the merged one last.
std::vector<std::vector<float>> encode_once(const qwen3vl::Model& m, const qwen3vl::cuda::EncoderOptions& o,
                                            const std::vector<float>& px, bool with_deepstack = false) {
  qwen3vl::cuda::Encoder enc(m, o);
  enc.plan(kGrids);
  enc.upload_pixels(px, nullptr);
  enc.forward(nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::vector<float>> out = with_deepstack ? enc.deepstack(nullptr) : std::vector<std::vector<float>>{};
  out.push_back(enc.merged(nullptr));
  return out;
}

}  // namespace

TEST(EncoderGpu, Bf16AndFp8MatchTheCpuReference) {
  const Model m = two_block_8b();
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  const std::vector<float> px = random_pixels(n);
  const ForwardResult ref = forward_cpu(m, px, kGrids);
  const int O = m.config.out_hidden;
  const TempDir dir;

  for (AttnDtype dt : {AttnDtype::BF16, AttnDtype::FP8}) {
    ScaleBook book = ScaleBook::calibrating(m.config.depth, dir.file("scales.json"), 1.5f);
    qwen3vl::cuda::EncoderOptions o;
    o.dtype = dt;
    o.scales = dt == AttnDtype::FP8 ? &book : nullptr;
    qwen3vl::cuda::Encoder enc(m, o);
    enc.plan(kGrids);
    enc.upload_pixels(px, nullptr);
    enc.forward(nullptr);
    if (o.scales) {  // the calibration step EncoderRunner takes after each forward
      enc.sync_scales(nullptr);
      book.after_forward();
    }
    FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
    const auto merged = enc.merged(nullptr);
    const auto ds = enc.deepstack(nullptr);
    ASSERT_EQ(ds.size(), ref.deepstack.size());
    const auto s = embedding_error(merged, ref.merged, O);
    std::printf("%s merged: rel_l2 %.3e, mean cosine %.6f\n", dtype_name(dt), s.rel_l2, s.mean_cosine);
    const double tol = dt == AttnDtype::BF16 ? 3e-2 : 8e-2;
    EXPECT_LT(s.rel_l2, tol);
    EXPECT_GT(s.mean_cosine, dt == AttnDtype::BF16 ? 0.999 : 0.996);
    for (size_t k = 0; k < ds.size(); ++k) {
      const auto d = embedding_error(ds[k], ref.deepstack[k], O);
      std::printf("%s deepstack %zu: rel_l2 %.3e, mean cosine %.6f\n", dtype_name(dt), k, d.rel_l2, d.mean_cosine);
      EXPECT_LT(d.rel_l2, tol);
    }
    if (dt == AttnDtype::FP8) {
      EXPECT_EQ(book.complete_forwards(), 1u);  // every layer's device ring recorded this forward
      for (int l = 0; l < m.config.depth; ++l) EXPECT_GT(book.scales(l).q, kMinScale);
    }
  }
}

TEST(EncoderGpu, GraphReplayEqualsEagerForward) {
  const Model m = two_block_8b();
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  const std::vector<float> px = random_pixels(n);
  for (AttnDtype dt : {AttnDtype::BF16, AttnDtype::FP8}) {
    // Static scales, so eager and replay quantize identically (dynamic rings would move).
    ScaleBook book = ScaleBook::fixed(std::vector<QkvScales>(size_t(m.config.depth), QkvScales{0.02f, 0.02f, 0.01f}));
    qwen3vl::cuda::EncoderOptions o;
    o.dtype = dt;
    o.scales = dt == AttnDtype::FP8 ? &book : nullptr;
    qwen3vl::cuda::Encoder enc(m, o);
    enc.plan(kGrids);
    fovea::cuda::Stream s;
    enc.upload_pixels(px, s);
    enc.forward(s);
    const auto eager = enc.merged(s);
    fovea::cuda::Graph graph(s, [&] { enc.forward(s); });
    for (int r = 0; r < 3; ++r) graph.launch(s);
    s.synchronize();
    EXPECT_EQ(enc.merged(s), eager) << dtype_name(dt);
  }
}

// The arena: buffers are slices of one allocation reused across batch shapes. A batch encoded after
// a larger one and a smaller one (so its slices start elsewhere and hold stale data) gives exactly
// what it gave first, outputs and deepstack alike; so does an encoder that reserved room up front.
TEST(EncoderGpu, ArenaReuseAcrossShapesChangesNothing) {
  const Model m = two_block_8b();
  const std::vector<GridThw> big = {{1, 40, 40}, {1, 24, 32}}, small = {{1, 4, 6}};
  const std::vector<float> px = random_pixels(patches(kGrids)), px_big = random_pixels(patches(big)),
                           px_small = random_pixels(patches(small));
  ScaleBook book = ScaleBook::fixed(std::vector<QkvScales>(size_t(m.config.depth), QkvScales{0.02f, 0.02f, 0.01f}));
  qwen3vl::cuda::EncoderOptions o{AttnDtype::FP8, &book};
  auto run = [&](qwen3vl::cuda::Encoder& enc, const std::vector<GridThw>& gs, const std::vector<float>& p) {
    enc.plan(gs);
    enc.upload_pixels(p, nullptr);
    enc.forward(nullptr);
    std::vector<std::vector<float>> out = enc.deepstack(nullptr);
    out.push_back(enc.merged(nullptr));
    return out;
  };
  qwen3vl::cuda::Encoder enc(m, o);
  const auto first = run(enc, kGrids, px);
  run(enc, big, px_big);
  run(enc, small, px_small);
  EXPECT_EQ(run(enc, kGrids, px), first);
  qwen3vl::cuda::Encoder reserved(m, o);
  reserved.reserve(patches(big) * 2);
  run(reserved, small, px_small);
  EXPECT_EQ(run(reserved, kGrids, px), first);
  for (const auto& v : first)
    for (float x : v) ASSERT_TRUE(std::isfinite(x));
}

// plan() computes the position-embedding and RoPE tables on the GPU; they are the CPU reference's
// bits exactly (position_embedding() rounded to bf16, vision_rope_tables()), for odd window counts,
// several frames, grids beyond the 48x48 learned table and planned in an order that grows the RoPE
// frequency table twice.
TEST(EncoderGpu, GridTablesAreBitIdenticalToTheCpu) {
  const Model m = two_block_8b();
  const std::vector<std::vector<GridThw>> sets = {
      {{1, 2, 2}},
      {{1, 6, 10}, {2, 14, 22}, {1, 2, 50}},
      {{1, 98, 60}, {3, 8, 8}, {1, 4, 130}, {2, 46, 34}},
      {{1, 300, 2}, {1, 50, 48}},
  };
  qwen3vl::cuda::Encoder enc(m, {AttnDtype::BF16, nullptr});
  for (const auto& grids : sets) {
    enc.plan(grids);
    std::vector<uint16_t> pe;
    std::vector<float> cos, sin;
    enc.grid_tables(pe, cos, sin);
    const std::vector<float> pe_ref = position_embedding(m.config, m.weights.pos, grids);
    std::vector<float> cos_ref, sin_ref;
    vision_rope_tables(grids, m.config.head_dim(), cos_ref, sin_ref);
    ASSERT_EQ(pe.size(), pe_ref.size());
    size_t pe_diff = 0;
    for (size_t i = 0; i < pe.size(); ++i) pe_diff += pe[i] != bf16_from_float(pe_ref[i]);
    EXPECT_EQ(pe_diff, 0u) << pe.size() << " values, grids starting " << grids[0][1] << "x" << grids[0][2];
    ASSERT_EQ(cos.size(), cos_ref.size());
    EXPECT_EQ(std::memcmp(cos.data(), cos_ref.data(), cos.size() * 4), 0);
    EXPECT_EQ(std::memcmp(sin.data(), sin_ref.data(), sin.size() * 4), 0);
  }
}

// Two batches in flight at once (plan, stage, forward and download of the next enqueued before the
// last one is collected) give exactly what each gives alone, through three shapes, with staging
// reserved for the first and grown by the second; collect_views gives the same bits without a copy.
TEST(EncoderGpu, PipelinedBatchesEqualOneAtATime) {
  const Model m = two_block_8b();
  const std::vector<std::vector<GridThw>> sets = {kGrids, {{1, 24, 32}}, {{2, 4, 6}, {1, 10, 10}}};
  std::vector<std::vector<float>> px;
  for (const auto& gs : sets) px.push_back(random_pixels(patches(gs)));
  ScaleBook book = ScaleBook::fixed(std::vector<QkvScales>(size_t(m.config.depth), QkvScales{0.02f, 0.02f, 0.01f}));
  for (AttnDtype dt : {AttnDtype::BF16, AttnDtype::FP8}) {
    qwen3vl::cuda::EncoderOptions o{dt, dt == AttnDtype::FP8 ? &book : nullptr};
    std::vector<std::vector<std::vector<uint16_t>>> alone(sets.size()), piped(sets.size());
    for (size_t k = 0; k < sets.size(); ++k) {
      qwen3vl::cuda::Encoder fresh(m, o);
      fresh.plan(sets[k]);
      fresh.upload_pixels(px[k], nullptr);
      fresh.forward(nullptr);
      fresh.outputs_bf16(true, alone[k], nullptr);
    }
    qwen3vl::cuda::Encoder enc(m, o);
    enc.reserve(patches(sets[0]), true, 2);  // staging for the first set; the larger second one grows it
    std::vector<int64_t> tickets;
    auto launch = [&](size_t k) {
      enc.plan(sets[k]);
      enc.upload_pixels(px[k], nullptr);
      enc.forward(nullptr);
      tickets.push_back(enc.download(true, nullptr));
    };
    launch(0);
    launch(1);
    enc.collect(tickets[0], piped[0]);
    launch(2);
    EXPECT_THROW(enc.download(true, nullptr), Error);  // a third uncollected download is refused
    const std::vector<std::span<const uint16_t>> views = enc.collect_views(tickets[1]);  // no copy
    for (const auto& v : views) piped[1].emplace_back(v.begin(), v.end());
    enc.collect(tickets[2], piped[2]);
    EXPECT_THROW(enc.collect_views(tickets[1]), Error);  // collected already
    for (size_t k = 0; k < sets.size(); ++k) {
      ASSERT_EQ(piped[k].size(), 1 + m.config.deepstack.size());
      EXPECT_EQ(piped[k], alone[k]) << dtype_name(dt) << " batch " << k;
    }
    for (size_t j = 0; j < views.size(); ++j)  // still valid: only the download after next reuses them
      EXPECT_TRUE(std::equal(views[j].begin(), views[j].end(), alone[1][j].begin(), alone[1][j].end())) << j;
  }
}

// Encoder CUDA graphs per token budget: batches of mixed shapes replay the graph of the smallest
// budget that holds them (the rows past the batch zero-filled, the segments read on the device), and
// give what an eager encoder gives, BF16 and the FP8 schemes (dynamic ones: the scale state moves as
// the eager encoder's; capture records no forward); batches that fit no budget run eagerly, counted.
TEST(EncoderGpu, BudgetGraphsEqualEagerOverMixedBatches) {
  const Model m = two_block_8b();
  const std::vector<std::vector<GridThw>> sets = {
      kGrids,                                      // 136 merged tokens, 4 segments: budget 256
      {{1, 40, 40}, {1, 24, 32}},                  // 592: budget 1024
      {{1, 4, 6}},                                 // 6: budget 256, mostly padding
      {{1, 80, 80}},                               // 1600: larger than every budget, eager
      std::vector<GridThw>(10, GridThw{1, 2, 2}),  // 10 segments > max_items: eager
      {{3, 8, 8}, {1, 2, 50}, {1, 30, 2}},         // 5 segments, a clip among them: budget 256
      kGrids,                                      // again: the same buffers, the same answer
  };
  const std::vector<int> want_graph = {1, 1, 1, 0, 0, 1, 1};
  std::vector<std::vector<float>> px;
  for (const auto& gs : sets) px.push_back(random_pixels(patches(gs)));
  GraphBudgets budgets;
  budgets.tokens = {256, 1024};
  budgets.max_items = 8;
  struct Case {
    const char* name;
    AttnDtype dtype;
    ScaleMode mode;
    bool robust;
  };
  const Case cases[] = {{"bf16", AttnDtype::BF16, ScaleMode::DYNAMIC, false},
                        {"fp8 static", AttnDtype::FP8, ScaleMode::STATIC, false},
                        {"fp8 dynamic", AttnDtype::FP8, ScaleMode::DYNAMIC, false},
                        {"fp8 robust dynamic", AttnDtype::FP8, ScaleMode::DYNAMIC, true}};
  for (const Case& c : cases) {
    auto book = [&] {
      return c.mode == ScaleMode::STATIC
                 ? ScaleBook::fixed(std::vector<QkvScales>(size_t(m.config.depth), QkvScales{0.02f, 0.02f, 0.01f}))
                 : ScaleBook::dynamic(m.config.depth);
    };
    ScaleBook eager_book = book(), graph_book = book();
    const Fp8Plan plan = Fp8Plan::robust_dynamic(ScaleMode::DYNAMIC, m.config.depth);
    auto options = [&](ScaleBook& b) {
      qwen3vl::cuda::EncoderOptions o{c.dtype, c.dtype == AttnDtype::FP8 ? &b : nullptr};
      if (c.robust) o.fp8_plan = &plan;
      return o;
    };
    qwen3vl::cuda::Encoder eager(m, options(eager_book));
    qwen3vl::cuda::EncoderOptions go = options(graph_book);
    go.graphs = budgets;
    qwen3vl::cuda::Encoder graphed(m, go);
    fovea::cuda::Stream s;
    ASSERT_EQ(graphed.capture_graphs(s), 2) << c.name;
    EXPECT_THROW(graphed.capture_graphs(s), Error);
    for (size_t k = 0; k < sets.size(); ++k) {
      std::vector<std::vector<uint16_t>> want, got;
      for (auto* enc : {&eager, &graphed}) {
        const int64_t replays = enc->graph_counts().replays;
        enc->plan(sets[k], s);
        enc->upload_pixels(px[k], s);
        enc->forward(s);
        enc->outputs_bf16(true, enc == &eager ? want : got, s);
        if (enc == &graphed) EXPECT_EQ(enc->graph_counts().replays - replays, want_graph[k]) << c.name << " " << k;
      }
      ASSERT_EQ(got.size(), want.size());
      for (size_t j = 0; j < got.size(); ++j) {
        ASSERT_EQ(got[j].size(), want[j].size()) << c.name << " batch " << k;
        const std::vector<float> g = widen(got[j]), w = widen(want[j]);
        for (float x : g) ASSERT_TRUE(std::isfinite(x)) << c.name << " batch " << k;
        const auto e = embedding_error(g, w, m.config.out_hidden);
        EXPECT_LT(e.rel_l2, c.dtype == AttnDtype::BF16 ? 1e-2 : 3e-2) << c.name << " batch " << k << " output " << j;
        if (k == 0 && j == 0) std::printf("%s: graph vs eager rel_l2 %.3e\n", c.name, e.rel_l2);
      }
    }
    const GraphCounts n = graphed.graph_counts();
    EXPECT_EQ(n.captured, 2);
    EXPECT_EQ(n.replays, 5);
    EXPECT_EQ(n.eager, 2);
    EXPECT_EQ(eager.graph_counts().eager, 0);  // without graphs nothing is counted
    if (c.dtype == AttnDtype::FP8 && c.mode == ScaleMode::DYNAMIC) {
      eager.sync_scales(s);
      graphed.sync_scales(s);
      EXPECT_EQ(graph_book.complete_forwards(), eager_book.complete_forwards()) << c.name;  // capture ran nothing
      if (!c.robust)
        for (int l = 0; l < m.config.depth; ++l)
          for (int t = 0; t < 3; ++t)
            EXPECT_NEAR(graph_book.scales(l)[t], eager_book.scales(l)[t], 0.02 * eager_book.scales(l)[t])
                << c.name << " layer " << l;
    }
  }
}

// The static guard on the GPU (docs/fp8.md §Static guard), as the CPU's StaticGuardNeverClips: static
// per-tensor scales far below the batch's range are each raised to the batch's own amax / 448, what
// dynamic scaling's first forward uses: the same bits, eagerly and replayed from a budget's CUDA graph
// (dynamic run the same way). Every layer's q, k and v is counted once a forward, in the book through
// each download (a capture counts nothing); the book's scales stay the file's. Scales far above the
// range are used as given, uncounted.
TEST(EncoderGpu, StaticGuardNeverClips) {
  const Model m = two_block_8b();
  const int L = m.config.depth;
  const std::vector<float> px = random_pixels(patches(kGrids));
  GraphBudgets budgets;
  budgets.tokens = {256};
  budgets.max_items = 8;
  for (const bool graphs : {false, true}) {
    const char* how = graphs ? "graph" : "eager";
    // `forwards` forwards of kGrids; the last one's outputs, and the book's counts after each.
    auto run = [&](ScaleBook& book, int forwards, std::vector<GuardCounts>& counts) {
      qwen3vl::cuda::EncoderOptions o{AttnDtype::FP8, &book};
      if (graphs) o.graphs = budgets;
      qwen3vl::cuda::Encoder enc(m, o);
      fovea::cuda::Stream s;
      if (graphs) {
        EXPECT_EQ(enc.capture_graphs(s), 1) << how;
      }
      EXPECT_EQ(book.guarded(), GuardCounts{}) << how << ": a capture runs nothing";
      std::vector<std::vector<uint16_t>> out;
      for (int f = 0; f < forwards; ++f) {
        enc.plan(kGrids, s);
        enc.upload_pixels(px, s);
        enc.forward(s);
        enc.outputs_bf16(true, out, s);
        counts.push_back(book.guarded());
      }
      EXPECT_EQ(enc.graph_counts().replays, graphs ? forwards : 0) << how;
      return out;
    };
    std::vector<GuardCounts> counts;
    ScaleBook dynamic = ScaleBook::dynamic(L);
    const auto first = run(dynamic, 1, counts);
    ScaleBook tiny = ScaleBook::fixed(std::vector<QkvScales>(size_t(L), QkvScales{1e-9f, 1e-9f, 1e-9f}));
    counts.clear();
    const auto guarded = run(tiny, 2, counts);
    ASSERT_EQ(guarded.size(), first.size()) << how;
    for (size_t k = 0; k < first.size(); ++k)
      EXPECT_EQ(guarded[k], first[k]) << how << " output " << k << ": every tensor at the batch's own scale";
    const uint64_t l = uint64_t(L);
    EXPECT_EQ(counts, (std::vector<GuardCounts>{{l, l, l}, {2 * l, 2 * l, 2 * l}})) << how;
    for (int i = 0; i < L; ++i) EXPECT_EQ(tiny.scales(i), (QkvScales{1e-9f, 1e-9f, 1e-9f})) << "the file's stay";
    ScaleBook large = ScaleBook::fixed(std::vector<QkvScales>(size_t(L), QkvScales{1e3f, 1e3f, 1e3f}));
    counts.clear();
    run(large, 1, counts);
    EXPECT_EQ(large.guarded(), GuardCounts{}) << how;
  }
}

// The robust scheme's guard on the GPU, as the CPU's: one calibrating forward (robust dynamic, the
// batch's own K mean and split pairs, which the history keeps), then its arrays with every scale at
// 1e-9, far below the batch's range: each head's Q and K scale and each V channel's is raised to the
// batch's amax / 448, what the calibrating forward used: the same bits, every tensor counted.
TEST(EncoderGpu, StaticRobustGuardNeverClips) {
  const Model m = two_block_8b();
  const int L = m.config.depth, H = m.config.heads, hd = m.config.head_dim();
  const std::vector<float> px = random_pixels(patches(kGrids));
  ScaleBook cal = ScaleBook::calibrating(L, "unused.json", 1.0f);
  const Fp8Plan dyn_plan = Fp8Plan::robust_dynamic(ScaleMode::CALIBRATE, L);
  qwen3vl::cuda::EncoderOptions o{AttnDtype::FP8, &cal};
  o.fp8_plan = &dyn_plan;
  const auto first = encode_once(m, o, px, true);  // its download brings the histories back
  std::vector<FineScales> own = cal.calibrated_fine(1.0f);
  for (FineScales& f : own)
    for (auto* a : {&f.q_head, &f.k_head, &f.v_channel}) a->assign(a->size(), 1e-9f);
  ScaleBook book = ScaleBook::fixed(std::vector<QkvScales>(size_t(L)));
  const Fp8Plan own_plan = Fp8Plan::robust_static(own, H, hd);
  o.scales = &book, o.fp8_plan = &own_plan;
  EXPECT_EQ(encode_once(m, o, px, true), first);
  const uint64_t l = uint64_t(L);
  EXPECT_EQ(book.guarded(), (GuardCounts{l, l, l}));
  EXPECT_FALSE(cal.calibration_written()) << "one forward of 16";
}

// EncoderRunner on the GPU: static_guarded() reports the device's counts as of each finished batch
// (what /metrics and encode's line read), from a scale file the inputs pass.
TEST(EncoderGpu, RunnerReportsTheStaticGuard) {
  const Model m = two_block_8b();
  const int L = m.config.depth;
  const TempDir dir;
  const std::string path = dir.file("low.json");
  write_scale_file(path, std::vector<QkvScales>(size_t(L), QkvScales{1e-9f, 1e-9f, 1e-9f}));
  EngineOptions eo;
  eo.device = "cuda";
  eo.dtype = "fp8";
  eo.scale_path = path;
  EncoderRunner runner(m, resolve_engine(eo, query_system()));
  EXPECT_EQ(runner.static_guarded(), GuardCounts{});
  Batch b;
  b.pixels = random_pixels(patches(kGrids));
  b.grids = kGrids;
  for (uint64_t f = 1; f <= 2; ++f) {
    const EncoderOutputs out = runner.run(b, false);
    for (float x : out.merged) ASSERT_TRUE(std::isfinite(x));
    EXPECT_EQ(runner.static_guarded(), (GuardCounts{f * L, f * L, f * L})) << "after forward " << f;
  }
}

// Raw uint8 patches normalized on the device give the same pixels, bit for bit, as the host's
// patchify arithmetic rounded to bf16: so the same outputs, for CLIP's mean / std (which make the
// division round) and random samples.
TEST(EncoderGpu, RawPatchesNormalizedOnTheGpuEqualHostNormalized) {
  const Model m = two_block_8b();
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  image::Patches p;
  p.grid = {1, int(n / 2), 2};  // one row per patch; normalize_raw only needs the row count
  p.raw.resize(size_t(n) * 768);
  std::mt19937 rng(fresh_seed());
  for (auto& v : p.raw) v = uint8_t(rng() & 255);
  p.norm = {{0.48145466f, 0.4578275f, 0.40821073f}, {0.26862954f, 0.26130258f, 0.27577711f}, 2};
  image::normalize_raw(p);
  qwen3vl::cuda::Encoder enc(m, {AttnDtype::BF16, nullptr});
  enc.plan(kGrids);
  enc.upload_pixels(p.pixels, nullptr);
  enc.forward(nullptr);
  std::vector<std::vector<uint16_t>> host, device;
  enc.outputs_bf16(true, host, nullptr);
  std::memcpy(enc.raw_staging(), p.raw.data(), p.raw.size());
  enc.upload_raw(p.norm.mean, p.norm.std, nullptr);
  enc.forward(nullptr);
  enc.outputs_bf16(true, device, nullptr);
  EXPECT_EQ(device, host);
}

// The FP8 linears on the GPU against their CPU emulation (linear_fp8), one GEMM at a time, with
// every epilogue the encoder uses: the inputs are bf16 values, so both sides quantize the same
// numbers to the same codes and scales; what may differ is the fp32 summation order and bf16
// roundings: of the result, and with a residual, of the product before the residual is added (what
// cuBLASLt's FP8 epilogue measured to do on the H200, 2026-12-02: errors up to 2^-9 of the product
// where the sum cancels).
TEST(EncoderGpu, Fp8LinearMatchesItsEmulation) {
  std::mt19937_64 rng(fresh_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  struct Case {
    int out, in;
    bool residual, gelu;
  };
  // Each weight re-quantized per channel, and stored in [128, 128] blocks as an FP8 release has it
  // (K 4304 padded to 4352 on the GPU; block-scaled rows come in multiples of 4).
  for (const bool stored : {false, true})
    for (const Case c : {Case{1152, 1152, true, false}, Case{3456, 1152, false, false}, Case{4304, 1152, false, true},
                         Case{1152, 4304, true, false}}) {
      const int rows = stored ? 76 : 77;  // not a multiple of any tile
      Linear l;
      l.out = c.out, l.in = c.in;
      for (int i = 0; i < c.out * c.in; ++i) l.w.push_back(bf16_round(nd(rng) / std::sqrt(float(c.in))));
      for (int i = 0; i < c.out; ++i) l.b.push_back(bf16_round(0.1f * nd(rng)));
      if (stored) {
        l.fp8 = quantize_fp8_weight(l.w, l.out, l.in, {128, 128});
        l.w = l.fp8->dequantized();
      }
      std::vector<float> x(size_t(rows) * c.in), res(size_t(rows) * c.out);
      for (auto& v : x) v = bf16_round(nd(rng));
      for (int i = 0; i < c.in; ++i)
        x[size_t(5 * c.in + i)] = bf16_round(300.f * x[size_t(5 * c.in + i)]);  // a loud token
      for (auto& v : res) v = bf16_round(nd(rng));
      const std::vector<float>* r = c.residual ? &res : nullptr;

      std::vector<float> want = linear_fp8(l, x, rows), mag(want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        if (c.gelu)
          want[i] = 0.5f * want[i] *
                    (1.f + std::tanh(0.7978845608028654f * (want[i] + 0.044715f * want[i] * want[i] * want[i])));
        mag[i] = std::fabs(want[i]) + (r ? std::fabs(res[i]) : 0.f);  // the summands' size
        if (r) want[i] += res[i];
      }
      const std::vector<float> got = qwen3vl::cuda::linear_on_gpu(l, x, rows, true, r, c.gelu);
      const std::vector<float> bf = qwen3vl::cuda::linear_on_gpu(l, x, rows, false, r, c.gelu);
      ASSERT_EQ(got.size(), want.size());
      double num = 0, den = 0, num_bf = 0, worst = 0;
      for (int row = 0; row < rows; ++row) {
        double rms = 0;
        for (int o = 0; o < c.out; ++o) rms += double(want[size_t(row * c.out + o)]) * want[size_t(row * c.out + o)];
        rms = std::sqrt(rms / c.out);
        for (int o = 0; o < c.out; ++o) {
          const size_t i = size_t(row) * c.out + o;
          ASSERT_TRUE(std::isfinite(got[i])) << "row " << row << " col " << o;
          const double d = std::fabs(double(got[i]) - want[i]);
          worst = std::max(worst, d / (mag[i] + 0.05 * rms));
          num += d * d, den += double(want[i]) * want[i];
          num_bf += (double(bf[i]) - want[i]) * (double(bf[i]) - want[i]);
        }
      }
      const double rel = std::sqrt(num / den), rel_bf = std::sqrt(num_bf / den);
      std::printf(
          "fp8 linear %d x %d%s%s%s: gpu vs emulation rel_l2 %.3e, worst %.3e; the bf16 GEMM vs the emulation %.3e\n",
          c.in, c.out, c.residual ? " +residual" : "", c.gelu ? " gelu" : "", stored ? " (stored blocks)" : "", rel,
          worst, rel_bf);
      EXPECT_LT(rel, 4e-3);    // bf16 output rounding, and cuBLASLt's GELU
      EXPECT_LT(worst, 2e-2);  // per element, relative to its summands or 5% of its row's rms
      EXPECT_GT(rel_bf, 4 * rel) << "the FP8 path must differ from the BF16 one by the FP8 rounding";
    }
}

// A model on random pixels of kGrids: its fp32 CPU forward and its FP8 linears' emulation.
struct Fp8LinearRun {
  std::vector<float> px;
  ForwardResult emu, exact;
};
Fp8LinearRun fp8_linear_run(const Model& m) {
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  Fp8LinearRun r{random_pixels(n), {}, {}};
  ForwardOptions fo;
  fo.fp8_linears = true;
  r.emu = forward_cpu(m, r.px, kGrids, fo);
  r.exact = forward_cpu(m, r.px, kGrids);
  return r;
}
// The GPU encoder's merged output on those pixels, its linears in FP8 or BF16.
std::vector<float> gpu_merged(const Model& m, const std::vector<float>& px, bool fp8_linears) {
  qwen3vl::cuda::EncoderOptions o;
  o.fp8_linears = fp8_linears;
  return encode_once(m, o, px).back();
}

// The whole encoder with FP8 linears (BF16 attention): its error against the fp32 CPU forward is the
// size of the emulated FP8 linears' error, and well above the BF16-linear GPU forward's. (Not
// compared element by element with the emulation: the GPU's bf16 activations move values across
// E4M3 rounding boundaries, so the two runs' FP8 rounding noise is largely independent; measured
// 2026-12-02: GPU vs emulation 4.3e-2, each against fp32 about 5.4e-2.)
TEST(EncoderGpu, Fp8LinearsHaveTheirEmulationsErrorEndToEnd) {
  const Model m = two_block_8b();
  const Fp8LinearRun r = fp8_linear_run(m);
  const int O = m.config.out_hidden;
  const auto f8 = gpu_merged(m, r.px, true), bf = gpu_merged(m, r.px, false);
  for (float v : f8) ASSERT_TRUE(std::isfinite(v));
  const auto e_gpu = embedding_error(f8, r.exact.merged, O), e_emu = embedding_error(r.emu.merged, r.exact.merged, O);
  const auto e_bf = embedding_error(bf, r.exact.merged, O);
  std::printf(
      "merged against fp32: gpu fp8 linears rel_l2 %.3e (cos %.6f), their emulation %.3e, gpu bf16 linears %.3e\n",
      e_gpu.rel_l2, e_gpu.mean_cosine, e_emu.rel_l2, e_bf.rel_l2);
  EXPECT_GT(e_gpu.rel_l2, 0.7 * e_emu.rel_l2);
  EXPECT_LT(e_gpu.rel_l2, 1.3 * e_emu.rel_l2);
  EXPECT_LT(e_bf.rel_l2, 0.5 * e_gpu.rel_l2);
  EXPECT_GT(e_gpu.mean_cosine, 0.997);
}

// An FP8 release's [128, 128]-block weights run as stored: the two-block 8B model with its blocks'
// linears stored so (what `export-model --fp8-weights blocks` writes), through --fp8-linears, against
// the fp32 forward of its own dequantized weights (what transformers computes from such a file):
// the error is its emulation's, and the run is not the re-quantized one (whose codes differ).
TEST(EncoderGpu, Fp8LinearsRunStoredBlocksAsTheirEmulation) {
  Model m = two_block_8b();
  quantize_block_linears(m, {128, 128});
  const Fp8LinearRun r = fp8_linear_run(m);
  const int O = m.config.out_hidden;
  const auto f8 = gpu_merged(m, r.px, true);
  Model requantized = m;
  for (auto& b : requantized.weights.blocks)
    for (auto [name, l] : block_linears(b, 0)) l->fp8.reset();
  const auto rq = gpu_merged(requantized, r.px, true);
  for (float v : f8) ASSERT_TRUE(std::isfinite(v));
  const auto e_gpu = embedding_error(f8, r.exact.merged, O), e_emu = embedding_error(r.emu.merged, r.exact.merged, O);
  const auto e_rq = embedding_error(rq, r.exact.merged, O), e_apart = embedding_error(f8, rq, O);
  std::printf(
      "stored blocks, merged against the dequantized fp32 forward: gpu rel_l2 %.3e (cos %.6f), emulation %.3e; "
      "re-quantized per channel %.3e, %.3e from the stored run\n",
      e_gpu.rel_l2, e_gpu.mean_cosine, e_emu.rel_l2, e_rq.rel_l2, e_apart.rel_l2);
  EXPECT_GT(e_gpu.rel_l2, 0.7 * e_emu.rel_l2);
  EXPECT_LT(e_gpu.rel_l2, 1.3 * e_emu.rel_l2);
  EXPECT_GT(e_gpu.mean_cosine, 0.997);
  EXPECT_GT(e_apart.rel_l2, 0.1 * e_gpu.rel_l2) << "the stored codes ran, not a re-quantization";
}

// The robust FP8 scheme end to end on the GPU (docs/fp8.md §Outlier channels): the two-block 8B
// model with outlier channels put into every block's qkv (with_outlier_channels; the Q/K one on the
// column's slowest RoPE frequency, channel hd/2 - 1), as test-encoder-cpu does with the tiny model.
// Per-tensor FP8 loses much more than BF16 here; the robust scheme, with each layer's arrays
// computed on the device, recovers it and follows its CPU emulation.
Model outlier_8b() {
  Model m = two_block_8b();
  const int qk = m.config.head_dim() / 2 - 1;
  return with_outlier_channels(std::move(m), qk);
}

// The two outlier models: Q and K together on the slowest rotary pair (outlier_8b), and K's outliers
// apart from Q's, on fast and slow pairs (the synthetic:...-outliers preset, add_outlier_channels).
std::vector<std::pair<std::string, Model>> outlier_models() {
  std::vector<std::pair<std::string, Model>> out;
  out.emplace_back("slow pair", outlier_8b());
  out.emplace_back("key channels", load_model("synthetic:qwen3-vl-8b-2blocks-outliers"));
  return out;
}

class EncoderGpuOutliers : public ::testing::TestWithParam<int> {};

TEST_P(EncoderGpuOutliers, RobustFp8HoldsUpUnderOutlierChannels) {
  const auto [name, m] = std::move(outlier_models()[size_t(GetParam())]);
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  const std::vector<float> px = random_pixels(n);
  const ForwardResult exact = forward_cpu(m, px, kGrids);
  ScaleBook cpu_book = ScaleBook::dynamic(m.config.depth);
  ForwardOptions fo;
  fo.attention = cpu::RefMode::FP8;
  fo.scales = &cpu_book;
  const Fp8Plan robust_dyn = Fp8Plan::robust_dynamic(ScaleMode::DYNAMIC, m.config.depth);
  fo.fp8_plan = &robust_dyn;
  const ForwardResult emu = forward_cpu(m, px, kGrids, fo);
  const int O = m.config.out_hidden;
  auto run = [&](AttnDtype dt, bool robust) {
    ScaleBook book = ScaleBook::dynamic(m.config.depth);
    qwen3vl::cuda::EncoderOptions o;
    o.dtype = dt;
    o.scales = dt == AttnDtype::FP8 ? &book : nullptr;
    o.fp8_plan = robust ? &robust_dyn : nullptr;
    auto out = encode_once(m, o, px).back();
    for (float x : out) EXPECT_TRUE(std::isfinite(x));
    return out;
  };
  const auto e_bf = embedding_error(run(AttnDtype::BF16, false), exact.merged, O);
  const auto e_tensor = embedding_error(run(AttnDtype::FP8, false), exact.merged, O);
  const auto robust = run(AttnDtype::FP8, true);
  const auto e_robust = embedding_error(robust, exact.merged, O), e_emu = embedding_error(emu.merged, exact.merged, O);
  const auto vs_emu = embedding_error(robust, emu.merged, O);
  std::printf(
      "outlier channels (%s), merged rel_l2 vs fp32: gpu bf16 %.3e, fp8 tensor %.3e (%.2fx bf16), fp8 robust %.3e "
      "(%.2fx bf16, cos %.6f); robust emulation %.3e; gpu robust vs emulation %.3e\n",
      name.c_str(), e_bf.rel_l2, e_tensor.rel_l2, e_tensor.rel_l2 / e_bf.rel_l2, e_robust.rel_l2,
      e_robust.rel_l2 / e_bf.rel_l2, e_robust.mean_cosine, e_emu.rel_l2, vs_emu.rel_l2);
  // Slow pair, two runs before the split pairs (fresh pixels): bf16 0.117 / 0.164, tensor 0.771 / 0.550,
  // robust 0.167 / 0.243, its emulation 0.159 / 0.119. The GPU's error is the emulation's plus bf16
  // activations' (BF16's own).
  EXPECT_LT(e_robust.rel_l2, e_tensor.rel_l2 / 1.5);
  // Measured (H200, 2026-12-04, split pairs): slow pair 1.10x BF16, key channels 2.43x (its emulation,
  // fp32 but for FP8 attention, is at 2.1x: E4M3's floor in Q.K, V and P, docs/fp8.md).
  EXPECT_LT(e_robust.rel_l2, (GetParam() == 0 ? 2.0 : 3.0) * e_bf.rel_l2);
  EXPECT_LT(e_robust.rel_l2, 1.2 * (e_emu.rel_l2 + e_bf.rel_l2));
  EXPECT_LT(vs_emu.rel_l2, e_tensor.rel_l2);
}

// Calibrating the robust scheme on the GPU (the histories on the device, copied back after each
// forward): the file is written after the 16th forward with every layer's fine scales, and static
// robust FP8 from it on other pixels is about as good as dynamic robust FP8 there.
TEST_P(EncoderGpuOutliers, RobustCalibrationWritesFineScalesThatServeStatically) {
  const auto [name, m] = std::move(outlier_models()[size_t(GetParam())]);
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  const std::vector<float> calib = random_pixels(n), held = random_pixels(n);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("fovea-robust-" + std::to_string(getpid()) + ".json")).string();
  std::filesystem::remove(path);
  ScaleBook cal = ScaleBook::calibrating(m.config.depth, path, kDefaultScaleMargin);
  {
    qwen3vl::cuda::EncoderOptions o;
    o.dtype = AttnDtype::FP8;
    o.scales = &cal;
    const Fp8Plan plan = Fp8Plan::robust_dynamic(ScaleMode::CALIBRATE, m.config.depth);
    o.fp8_plan = &plan;
    qwen3vl::cuda::Encoder enc(m, o);
    enc.plan(kGrids);
    for (int f = 0; f < 16; ++f) {
      EXPECT_FALSE(std::filesystem::exists(path)) << "before forward " << f + 1;
      enc.upload_pixels(calib, nullptr);
      enc.forward(nullptr);
      enc.sync_scales(nullptr);
      EXPECT_EQ(cal.after_forward(), f == 15);  // the calibration step EncoderRunner takes
    }
  }
  ASSERT_TRUE(cal.calibration_written());
  EXPECT_EQ(cal.fine_state()[0].counts.updates, 16u);
  const ScaleFile file = read_scale_file(path);
  std::filesystem::remove(path);
  ASSERT_EQ(file.fine.size(), size_t(m.config.depth));
  std::vector<FineScales> fine;
  for (int l = 0; l < m.config.depth; ++l) fine.push_back(file.fine.at(l));
  const ForwardResult exact = forward_cpu(m, held, kGrids);
  const int H = m.config.heads, hd = m.config.head_dim();
  auto run = [&](ScaleBook& book, const Fp8Plan* plan) {
    qwen3vl::cuda::EncoderOptions o;
    o.dtype = AttnDtype::FP8;
    o.scales = &book;
    o.fp8_plan = plan;
    return embedding_error(encode_once(m, o, held).back(), exact.merged, m.config.out_hidden);
  };
  ScaleBook dyn = ScaleBook::dynamic(m.config.depth), fixed = ScaleBook::fixed(scales_for_model(file, m.config.depth));
  ScaleBook fixed_tensor = fixed;
  const Fp8Plan robust_dyn = Fp8Plan::robust_dynamic(ScaleMode::DYNAMIC, m.config.depth),
                robust_static = Fp8Plan::robust_static(fine, H, hd);
  const auto e_dyn = run(dyn, &robust_dyn), e_static = run(fixed, &robust_static),
             e_tensor = run(fixed_tensor, nullptr);
  std::printf(
      "robust calibration on the GPU (%s), held-out merged rel_l2 vs fp32: dynamic %.3e, static %.3e (%.2fx); "
      "per-tensor static %.3e\n",
      name.c_str(), e_dyn.rel_l2, e_static.rel_l2, e_static.rel_l2 / e_dyn.rel_l2, e_tensor.rel_l2);
  EXPECT_LT(e_static.rel_l2, 2.0 * e_dyn.rel_l2);
  EXPECT_LT(e_static.rel_l2, e_tensor.rel_l2 / 1.5);

  // --fp8-scheme auto reads the gains: both blocks carry outlier channels, so both need the scheme.
  for (int l = 0; l < m.config.depth; ++l) {
    std::printf("  layer %d robust gain %.2f\n", l, file.fine.at(l).robust_gain);
    EXPECT_GE(file.fine.at(l).robust_gain, kAutoRobustGain) << "layer " << l;
  }
  // A mixed list (block 0 per-tensor, block 1 robust, as auto runs a file that asks for it on block 1
  // only): block 0's output (the first deepstack tap) is the per-tensor run's bit for bit, block 1's
  // follows the CPU emulation of the same list.
  auto outputs = [&](const Fp8Plan* plan) {
    ScaleBook book = ScaleBook::fixed(scales_for_model(file, m.config.depth));
    qwen3vl::cuda::EncoderOptions o;
    o.dtype = AttnDtype::FP8;
    o.scales = &book;
    o.fp8_plan = plan;
    return encode_once(m, o, held, true);
  };
  const Fp8Plan mixed = Fp8Plan::robust_static({FineScales{}, fine[1]}, H, hd);
  const auto g_tensor = outputs(nullptr), g_all = outputs(&robust_static), g_mixed = outputs(&mixed);
  EXPECT_EQ(g_mixed[0], g_tensor[0]) << "block 0 per-tensor";
  EXPECT_NE(g_mixed[0], g_all[0]);
  ScaleBook cpu_fixed = ScaleBook::fixed(scales_for_model(file, m.config.depth));
  ForwardOptions fo;
  fo.attention = cpu::RefMode::FP8;
  fo.scales = &cpu_fixed;
  fo.fp8_plan = &mixed;
  const ForwardResult emu = forward_cpu(m, held, kGrids, fo);
  const int O = m.config.out_hidden;
  const auto e_mixed = embedding_error(g_mixed.back(), exact.merged, O),
             e_emu = embedding_error(emu.merged, exact.merged, O);
  const auto vs_emu = embedding_error(g_mixed.back(), emu.merged, O);
  const auto e_tensor_out = embedding_error(g_tensor.back(), exact.merged, O);
  std::printf(
      "  mixed (block 0 tensor, block 1 robust): %.3e vs fp32, emulation %.3e, gpu vs emulation %.3e; all tensor "
      "%.3e\n",
      e_mixed.rel_l2, e_emu.rel_l2, vs_emu.rel_l2, e_tensor_out.rel_l2);
  for (float x : g_mixed.back()) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(vs_emu.rel_l2, e_tensor_out.rel_l2);
  EXPECT_LT(e_mixed.rel_l2, 2.0 * e_emu.rel_l2 + 0.05);
}

INSTANTIATE_TEST_SUITE_P(Models, EncoderGpuOutliers, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param == 0 ? "SlowPair" : "KeyChannels"; });

// The encoder with the CUDNN backend (BF16) against the fp32 CPU forward, beside the FOVEA backend on
// the same pixels: the same error within a tenth (both are BF16 attention with fp32 softmax), merged
// and deepstack outputs.
TEST(EncoderGpu, CudnnBackendMatchesTheCpuReferenceAsFoveaDoes) {
  const Model m = two_block_8b();
  int64_t n = 0;
  for (auto& g : kGrids) n += int64_t(g[0]) * g[1] * g[2];
  const std::vector<float> px = random_pixels(n);
  const ForwardResult ref = forward_cpu(m, px, kGrids);
  const int O = m.config.out_hidden;
  double err[2] = {0, 0};
  for (const AttnBackend b : {AttnBackend::FOVEA, AttnBackend::CUDNN}) {
    qwen3vl::cuda::EncoderOptions o;
    o.backend = b;
    qwen3vl::cuda::Encoder enc(m, o);
    enc.plan(kGrids);
    enc.upload_pixels(px, nullptr);
    enc.forward(nullptr);
    FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
    const auto s = embedding_error(enc.merged(nullptr), ref.merged, O);
    std::printf("%s bf16 merged: rel_l2 %.3e, mean cosine %.6f\n", backend_name(b), s.rel_l2, s.mean_cosine);
    EXPECT_LT(s.rel_l2, 3e-2);
    EXPECT_GT(s.mean_cosine, 0.999);
    const auto ds = enc.deepstack(nullptr);
    ASSERT_EQ(ds.size(), ref.deepstack.size());
    for (size_t k = 0; k < ds.size(); ++k) EXPECT_LT(embedding_error(ds[k], ref.deepstack[k], O).rel_l2, 3e-2);
    err[b == AttnBackend::CUDNN] = s.rel_l2;
  }
  EXPECT_LT(err[1], 1.1 * err[0] + 1e-3);
}
