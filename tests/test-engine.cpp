// Tests of engine flag resolution (docs/architecture.md §Engine configuration, docs/fp8.md §Engine
// options) with hand-built SystemInfo values: no GPU is needed or used.
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fovea/engine.h"
#include "test-util.h"

// EngineOptions are written with designated initializers naming only the flags a test sets; the
// rest keep their defaults, which is the point, so -Wextra's warning about them is noise here.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace fs = std::filesystem;
using namespace fovea;
using namespace fovea::test;

namespace {

SystemInfo no_gpu(bool cuda_built = false) {
  SystemInfo s;
  s.cuda_built = s.cudnn_built = cuda_built;
  s.cudnn_version = cuda_built ? 91900 : 0;
  s.gpu_error = "no GPU in this test";
  return s;
}
SystemInfo with_gpu(const std::string& name, int major, int minor, bool cuda_built = true, bool cudnn_built = true) {
  SystemInfo s;
  s.cuda_built = cuda_built;
  s.cudnn_built = cudnn_built;  // a build with the CUDNN backend
  s.cudnn_version = cudnn_built ? 91900 : 0;
  s.gpus.push_back({0, name, major, minor, 132, size_t(141) << 30});
  return s;
}
SystemInfo h200(bool cudnn_built = true) { return with_gpu("NVIDIA H200", 9, 0, true, cudnn_built); }
SystemInfo a100(bool cudnn_built = true) { return with_gpu("NVIDIA A100-SXM4-80GB", 8, 0, true, cudnn_built); }

// The message of the fovea::Error resolve_engine throws; a test failure if it does not throw one.
std::string error_of(const EngineOptions& opt, const SystemInfo& sys) {
  return fovea::test::error_of([&] { resolve_engine(opt, sys); });
}

const char* kScaleFlag = "--mm-encoder-fp8-scale-path";
const char* kSaveFlag = "--mm-encoder-fp8-scale-save-path";
const char* kMarginFlag = "--mm-encoder-fp8-scale-save-margin";
const char* kBackendFlag = "--mm-encoder-attn-backend";
const char* kDtypeFlag = "--mm-encoder-attn-dtype";

const char* kValidScales = R"({"visual.blocks.0.attn.attn": {"q": 0.5, "k": 0.25, "v": 0.125},
                               "visual.blocks.1.attn.attn": {"q": 1, "k": 2, "v": 4}})";

}  // namespace

// ---- resolution ------------------------------------------------------------------------------------

TEST(ResolveEngine, DefaultsWithoutAGpuAreCpuBf16) {
  for (bool built : {false, true}) {
    const EngineConfig c = resolve_engine({}, no_gpu(built));
    EXPECT_EQ(c.device, Device::CPU);
    EXPECT_EQ(c.backend, AttnBackend::CPU);
    EXPECT_EQ(c.dtype, AttnDtype::BF16);
    EXPECT_FALSE(c.scale_mode.has_value());
    EXPECT_FALSE(c.gpu.has_value());
  }
}

TEST(ResolveEngine, DefaultsOnHopperAreCudaFovea) {
  const EngineConfig c = resolve_engine({}, h200());
  EXPECT_EQ(c.device, Device::CUDA);
  EXPECT_EQ(c.backend, AttnBackend::FOVEA);
  EXPECT_EQ(c.dtype, AttnDtype::BF16);
  ASSERT_TRUE(c.gpu.has_value());
  EXPECT_EQ(c.gpu->name, "NVIDIA H200");
  const EngineConfig fp8 = resolve_engine({.dtype = "fp8"}, h200());
  EXPECT_EQ(fp8.backend, AttnBackend::FOVEA);
  EXPECT_EQ(fp8.dtype, AttnDtype::FP8);
}

TEST(ResolveEngine, AutoOnAmpereIsCudnn) {
  const EngineConfig c = resolve_engine({}, a100());
  EXPECT_EQ(c.device, Device::CUDA);
  EXPECT_EQ(c.backend, AttnBackend::CUDNN);
  // Without cuDNN nothing runs on that GPU: an error, not a silent fallback to the CPU.
  const std::string msg = error_of({}, a100(/*cudnn_built=*/false));
  EXPECT_HAS(msg, kBackendFlag);
  EXPECT_HAS(msg, "cuDNN");
  EXPECT_HAS(msg, "CPU (--device cpu)");
}

// Where the CUDNN backend cannot run, the error says why and lists where the dtype runs: FP8 (BF16
// only), an old cuDNN at run time, a GPU older than sm_80; FP8 linears need sm_90.
TEST(ResolveEngine, CudnnLimitsAreErrorsThatSayWhy) {
  const std::string fp8 = error_of({.backend = "CUDNN", .dtype = "fp8"}, h200());
  EXPECT_HAS(fp8, "runs BF16 only");
  EXPECT_HAS(fp8, "FOVEA (--device cuda)");                              // FP8 runs on this H200 with FOVEA
  EXPECT_HAS(error_of({.dtype = "fp8"}, a100()), "needs a Hopper GPU");  // AUTO FP8 is FOVEA's: not on Ampere
  SystemInfo old = a100();
  old.cudnn_version = 91400;
  EXPECT_HAS(error_of({}, old), "cuDNN 9.15 or newer at run time");
  EXPECT_HAS(error_of({}, old), "loaded 9.14.0");
  EXPECT_HAS(error_of({}, with_gpu("Tesla V100", 7, 0)), "needs sm_80 or newer");
  EXPECT_EQ(resolve_engine({.backend = "CUDNN"}, h200()).backend, AttnBackend::CUDNN);
  EngineOptions lin;
  lin.fp8_linears = true;
  EXPECT_HAS(error_of(lin, a100()), "--fp8-linears on the GPU needs sm_90");
  EXPECT_TRUE(resolve_engine(lin, h200()).fp8_linears);
}

TEST(ResolveEngine, BackendNamesAreCaseInsensitiveAndFlashinferIsCudnn) {
  const std::vector<std::pair<std::string, AttnBackend>> names = {
      {"FLASHINFER", AttnBackend::CUDNN}, {"flashinfer", AttnBackend::CUDNN}, {"FlashInfer", AttnBackend::CUDNN},
      {"CUDNN", AttnBackend::CUDNN},      {"cuDNN", AttnBackend::CUDNN},      {"fovea", AttnBackend::FOVEA},
      {"Fovea", AttnBackend::FOVEA},      {"auto", AttnBackend::FOVEA},       {"AUTO", AttnBackend::FOVEA}};
  for (const auto& [name, want] : names) {
    EXPECT_EQ(resolve_engine({.backend = name}, h200()).backend, want) << name;
  }
  for (const std::string name : {"cpu", "CPU", "Cpu"}) {
    const EngineConfig c = resolve_engine({.backend = name}, h200());
    EXPECT_EQ(c.backend, AttnBackend::CPU) << name;
    EXPECT_EQ(c.device, Device::CPU) << name;  // no --device: the CPU backend picks the CPU
  }
  EXPECT_EQ(resolve_engine({.dtype = "BF16"}, no_gpu()).dtype, AttnDtype::BF16);
}

TEST(ResolveEngine, Fp8ScaleModes) {
  TempDir dir;
  const EngineConfig dyn = resolve_engine({.dtype = "fp8"}, no_gpu());
  EXPECT_EQ(dyn.dtype, AttnDtype::FP8);
  EXPECT_EQ(dyn.backend, AttnBackend::CPU);
  EXPECT_EQ(dyn.scale_mode, ScaleMode::DYNAMIC);

  const std::string scales = dir.write("scales.json", kValidScales);
  const EngineConfig st = resolve_engine({.dtype = "fp8", .scale_path = scales}, no_gpu());
  EXPECT_EQ(st.scale_mode, ScaleMode::STATIC);
  EXPECT_EQ(st.scale_path, scales);
  ASSERT_TRUE(st.scale_file.has_value());
  ASSERT_EQ(st.scale_file->layers.size(), 2u);
  EXPECT_EQ(st.scale_file->layers.at(0), (QkvScales{0.5f, 0.25f, 0.125f}));
  EXPECT_EQ(st.scale_file->layers.at(1), (QkvScales{1, 2, 4}));

  const std::string save = dir.file("out.json");
  const EngineConfig cal = resolve_engine({.dtype = "fp8", .scale_save_path = save, .scale_save_margin = 2.0}, h200());
  EXPECT_EQ(cal.scale_mode, ScaleMode::CALIBRATE);
  EXPECT_EQ(cal.scale_save_path, save);
  EXPECT_EQ(cal.scale_save_margin, 2.0f);
  EXPECT_FALSE(cal.scale_file.has_value());
  EXPECT_FALSE(fs::exists(save));  // resolving the flags writes nothing
}

// --fp8-scheme: tensor (vLLM's per-tensor scales) unless robust is asked for; robust runs on the CPU
// only so far, with dynamic scales or a file's fine scales.
TEST(ResolveEngine, Fp8Scheme) {
  TempDir dir;
  EngineOptions o;
  o.dtype = "fp8";
  const EngineConfig def = resolve_engine(o, no_gpu());
  EXPECT_FALSE(def.fp8_robust);
  EXPECT_NE(def.scheme_note.find("auto: tensor"), std::string::npos) << def.scheme_note;
  o.fp8_scheme = "robust";
  EXPECT_TRUE(resolve_engine(o, no_gpu()).fp8_robust);
  o.fp8_scheme = "tensor";
  EXPECT_FALSE(resolve_engine(o, no_gpu()).fp8_robust);

  auto err = [&](EngineOptions e, const SystemInfo& sys) { return error_of(e, sys); };
  EngineOptions r;
  r.dtype = "fp8";
  r.fp8_scheme = "sometimes";
  EXPECT_NE(err(r, no_gpu()).find("--fp8-scheme: 'sometimes'"), std::string::npos);
  r.fp8_scheme = "robust";
  EXPECT_TRUE(resolve_engine(r, h200()).fp8_robust);  // the GPU kernels run it too
  EngineOptions b = r;
  b.dtype = "bf16";
  EXPECT_NE(err(b, no_gpu()).find("needs --mm-encoder-attn-dtype fp8"), std::string::npos);
  EngineOptions c = r;
  c.scale_save_path = dir.file("cal.json");
  const EngineConfig cal = resolve_engine(c, no_gpu());  // calibration writes the fine scales too
  EXPECT_TRUE(cal.fp8_robust);
  EXPECT_EQ(cal.scale_mode, ScaleMode::CALIBRATE);
  EngineOptions st = r;
  st.scale_path = dir.write("plain.json", kValidScales);
  EXPECT_NE(err(st, no_gpu()).find("needs the file's fine scales"), std::string::npos);
  const std::string fine = dir.write(
      "fine.json",
      R"({"visual.blocks.0.attn.attn": {"q": 1, "k": 1, "v": 1, "fovea_q_head": [1], "fovea_k_head": [1], "fovea_v_channel": [1, 2], "fovea_k_mean": [0, 0]},
          "visual.blocks.1.attn.attn": {"q": 1, "k": 1, "v": 1, "fovea_q_head": [2], "fovea_k_head": [2], "fovea_v_channel": [3, 4], "fovea_k_mean": [1, -1]}})");
  st.scale_path = fine;
  const EngineConfig ok = resolve_engine(st, no_gpu());
  EXPECT_TRUE(ok.fp8_robust);
  EXPECT_EQ(ok.scale_file->fine.size(), 2u);
}

// --fp8-scheme auto: per-tensor when dynamic; calibration runs robust (its file records each layer's
// robust gain); a static file runs robust on the layers whose fovea_robust_gain reaches
// kAutoRobustGain and per-tensor q/k/v on the rest; a file without gains stays per-tensor, warning.
TEST(ResolveEngine, Fp8SchemeAutoChoosesPerLayerFromTheFile) {
  TempDir dir;
  EngineOptions o;
  o.dtype = "fp8";
  const EngineConfig dyn = resolve_engine(o, h200());
  EXPECT_FALSE(dyn.fp8_robust);
  EXPECT_EQ(dyn.fp8_plan(3, 1, 2).describe(), "tensor dynamic on every layer");
  o.scale_save_path = dir.file("cal.json");
  const EngineConfig cal = resolve_engine(o, h200());
  EXPECT_TRUE(cal.fp8_robust);
  EXPECT_FALSE(cal.fp8_auto_layers);
  EXPECT_HAS(cal.scheme_note, "fovea_robust_gain");
  EXPECT_EQ(cal.fp8_plan(3, 1, 2).describe(), "robust dynamic on every layer");
  o.scale_save_path.clear();

  auto layer = [](int l, const std::string& gain) {
    const std::string g = gain.empty() ? "" : ", \"fovea_robust_gain\": " + gain;
    return "\"visual.blocks." + std::to_string(l) + ".attn.attn\": {\"q\": 1, \"k\": 2, \"v\": 3, \"fovea_q_head\": [" +
           std::to_string(l + 1) + "], \"fovea_k_head\": [1], \"fovea_v_channel\": [1, 2], \"fovea_k_mean\": [0, 5]" +
           g + "}";
  };
  o.scale_path = dir.write("mixed.json", "{" + layer(0, "1.2") + ", " + layer(1, "7.5") + ", " + layer(2, "2") + "}");
  const EngineConfig mixed = resolve_engine(o, h200());
  EXPECT_TRUE(mixed.fp8_robust);
  EXPECT_TRUE(mixed.fp8_auto_layers);
  EXPECT_HAS(mixed.scheme_note, "robust on layers 1,2 of 3");
  const Fp8Plan plan = mixed.fp8_plan(3, 1, 2);  // the threshold itself counts: layer 2
  EXPECT_EQ(plan.describe(), "robust static on layers 1,2; tensor static on layer 0");
  EXPECT_TRUE(plan.fine(0).empty());
  EXPECT_EQ(plan.fine(1), mixed.scale_file->fine.at(1));
  EXPECT_EQ(plan.fine(2).q_head, std::vector<float>{3.0f});
  // The file's fine scales against the model's shape: 2 heads where it has 1.
  EXPECT_HAS(fovea::test::error_of([&] { mixed.fp8_plan(3, 2, 2); }),
             "mixed.json': layer 1's fine scales are for 1 heads");
  // Forced robust runs every layer; forced tensor none.
  o.fp8_scheme = "robust";
  const EngineConfig forced = resolve_engine(o, h200());
  EXPECT_FALSE(forced.fp8_auto_layers);
  EXPECT_EQ(forced.fp8_plan(3, 1, 2).describe(), "robust static on every layer");
  o.fp8_scheme = "tensor";
  {
    CaptureWarnings cw;
    EXPECT_EQ(resolve_engine(o, h200()).fp8_plan(3, 1, 2).describe(), "tensor static on every layer");
  }
  o.fp8_scheme = "auto";

  o.scale_path = dir.write("calm.json", "{" + layer(0, "1.2") + ", " + layer(1, "1.9") + "}");
  const EngineConfig calm = resolve_engine(o, h200());
  EXPECT_FALSE(calm.fp8_robust);
  EXPECT_HAS(calm.scheme_note, "auto: tensor (no layer's fovea_robust_gain reaches");
  EXPECT_EQ(calm.fp8_plan(2, 1, 2).describe(), "tensor static on every layer");

  o.scale_path = dir.write("old.json", "{" + layer(0, "") + "}");
  CaptureWarnings cw;
  EXPECT_FALSE(resolve_engine(o, h200()).fp8_robust);
  ASSERT_EQ(g_warnings.size(), 1u);
  EXPECT_HAS(g_warnings[0], "auto needs a file whose calibration wrote fovea_robust_gain");
}

// ---- errors: every message names the option ---------------------------------------------------------

TEST(ResolveEngineErrors, ScaleOptions) {
  TempDir dir;
  const std::string scales = dir.write("scales.json", kValidScales);
  const std::string save = dir.file("out.json");
  fs::create_directory(dir.path / "folder");
  struct Case {
    const char* name;
    EngineOptions opt;
    std::vector<std::string> words;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Case> cases = {
      {"scale path without fp8", {.scale_path = scales}, {kScaleFlag, kDtypeFlag}},
      {"scale path with bf16", {.dtype = "bf16", .scale_path = scales}, {kScaleFlag, kDtypeFlag}},
      {"save path without fp8", {.scale_save_path = save}, {kSaveFlag, kDtypeFlag}},
      {"both paths", {.dtype = "fp8", .scale_path = scales, .scale_save_path = save}, {kScaleFlag, kSaveFlag}},
      {"save folder missing",
       {.dtype = "fp8", .scale_save_path = dir.file("missing/out.json")},
       {kSaveFlag, "missing"}},
      {"save path is a folder", {.dtype = "fp8", .scale_save_path = dir.file("folder")}, {kSaveFlag, "folder"}},
      {"margin 0", {.dtype = "fp8", .scale_save_path = save, .scale_save_margin = 0.0}, {kMarginFlag}},
      {"margin -1", {.dtype = "fp8", .scale_save_path = save, .scale_save_margin = -1.0}, {kMarginFlag}},
      {"margin NaN", {.dtype = "fp8", .scale_save_path = save, .scale_save_margin = nan}, {kMarginFlag}},
      {"margin 0 as a float", {.dtype = "fp8", .scale_save_path = save, .scale_save_margin = 1e-50}, {kMarginFlag}},
      {"margin inf as a float", {.dtype = "fp8", .scale_save_path = save, .scale_save_margin = 1e300}, {kMarginFlag}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string msg = error_of(c.opt, no_gpu());
    for (const std::string& w : c.words) EXPECT_HAS(msg, w);
  }
  EXPECT_FALSE(fs::exists(save));
}

TEST(ResolveEngineErrors, InvalidScaleFileNamesTheOptionAndTheFile) {
  TempDir dir;
  const std::string bad = dir.write("bad.json", R"({"visual.blocks.0.attn.attn": {"q": 0.5, "k": 0.5}})");
  std::string msg = error_of({.dtype = "fp8", .scale_path = bad}, no_gpu());
  EXPECT_HAS(msg, kScaleFlag);
  EXPECT_HAS(msg, bad);
  EXPECT_HAS(msg, "'v'");
  const std::string absent = dir.file("absent.json");
  msg = error_of({.dtype = "fp8", .scale_path = absent}, no_gpu());
  EXPECT_HAS(msg, kScaleFlag);
  EXPECT_HAS(msg, absent);
}

TEST(ResolveEngineErrors, UnknownNames) {
  std::string msg = error_of({.backend = "TRITON"}, h200());
  EXPECT_HAS(msg, kBackendFlag);
  EXPECT_HAS(msg, "TRITON");
  msg = error_of({.dtype = "fp16"}, h200());
  EXPECT_HAS(msg, kDtypeFlag);
  EXPECT_HAS(msg, "fp16");
  msg = error_of({.device = "tpu"}, h200());
  EXPECT_HAS(msg, "--device");
  EXPECT_HAS(msg, "tpu");
}

TEST(ResolveEngineErrors, DeviceCudaNeedsACudaBuildAndAGpu) {
  SystemInfo not_built = h200();
  not_built.cuda_built = not_built.cudnn_built = false;
  std::string msg = error_of({.device = "cuda"}, not_built);
  EXPECT_HAS(msg, "--device");
  EXPECT_HAS(msg, "CUDA");
  msg = error_of({.device = "cuda"}, no_gpu(/*cuda_built=*/true));
  EXPECT_HAS(msg, "--device");
  EXPECT_HAS(msg, "no GPU in this test");  // says why no GPU is visible
}

TEST(ResolveEngineErrors, BackendCannotRunThere) {
  struct Case {
    const char* name;
    EngineOptions opt;
    SystemInfo sys;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"FOVEA on the CPU", {.backend = "FOVEA"}, no_gpu(), {"FOVEA", "GPU", "runs here on", "CPU (--device cpu)"}},
      {"FOVEA with --device cpu", {.backend = "FOVEA", .device = "cpu"}, h200(), {"FOVEA", "runs here on"}},
      {"FOVEA on sm_80", {.backend = "FOVEA"}, a100(), {"FOVEA", "Hopper", "sm_80", "CUDNN (--device cuda)"}},
      {"CPU backend on --device cuda", {.backend = "CPU", .device = "cuda"}, h200(), {"CPU", "--device cpu"}},
      {"CUDNN fp8 on sm_80",
       {.backend = "CUDNN", .dtype = "fp8"},
       a100(),
       {"CUDNN", "BF16 only", "fp8 attention runs here on", "CPU (--device cpu)"}},
      {"AUTO fp8 on sm_80", {.dtype = "fp8"}, a100(), {"FOVEA", "Hopper", "runs here on", "CPU (--device cpu)"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string msg = error_of(c.opt, c.sys);
    EXPECT_HAS(msg, kBackendFlag);
    for (const std::string& w : c.words) EXPECT_HAS(msg, w);
  }
  // Where CUDNN fp8 cannot run it is not offered; on sm_80 only the CPU runs fp8.
  const std::string msg = error_of({.backend = "CUDNN", .dtype = "fp8"}, a100());
  EXPECT_EQ(msg.find("CUDNN (--device cuda)"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("FOVEA (--device cuda)"), std::string::npos) << msg;
}

// ---- the scale book an engine runs with ------------------------------------------------------------

TEST(ScaleBookFromEngine, FollowsTheScaleMode) {
  TempDir dir;
  const SystemInfo sys = no_gpu();
  EXPECT_EQ(make_scale_book(resolve_engine({.dtype = "fp8"}, sys), 2).mode(), ScaleMode::DYNAMIC);
  const auto cal = make_scale_book(resolve_engine({.dtype = "fp8", .scale_save_path = dir.file("s.json")}, sys), 3);
  EXPECT_EQ(cal.mode(), ScaleMode::CALIBRATE);
  EXPECT_EQ(cal.save_path(), dir.file("s.json"));
  const std::string file = dir.write("scales.json", kValidScales);
  const auto st = make_scale_book(resolve_engine({.dtype = "fp8", .scale_path = file}, sys), 2);
  EXPECT_EQ(st.mode(), ScaleMode::STATIC);
  EXPECT_EQ(st.scales(1), (QkvScales{1, 2, 4}));
  // The file has layers 0 and 1: a 3-layer model is an error naming the file and the missing layer.
  const std::string e =
      fovea::test::error_of([&] { make_scale_book(resolve_engine({.dtype = "fp8", .scale_path = file}, sys), 3); });
  EXPECT_HAS(e, file);
  EXPECT_HAS(e, "visual.blocks.2.attn.attn");
  EXPECT_HAS(fovea::test::error_of([&] { make_scale_book(resolve_engine({}, sys), 2); }), "bf16");
}

// A build without cuDNN has no CUDNN backend: AUTO on a non-Hopper GPU is then an error that names
// what runs, not a silent pick of a missing backend.
TEST(ResolveEngineErrors, CudnnBackendMissingFromTheBuild) {
  SystemInfo sys = a100();
  sys.cudnn_built = false;
  const std::string msg = error_of({}, sys);
  EXPECT_HAS(msg, "built without cuDNN");
  EXPECT_HAS(msg, "CPU (--device cpu)");
  EXPECT_EQ(resolve_engine({.device = "cpu"}, sys).backend, AttnBackend::CPU);
}

// AUTO is one rule for the engine and the C ABI (best_backend): the CPU there; FOVEA on Hopper
// (unless its kernels lack the head size: then CUDNN for BF16); CUDNN for BF16 elsewhere; FP8 is
// FOVEA's alone, wherever asked.
TEST(ResolveEngine, BestBackendIsOneRule) {
  EXPECT_EQ(best_backend(AttnDtype::FP8, Device::CPU, h200()), AttnBackend::CPU);
  EXPECT_EQ(best_backend(AttnDtype::BF16, Device::CUDA, h200()), AttnBackend::FOVEA);
  EXPECT_EQ(best_backend(AttnDtype::BF16, Device::CUDA, h200(), false), AttnBackend::CUDNN);
  EXPECT_EQ(best_backend(AttnDtype::FP8, Device::CUDA, h200(), false), AttnBackend::FOVEA);
  EXPECT_EQ(best_backend(AttnDtype::BF16, Device::CUDA, a100()), AttnBackend::CUDNN);
  EXPECT_EQ(best_backend(AttnDtype::FP8, Device::CUDA, a100()), AttnBackend::FOVEA);
  for (const char* dtype : {"bf16", "fp8"})
    for (const SystemInfo& sys : {h200(), a100()}) {
      const EngineOptions o{.dtype = dtype, .device = "cuda"};
      const AttnBackend want =
          best_backend(dtype == std::string("fp8") ? AttnDtype::FP8 : AttnDtype::BF16, Device::CUDA, sys);
      if (!backend_unsupported(want, dtype == std::string("fp8") ? AttnDtype::FP8 : AttnDtype::BF16, Device::CUDA, sys))
        EXPECT_EQ(resolve_engine(o, sys).backend, want) << dtype << " on " << sys.gpus[0].name;
    }
}

// ---- encoder CUDA graphs (--compilation-config) ------------------------------------------------------

TEST(GraphConfig, BudgetsFromVllmsKeys) {
  using qwen3vl::GraphBudgets;
  EXPECT_FALSE(parse_graph_config("{}").on());
  EXPECT_FALSE(parse_graph_config(R"({"cudagraph_mm_encoder": false, "encoder_cudagraph_token_budgets": [64]})").on());
  const GraphBudgets d = parse_graph_config(R"({"cudagraph_mm_encoder": true})");
  EXPECT_EQ(d.tokens,
            std::vector<int64_t>(std::begin(qwen3vl::kDefaultGraphBudgets), std::end(qwen3vl::kDefaultGraphBudgets)));
  EXPECT_EQ(d.max_items, qwen3vl::kDefaultGraphItems);
  std::vector<std::string> ignored;
  const GraphBudgets g = parse_graph_config(
      R"({"mode": 3, "cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": [4096, 1024, 4096, 2048],
          "encoder_cudagraph_max_vision_items_per_batch": 4, "cudagraph_capture_sizes": [1, 2]})",
      &ignored);
  EXPECT_EQ(g.tokens, (std::vector<int64_t>{1024, 2048, 4096}));  // sorted, duplicates dropped
  EXPECT_EQ(g.max_items, 4);
  EXPECT_EQ(ignored, (std::vector<std::string>{"cudagraph_capture_sizes", "mode"}));
  // The smallest budget that holds the batch's merged tokens, if its segments fit.
  EXPECT_EQ(g.pick(1, 1), 0);
  EXPECT_EQ(g.pick(1024, 4), 0);
  EXPECT_EQ(g.pick(1025, 4), 1);
  EXPECT_EQ(g.pick(4096, 1), 2);
  EXPECT_EQ(g.pick(4097, 1), -1);
  EXPECT_EQ(g.pick(10, 5), -1);
}

TEST(GraphConfig, MalformedValuesNameTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[1, 2]", "JSON object"},
      {"{\"cudagraph_mm_encoder\": ", "not valid JSON"},
      {R"({"cudagraph_mm_encoder": 1})", "cudagraph_mm_encoder"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": 1024})", "encoder_cudagraph_token_budgets"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": [0]})", "encoder_cudagraph_token_budgets"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": [1.5]})",
       "encoder_cudagraph_token_budgets"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": [1048577]})", "1048576"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": ["64"]})",
       "encoder_cudagraph_token_budgets"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_max_vision_items_per_batch": -1})",
       "encoder_cudagraph_max_vision_items_per_batch"},
      {R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_max_vision_items_per_batch": 5000})",
       "encoder_cudagraph_max_vision_items_per_batch"},
  };
  for (const auto& c : cases) {  // not a structured binding: clang's lambdas cannot capture one
    SCOPED_TRACE(c.first);
    const std::string msg = fovea::test::error_of([&] { parse_graph_config(c.first); });
    EXPECT_HAS(msg, "--compilation-config");
    EXPECT_HAS(msg, c.second);
  }
  std::string many = R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": [)";
  for (int k = 1; k <= 33; ++k) many += std::to_string(k) + (k < 33 ? "," : "]}");
  EXPECT_HAS(fovea::test::error_of([&] { parse_graph_config(many); }), "at most 32");
}

TEST(GraphConfig, ResolvedOnlyForTheFoveaBackendOnAGpu) {
  const std::string on = R"({"cudagraph_mm_encoder": true, "encoder_cudagraph_token_budgets": [512]})";
  const EngineConfig cfg = resolve_engine({.compilation_config = on}, h200());
  EXPECT_EQ(cfg.backend, AttnBackend::FOVEA);
  EXPECT_EQ(cfg.graphs.tokens, std::vector<int64_t>{512});
  EXPECT_FALSE(resolve_engine({.compilation_config = R"({"cudagraph_mm_encoder": false})"}, no_gpu()).graphs.on());
  for (const auto& [opt, sys] :
       std::vector<std::pair<EngineOptions, SystemInfo>>{{{.compilation_config = on}, no_gpu()},
                                                         {{.backend = "CUDNN", .compilation_config = on}, h200()},
                                                         {{.compilation_config = on}, a100()}}) {
    const std::string msg = error_of(opt, sys);
    EXPECT_HAS(msg, "--compilation-config");
    EXPECT_HAS(msg, "FOVEA");
  }
}
