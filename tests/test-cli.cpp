// Tests of the fovea command (docs/architecture.md §Engine configuration): scales inspect, info with the engine flags
// and their option errors (docs/fp8.md §Engine options), and bench attention on the CPU. Runs the built binary
// (FOVEA_BIN).
#include <sys/stat.h>
#include <sys/wait.h>

#include "image-encode.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fovea/safetensors.h"
#include "fovea/video.h"
#include "fovea/model.h"
#include "fovea/sha256.h"
#include "test-util.h"
#include <nlohmann/json.hpp>

#include "fovea/scales.h"

namespace fs = std::filesystem;

using fovea::test::slurp;

namespace {

std::vector<std::string> split_ws(const std::string& line) {
  std::istringstream ss(line);
  std::vector<std::string> out;
  for (std::string w; ss >> w;) out.push_back(w);
  return out;
}

struct Result {
  int code = -1;
  std::string out, err;
};

// Each test gets a scratch folder: work/ for its files, io/ for the captured stdout and stderr.
class Cli : public ::testing::Test {
 protected:
  fs::path root, work, io;

  void SetUp() override {
    const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
    root = fs::path(FOVEA_TEST_TMP) / (std::string("cli.") + t->test_suite_name() + "." + t->name());
    work = root / "work";
    io = root / "io";
    fs::remove_all(root);
    fs::create_directories(work);
    fs::create_directories(io);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root, ec);
  }

  // Runs `fovea ARGS` (ARGS is shell text); returns the exit code, stdout and stderr.
  Result run(const std::string& args) const { return run_with("", args); }
  // `timeout SECONDS fovea ARGS`: a command that hangs exits 124 instead.
  Result run_within(int seconds, const std::string& args) const {
    return run_with("timeout " + std::to_string(seconds) + " ", args);
  }
  Result run_with(const std::string& prefix, const std::string& args) const {
    const fs::path out = io / "stdout", err = io / "stderr";
    const std::string cmd =
        prefix + "'" + FOVEA_BIN + "' " + args + " >'" + out.string() + "' 2>'" + err.string() + "'";
    const int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }
  std::string file(const std::string& name) const { return (work / name).string(); }
  // A small RGB PNG of w x h with a fixed pattern, written as `name`; returns its path.
  std::string png(const std::string& name, int w, int h, int mul, int mod) const {
    std::vector<uint8_t> rgb(size_t(w) * h * 3);
    for (size_t k = 0; k < rgb.size(); ++k) rgb[k] = uint8_t((k * size_t(mul)) % size_t(mod));
    const std::vector<uint8_t> bytes = fovea::test::encode_png_rgb(w, h, rgb);
    return write(name, std::string(bytes.begin(), bytes.end()));
  }
  // `fovea info ARGS` succeeds and prints `text`.
  void info_prints(const std::string& args, const std::string& text) const {
    const Result r = run("info " + args);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_HAS(r.out, text);
  }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(work / name) << text;
    return file(name);
  }
  std::vector<std::string> list_work() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(work)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

std::string q(const std::string& s) { return "'" + s + "'"; }

// A fovea::Error reaches the user as one line on stderr: "fovea: error: ...", exit code 1.
void expect_one_line_error(const Result& r, const std::string& must_name) {
  EXPECT_EQ(r.code, 1) << "stderr: " << r.err;
  EXPECT_EQ(r.err.rfind("fovea: error: ", 0), 0u) << "stderr: " << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr: " << r.err;
  EXPECT_HAS(r.err, must_name);
}

std::string layer(int i) { return "visual.blocks." + std::to_string(i) + ".attn.attn"; }

}  // namespace

// ---- fovea scales inspect ----------------------------------------------------------------------------

TEST_F(Cli, ScalesInspectPrintsEveryLayerAndTheImpliedAmax) {
  const std::vector<std::array<double, 3>> scales = {{0.5, 0.25, 2.0}, {0.0123, 1.0 / 448, 0.001}, {3.0, 0.125, 0.75}};
  std::string text = "{";
  for (size_t i = 0; i < scales.size(); ++i)
    text += (i ? ", \"" : "\"") + layer(int(i)) + "\": {\"q\": " + nlohmann::json(scales[i][0]).dump() +
            ", \"k_scale\": " + nlohmann::json(scales[i][1]).dump() +
            ", \"v\": " + nlohmann::json(scales[i][2]).dump() + "}";
  const std::string path = write("s.json", text + "}");

  const Result r = run("scales inspect " + q(path));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_HAS(r.out, path);
  // Each layer's line: index, name, 3 scales, 3 amax (= scale x 448).
  std::vector<std::vector<std::string>> rows(scales.size());
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);)
    for (size_t i = 0; i < scales.size(); ++i)
      if (line.find(layer(int(i))) != std::string::npos) rows[i] = split_ws(line);
  for (size_t i = 0; i < scales.size(); ++i) {
    SCOPED_TRACE(layer(int(i)));
    ASSERT_EQ(rows[i].size(), 8u) << r.out;
    EXPECT_EQ(rows[i][0], std::to_string(i));
    for (size_t t = 0; t < 3; ++t) {
      const double s = scales[i][t];
      EXPECT_NEAR(std::stod(rows[i][2 + t]), s, 1e-5 * s) << rows[i][2 + t];
      EXPECT_NEAR(std::stod(rows[i][5 + t]), s * 448, 1e-3 * s * 448) << rows[i][5 + t];
    }
  }
  EXPECT_EQ(rows[0][5], "224");  // 0.5 x 448
  EXPECT_EQ(rows[0][7], "896");  // 2 x 448
}

TEST_F(Cli, ScalesInspectNumLayers) {
  std::string text = "{";
  for (int i = 0; i < 3; ++i) text += (i ? ", \"" : "\"") + layer(i) + "\": {\"q\": 1, \"k\": 1, \"v\": 1}";
  const std::string path = write("three.json", text + "}");
  EXPECT_EQ(run("scales inspect " + q(path) + " --num-layers 3").code, 0);
  EXPECT_EQ(run("scales inspect " + q(path) + " --num-layers 1").code, 0);
  const Result r = run("scales inspect " + q(path) + " --num-layers 4");
  expect_one_line_error(r, layer(3));
  EXPECT_HAS(r.err, path);
}

TEST_F(Cli, ScalesInspectInvalidFilesAreOneLineErrorsNamingTheFile) {
  fs::create_directory(work / "folder.json");
  const std::vector<std::string> files = {
      write("bad-json.json", "{\n  \"" + layer(0) + "\": {\"q\": 1,, \"k\": 1, \"v\": 1}\n}\n"),
      write("missing-k.json", "{\"" + layer(0) + "\": {\"q\": 1, \"v\": 1}}"),
      write("zero.json", "{\"" + layer(0) + "\": {\"q\": 0, \"k\": 1, \"v\": 1}}"),
      write("array.json", "[1, 2, 3]"),
      write("not-object.json", "{\"" + layer(0) + "\": 0.5}"),
      file("absent.json"),
      file("folder.json"),
  };
  for (const std::string& f : files) {
    SCOPED_TRACE(f);
    const Result r = run("scales inspect " + q(f));
    expect_one_line_error(r, f);
    EXPECT_EQ(r.out, "");  // nothing half-printed
  }
}

TEST_F(Cli, ScalesInspectWithoutFileFails) {
  const Result r = run("scales inspect");
  EXPECT_NE(r.code, 0);
  EXPECT_HAS(r.err, "FILE");
}

// ---- fovea info --------------------------------------------------------------------------------------

TEST_F(Cli, InfoShowsTheEngine) {
  const Result r = run("info");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "fovea");
  EXPECT_HAS(r.out, "engine:");
  if (r.out.find("GPUs: none") != std::string::npos) {
    EXPECT_HAS(r.out, "backend: CPU");
  } else {  // a machine with a GPU
    EXPECT_TRUE(r.out.find("backend: FOVEA") != std::string::npos || r.out.find("backend: CUDNN") != std::string::npos)
        << r.out;
  }
  const Result cpu = run("info --device cpu --mm-encoder-attn-dtype fp8");
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  EXPECT_HAS(cpu.out, "backend: CPU");
  EXPECT_HAS(cpu.out, "fp8");
  EXPECT_HAS(cpu.out, "dynamic");
}

// --fp8-linears (fovea's own flag): shown by info, and encode runs its emulation on the CPU, whose
// tokens differ from the plain forward's (but not by much).
TEST_F(Cli, Fp8LinearsFlag) {
  info_prints("--device cpu", "linears: bf16");
  info_prints("--device cpu --fp8-linears", "linears: fp8");
  const std::string img = png("lin.png", 64, 48, 11, 253);
  const Result a =
      run("encode synthetic:tiny --device cpu --output-dtype f32 " + q(img) + " -o " + q(file("a.safetensors")));
  ASSERT_EQ(a.code, 0) << a.err;
  const Result b = run("encode synthetic:tiny --device cpu --output-dtype f32 --fp8-linears " + q(img) + " -o " +
                       q(file("b.safetensors")));
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_HAS(b.out, "fp8 linears");
  const auto ca = fovea::Checkpoint::open(file("a.safetensors")), cb = fovea::Checkpoint::open(file("b.safetensors"));
  ASSERT_NE(ca.find("image.0.embeddings"), nullptr);
  ASSERT_NE(cb.find("image.0.embeddings"), nullptr);
  const std::vector<float> ya = ca.find("image.0.embeddings")->to_float(),
                           yb = cb.find("image.0.embeddings")->to_float();
  ASSERT_EQ(ya.size(), yb.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ya.size(); ++i) num += (ya[i] - yb[i]) * (ya[i] - yb[i]), den += ya[i] * ya[i];
  EXPECT_GT(std::sqrt(num / den), 1e-4);
  EXPECT_LT(std::sqrt(num / den), 0.2);
}

// --dump-dir: the CPU forward's intermediates, named as transformers' modules, consistent with each
// other (a block's output is its input plus its attention and MLP outputs, in that order) and with
// the tokens written beside them; the pixels and grid to rerun them. Not with the encoder cache.
TEST_F(Cli, DumpDirWritesTheIntermediates) {
  const std::string img = png("dump.png", 64, 48, 13, 251);
  const std::string dir = file("dump");
  const Result r = run("encode synthetic:tiny --device cpu --output-dtype f32 --dump-dir " + q(dir) + " " + q(img) +
                       " -o " + q(file("out.safetensors")));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "intermediates of the CPU forward");
  const auto d = fovea::Checkpoint::open(dir + "/intermediates.safetensors");
  auto values = [&](const std::string& name) {
    const fovea::TensorInfo* t = d.find(name);
    EXPECT_NE(t, nullptr) << name;
    return t ? t->to_float() : std::vector<float>{};
  };
  const auto cfg = *fovea::qwen3vl::synthetic_config("synthetic:tiny");
  ASSERT_EQ(d.find("grid_thw")->shape, (std::vector<int64_t>{1, 3}));
  const std::vector<float> grid = values("grid_thw");
  const int64_t n = int64_t(grid[0] * grid[1] * grid[2]);
  EXPECT_EQ(d.find("pixel_values")->shape, (std::vector<int64_t>{n, cfg.patch_dim()}));
  EXPECT_EQ(d.find("patch_embed")->shape, (std::vector<int64_t>{n, cfg.hidden}));
  std::vector<float> x = values("embed");
  for (int l = 0; l < cfg.depth; ++l) {
    const std::string b = "blocks." + std::to_string(l);
    const std::vector<float> attn = values(b + ".attn"), mlp = values(b + ".mlp"), out = values(b);
    ASSERT_EQ(attn.size(), x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = (x[i] + attn[i]) + mlp[i];
    EXPECT_EQ(x, out) << b;
  }
  const auto o = fovea::Checkpoint::open(file("out.safetensors"));
  EXPECT_EQ(values("merger"), o.find("image.0.embeddings")->to_float());
  for (size_t k = 0; k < cfg.deepstack.size(); ++k)
    EXPECT_EQ(values("deepstack_merger_list." + std::to_string(k)),
              o.find("image.0.deepstack." + std::to_string(k))->to_float());
  const Result both = run("encode synthetic:tiny --device cpu --dump-dir " + q(dir) + " --ec-storage-path " +
                          q(file("ec")) + " " + q(img));
  EXPECT_NE(both.code, 0);
  EXPECT_HAS(both.err, "without --ec-storage-path");
}

// A scale file with fovea's fine scales: inspect shows them; an engine that runs per-tensor scales
// uses the file's q/k/v and says the fine ones are not used.
TEST_F(Cli, ScaleFileWithFineScales) {
  auto layer_entry = [](int i) {
    return "\"" + layer(i) +
           "\": {\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_q_head\": [0.5, 0.25], "
           "\"fovea_k_head\": [2, 4], \"fovea_v_channel\": [1, 2, 3, 4], \"fovea_k_mean\": [0, 1, -1, 0.5]}";
  };
  std::string with_split = layer_entry(1);  // head_dim 2: one pair a head, room for it
  with_split.insert(with_split.size() - 1, ", \"fovea_qk_split\": [0, -1], \"fovea_robust_gain\": 7.5");
  const std::string path = write("fine.json", "{" + layer_entry(0) + ", " + with_split + "}");
  const Result r = run("scales inspect " + q(path));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "2 heads, 4 V channels");
  EXPECT_HAS(r.out, "q_head 0.25..0.5");
  EXPECT_HAS(r.out, "split pairs -      robust gain -\n");
  EXPECT_HAS(r.out, "split pairs 1/2    robust gain 7.5 (outliers: robust under auto)\n");
  EXPECT_HAS(r.out, "auto runs it on the 1 layer(s) at 2 or more");
  // auto runs robust on layer 1 only; forced tensor warns that the fine scales go unused.
  info_prints("--device cpu --mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path " + q(path),
              "robust on some layers, tensor on the rest");
  const Result info =
      run("info --device cpu --mm-encoder-attn-dtype fp8 --fp8-scheme tensor --mm-encoder-fp8-scale-path " + q(path));
  ASSERT_EQ(info.code, 0) << info.err;
  EXPECT_HAS(info.out, "static, 2 layers");
  EXPECT_HAS(info.err, "fine scales");
  const std::string newer =
      write("newer.json", "{\"" + layer(0) + "\": {\"q\": 1, \"k\": 1, \"v\": 1, \"fovea_rotation\": 1}}");
  const Result bad = run("info --device cpu --mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path " + q(newer));
  EXPECT_NE(bad.code, 0);
  EXPECT_HAS(bad.err, "fovea_rotation");
}

// The static guard: a scale file whose range the inputs pass (scales of 1e-9) runs those tensors at
// the batch's scale and says so once, naming the counts; scales that cover them say nothing.
TEST_F(Cli, EncodeReportsTheStaticGuard) {
  auto scales = [&](const std::string& name, const char* value) {
    std::string text = "{";
    for (int i = 0; i < 3; ++i)
      text += std::string(i ? ", " : "") + "\"" + layer(i) + "\": {\"q\": " + value + ", \"k\": " + value +
              ", \"v\": " + value + "}";
    return write(name, text + "}");
  };
  const std::string img = png("guard.png", 48, 64, 3, 77);
  const std::string base =
      "encode synthetic:tiny --device cpu --mm-encoder-attn-dtype fp8 " + q(img) + " --mm-encoder-fp8-scale-path ";
  const Result low = run(base + q(scales("low.json", "1e-9")));
  ASSERT_EQ(low.code, 0) << low.err;
  EXPECT_HAS(low.err, "the static FP8 scales' range was passed 9 times (q 3, k 3, v 3; layers x forwards)");
  EXPECT_HAS(low.err, "recalibrate");
  const Result high = run(base + q(scales("high.json", "1000")));
  ASSERT_EQ(high.code, 0) << high.err;
  EXPECT_EQ(high.err.find("range was passed"), std::string::npos) << high.err;
}

// --fp8-scheme (fovea's own): info shows the scheme; encode runs the robust one on the CPU.
TEST_F(Cli, Fp8SchemeFlag) {
  info_prints("--device cpu --mm-encoder-attn-dtype fp8", "scheme:  tensor");
  info_prints("--device cpu --mm-encoder-attn-dtype fp8 --fp8-scheme robust", "scheme:  robust");
  const Result bad = run("info --device cpu --fp8-scheme robust");
  EXPECT_NE(bad.code, 0);
  EXPECT_HAS(bad.err, "--fp8-scheme robust needs --mm-encoder-attn-dtype fp8");
  const std::string img = png("robust.png", 48, 64, 5, 241);
  const Result enc = run("encode synthetic:tiny --device cpu --mm-encoder-attn-dtype fp8 --fp8-scheme robust " +
                         q(img) + " -o " + q(file("r.safetensors")));
  ASSERT_EQ(enc.code, 0) << enc.err;
  EXPECT_TRUE(fs::exists(file("r.safetensors")));
  // Calibration with the robust scheme writes the fine scales; static robust FP8 then runs from them.
  const std::string base =
      "bench mm-processor --model synthetic:tiny --dataset-name random-mm --random-mm-size 64x96 "
      "--device cpu --mm-encoder-attn-dtype fp8 --fp8-scheme robust ";
  const std::string cal = file("robust.json");
  const Result c = run(base + "--num-warmups 6 --num-prompts 10 --mm-encoder-fp8-scale-save-path " + q(cal));
  ASSERT_EQ(c.code, 0) << c.err;
  const fovea::ScaleFile f = fovea::read_scale_file(cal);
  ASSERT_EQ(f.fine.size(), 3u);
  EXPECT_EQ(f.fine.at(0).q_head.size(), 4u);  // synthetic:tiny: 4 heads of 16
  EXPECT_EQ(f.fine.at(2).k_mean.size(), 64u);
  EXPECT_EQ(f.fine.at(2).qk_split.size(), 16u);  // head_dim 16: room for 4 of its 8 pairs a head
  EXPECT_TRUE(
      std::any_of(f.fine.at(2).qk_split.begin(), f.fine.at(2).qk_split.end(), [](int32_t p) { return p >= 0; }));
  const Result st = run(base + "--num-warmups 0 --num-prompts 2 --mm-encoder-fp8-scale-path " + q(cal));
  EXPECT_EQ(st.code, 0) << st.err;
  EXPECT_HAS(st.out, "static");
  // auto calibrates with the robust scheme, so its file says which layers need it.
  const std::string autocal = file("auto.json");
  const std::string base_auto =
      "bench mm-processor --model synthetic:tiny --dataset-name random-mm --random-mm-size 64x96 "
      "--device cpu --mm-encoder-attn-dtype fp8 ";
  const Result ca = run(base_auto + "--num-warmups 6 --num-prompts 10 --mm-encoder-fp8-scale-save-path " + q(autocal));
  ASSERT_EQ(ca.code, 0) << ca.err;
  const fovea::ScaleFile fa = fovea::read_scale_file(autocal);
  ASSERT_EQ(fa.fine.size(), 3u);
  for (const auto& [l, fine] : fa.fine) EXPECT_GT(fine.robust_gain, 0.0f) << "layer " << l;
  const Result ia = run("scales inspect " + q(autocal));
  ASSERT_EQ(ia.code, 0) << ia.err;
  EXPECT_HAS(ia.out, "robust gain ");
}

TEST_F(Cli, InfoWithStaticScales) {
  const std::string path = write("s.json", "{\"layers\": {\"" + layer(0) + "\": {\"q\": 1, \"k\": 1, \"v\": 1}, \"" +
                                               layer(1) + "\": {\"q\": 1, \"k\": 1, \"v\": 1}}}");
  const Result r = run("info --device cpu --mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path " + q(path));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "static, 2 layers");
  EXPECT_HAS(r.out, path);
}

TEST_F(Cli, InfoOptionErrorsNameTheOption) {
  const std::string scales = write("s.json", "{\"" + layer(0) + "\": {\"q\": 1, \"k\": 1, \"v\": 1}}");
  const std::string bad = write("bad.json", "{\"" + layer(0) + "\": {\"q\": 1, \"k\": 1}}");
  const std::string save = file("out.json");
  fs::create_directory(work / "folder");
  const std::string fp8 = "--device cpu --mm-encoder-attn-dtype fp8 ";
  const std::string save_flag = "--mm-encoder-fp8-scale-save-path ";
  const std::string scale_flag = "--mm-encoder-fp8-scale-path ";
  struct Case {
    std::string args;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {scale_flag + q(scales), {"--mm-encoder-fp8-scale-path", "--mm-encoder-attn-dtype"}},
      {save_flag + q(save), {"--mm-encoder-fp8-scale-save-path", "--mm-encoder-attn-dtype"}},
      {fp8 + scale_flag + q(scales) + " " + save_flag + q(save),
       {"--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-path"}},
      {fp8 + save_flag + q(file("missing/out.json")), {"--mm-encoder-fp8-scale-save-path", file("missing")}},
      {fp8 + save_flag + q(file("folder")), {"--mm-encoder-fp8-scale-save-path", "folder"}},
      {fp8 + save_flag + q(save) + " --mm-encoder-fp8-scale-save-margin 0", {"--mm-encoder-fp8-scale-save-margin"}},
      {fp8 + save_flag + q(save) + " --mm-encoder-fp8-scale-save-margin=-1", {"--mm-encoder-fp8-scale-save-margin"}},
      {fp8 + scale_flag + q(bad), {"--mm-encoder-fp8-scale-path", bad, layer(0)}},
      {"--mm-encoder-attn-backend NOPE", {"--mm-encoder-attn-backend", "NOPE"}},
      {"--mm-encoder-attn-dtype int4", {"--mm-encoder-attn-dtype", "int4"}},
      {"--device tpu", {"--device", "tpu"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const Result r = run("info " + c.args);
    expect_one_line_error(r, c.words[0]);
    for (const std::string& w : c.words) EXPECT_HAS(r.err, w);
  }
  EXPECT_EQ(list_work(), (std::vector<std::string>{"bad.json", "folder", "s.json"}));  // nothing written
}

// ---- fovea bench attention ---------------------------------------------------------------------------

TEST_F(Cli, BenchAttentionWritesJsonWithSensibleErrors) {
  for (const std::string dist : {"normal", "outliers"}) {
    SCOPED_TRACE(dist);
    const std::string json_path = file("bench-" + dist + ".json");
    const Result r = run("bench attention --device cpu --seqlens 1,7,64,129 --heads 2 --head-dim 64 --dist " + dist +
                         " --json " + q(json_path));
    ASSERT_EQ(r.code, 0) << r.err;
    nlohmann::json doc;
    ASSERT_NO_THROW(doc = nlohmann::json::parse(slurp(json_path))) << slurp(json_path);
    EXPECT_EQ(doc.at("seqlens"), nlohmann::json({1, 7, 64, 129}));
    EXPECT_EQ(doc.at("heads"), 2);
    EXPECT_EQ(doc.at("head_dim"), 64);
    double rel[2] = {NAN, NAN};  // bf16, fp8
    ASSERT_TRUE(doc.at("results").is_array());
    for (const auto& res : doc.at("results")) {
      const std::string dtype = res.at("dtype");
      ASSERT_TRUE(dtype == "bf16" || dtype == "fp8") << dtype;
      ASSERT_TRUE(res.at("rel_l2").is_number()) << res.dump();  // non-finite is written as null
      rel[dtype == "fp8"] = res.at("rel_l2").get<double>();
      EXPECT_EQ(res.at("nonfinite"), 0);
    }
    ASSERT_TRUE(std::isfinite(rel[0]) && std::isfinite(rel[1])) << doc.dump(2);
    EXPECT_GT(rel[0], 0.0);
    EXPECT_LT(rel[0], 1e-2);
    EXPECT_LT(rel[0], rel[1]);
    EXPECT_LT(rel[1], 0.1);
  }
}

// The FP8 scale schemes of the CPU emulation: one row each, in order, with the scheme named; the
// robust one beats per-tensor scales on outlier channels; unknown names and GPU runs of a scheme the
// kernels lack are one-line errors.
TEST_F(Cli, BenchAttentionComparesFp8Schemes) {
  const std::string json_path = file("schemes.json");
  const Result r =
      run("bench attention --device cpu --seqlens 200,57 --heads 4 --head-dim 72 --dist channels "
          "--dtype fp8 --fp8-scheme tensor,robust-nosplit,robust+rotate,robust --json " +
          q(json_path));
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json doc = nlohmann::json::parse(slurp(json_path));
  ASSERT_EQ(doc.at("results").size(), 4u) << doc.dump(2);
  std::vector<double> rel;
  for (const auto& res : doc.at("results")) rel.push_back(res.at("rel_l2").get<double>());
  EXPECT_EQ(doc.at("results")[0].at("fp8_scheme"), "tensor");
  EXPECT_EQ(doc.at("results")[2].at("fp8_scheme"), "robust+rotate");
  EXPECT_EQ(doc.at("results")[3].at("fp8_scheme"), "robust");
  EXPECT_EQ(doc.at("dist"), "channels");
  EXPECT_HAS(r.out, "robust+rotate");
  // Seeds 0-3 (2026-12-04): tensor 0.66-1.13, robust-nosplit 0.11-0.18, robust+rotate 0.047-0.089,
  // robust (its split pairs) 0.019-0.027.
  EXPECT_LT(rel[1], rel[0] / 1.5);
  EXPECT_LT(rel[2], rel[1]);
  EXPECT_LT(rel[3], rel[2]);
  expect_one_line_error(
      run("bench attention --device cpu --seqlens 8 --heads 1 --head-dim 8 --fp8-scheme tensor,hadamard"),
      "--fp8-scheme");
  expect_one_line_error(run("bench attention --device cpu --seqlens 8 --heads 1 --head-dim 8 --dist spiky"), "--dist");
  // The GPU runs tensor and robust only: another scheme is refused before any GPU is looked for.
  expect_one_line_error(
      run("bench attention --device cuda --seqlens 8 --heads 1 --head-dim 72 --fp8-scheme robust,rotate"),
      "--fp8-scheme rotate");
  // --fp8-exact (the emulation's operands left unquantized): CPU only, named operands only; recorded.
  expect_one_line_error(run("bench attention --device cpu --seqlens 8 --heads 1 --head-dim 8 --fp8-exact qk,w"),
                        "--fp8-exact");
  expect_one_line_error(run("bench attention --device cuda --seqlens 8 --heads 1 --head-dim 72 --fp8-exact p"),
                        "--fp8-exact");
  const std::string ej = file("exact.json");
  ASSERT_EQ(run("bench attention --device cpu --seqlens 64 --heads 2 --head-dim 8 --dtype fp8 --fp8-exact p,v --json " +
                q(ej))
                .code,
            0);
  std::ifstream ef(ej);
  EXPECT_HAS(std::string(std::istreambuf_iterator<char>(ef), {}), "\"fp8_exact\": \"p,v\"");
}

TEST_F(Cli, BenchAttentionRejectsBadSeqlens) {
  for (const std::string s : {"0", "3,x", "-4", "8,,8"}) {
    SCOPED_TRACE(s);
    const Result r = run("bench attention --device cpu --heads 1 --head-dim 8 --seqlens " + q(s));
    expect_one_line_error(r, "--seqlens");
  }
}

TEST_F(Cli, BenchAttentionJsonIntoAMissingFolderFailsAndLeavesNothing) {
  const std::string json_path = file("missing/b.json");
  const Result r = run("bench attention --device cpu --seqlens 4 --heads 1 --head-dim 8 --json " + q(json_path));
  EXPECT_NE(r.code, 0);
  EXPECT_HAS(r.err, "--json");
  EXPECT_HAS(r.err, json_path);
  EXPECT_TRUE(list_work().empty()) << ::testing::PrintToString(list_work());
}

// --device cuda: on a machine without a Hopper GPU (CI) a one-line error naming the option; where
// one is visible, the GPU table with an error column checked against fp64.
TEST_F(Cli, BenchAttentionCuda) {
  const Result info = run("info");
  ASSERT_EQ(info.code, 0) << info.err;
  const bool hopper = info.out.find("sm_90") != std::string::npos;
  const std::string json = file("gpu.json");
  const Result r =
      run("bench attention --device cuda --seqlens 5,300 --heads 2 --head-dim 72 --reps 2 --json '" + json + "'");
  if (!hopper) {
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.err.find("--device cuda"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(json));
    return;
  }
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(slurp(json));
  ASSERT_EQ(doc["results"].size(), 2u);
  for (const auto& e : doc["results"]) {
    ASSERT_TRUE(e["rel_l2"].is_number()) << e.dump();
    EXPECT_LT(e["rel_l2"].get<double>(), e["dtype"] == "fp8" ? 0.1 : 1e-2) << e.dump();
    EXPECT_GT(e["attn_ms"].get<double>(), 0.0);
  }
}

// check-golden on the tiny golden model (CPU): reports every output's error against transformers.
TEST_F(Cli, CheckGoldenOnTheCpu) {
  const std::string data = std::string(FOVEA_SOURCE_DIR) + "/tests/data/qwen3vl-tiny";
  const std::string json = file("check.json");
  const Result r =
      run("check-golden '" + data + "' '" + data + "/golden.safetensors' --device cpu --json '" + json + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(slurp(json));
  ASSERT_EQ(doc["outputs"].size(), 3u);  // merged + 2 deepstack
  for (const auto& o : doc["outputs"]) {
    EXPECT_LT(o["rel_l2"].get<double>(), 1e-2) << o.dump();  // BF16-emulated attention vs fp32
    EXPECT_GT(o["rel_l2"].get<double>(), 1e-5) << o.dump();  // ... which really rounds
  }
  // A golden file without the reference outputs: the error names the file and the tensor.
  const Result bad = run("check-golden '" + data + "' '" + data + "/model.safetensors' --device cpu");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("pixel_values"), std::string::npos) << bad.err;
}

// check-golden --require-ratio (issue #4's criterion, here on the CPU on the 2-block 8B golden file,
// which holds transformers' own BF16 outputs): BF16-emulated attention passes at 1.5x transformers
// BF16's error (measured 0.24x); FP8 (measured ~3x) fails at 1.0x naming the outputs; a golden file
// without BF16 outputs is refused before any forward.
TEST_F(Cli, CheckGoldenRequireRatio) {
  const std::string g = std::string(FOVEA_SOURCE_DIR) + "/tests/data/qwen3vl-8b-2blocks/golden.safetensors";
  const std::string json = file("ratio.json");
  const Result ok = run("check-golden synthetic:qwen3-vl-8b-2blocks '" + g +
                        "' --device cpu --require-ratio 1.5 --json '" + json + "'");
  ASSERT_EQ(ok.code, 0) << ok.err;
  // Named, not a range-for over parse(...)["outputs"]: that temporary dies before the loop runs.
  const auto doc = nlohmann::json::parse(slurp(json));
  ASSERT_FALSE(doc["outputs"].empty());
  for (const auto& o : doc["outputs"])
    EXPECT_LT(o["rel_l2"].get<double>(), 0.5 * o["transformers_bf16_rel_l2"].get<double>()) << o.dump();
  const Result over = run("check-golden synthetic:qwen3-vl-8b-2blocks '" + g +
                          "' --device cpu --mm-encoder-attn-dtype fp8 --require-ratio 1.0");
  EXPECT_EQ(over.code, 1);
  EXPECT_NE(over.err.find("exceeds 1 x transformers BF16's on merged"), std::string::npos) << over.err;
  const std::string tiny = std::string(FOVEA_SOURCE_DIR) + "/tests/data/qwen3vl-tiny";
  const Result none =
      run("check-golden '" + tiny + "' '" + tiny + "/golden.safetensors' --device cpu --require-ratio 1.5");
  EXPECT_EQ(none.code, 1);
  EXPECT_NE(none.err.find("needs transformers' BF16 outputs"), std::string::npos) << none.err;
  EXPECT_EQ(none.out.find("output"), std::string::npos) << "no forward before the refusal: " << none.out;
}

// A real clip against transformers (issue 18): tests/data/video/bt709.mp4 through transformers'
// video processor (the checkpoints' budget: grid 2x4x8), packed with a 1x4x4 image, in
// Qwen3VLVisionModel at the 8B shapes cut to two blocks (tools/make-golden.py --video, on the GPU
// machine). fovea's CPU forward on those pixels is within 1.5x transformers BF16's own error
// (measured 0.21-0.24x; the GPU's BF16 0.86-0.87x, bench/RESULTS.md), and the golden's video pixels
// are fovea's own preprocessing of that clip, value for value.
TEST_F(Cli, CheckGoldenOnARealClip) {
  const std::string g = std::string(FOVEA_SOURCE_DIR) + "/tests/data/qwen3vl-8b-2blocks/golden-video.safetensors";
  const std::string json = file("video-ratio.json");
  const Result ok = run("check-golden synthetic:qwen3-vl-8b-2blocks '" + g +
                        "' --device cpu --require-ratio 1.5 --json '" + json + "'");
  ASSERT_EQ(ok.code, 0) << ok.err;
  const auto doc = nlohmann::json::parse(slurp(json));
  ASSERT_EQ(doc["outputs"].size(), 3u);  // merged and the 2-block model's two deepstack outputs
  for (const auto& o : doc["outputs"])
    EXPECT_LT(o["rel_l2"].get<double>(), 0.5 * o["transformers_bf16_rel_l2"].get<double>()) << o.dump();
  const auto golden = fovea::Checkpoint::open(g);
  const fovea::TensorInfo* grid = golden.find("grid_thw");
  const fovea::TensorInfo* px = golden.find("pixel_values");
  ASSERT_TRUE(grid && px);
  EXPECT_EQ(grid->to_float(), (std::vector<float>{2, 4, 8, 1, 4, 4}));
  fovea::video::VideoConfig cfg;  // the checkpoints' video budget
  cfg.min_pixels = 4096;
  cfg.max_pixels = 25165824;
  const std::string clip_file = std::string(FOVEA_SOURCE_DIR) + "/tests/data/video/bt709.mp4", bytes = slurp(clip_file);
  const fovea::video::Clip clip =
      fovea::video::decode_clip({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, clip_file, cfg);
  ASSERT_EQ(clip.patches.pixels.size(), size_t(64) * 1536);
  const std::vector<float> want = px->to_float();
  size_t differ = 0;
  for (size_t i = 0; i < clip.patches.pixels.size(); ++i) differ += clip.patches.pixels[i] != want[i];
  EXPECT_EQ(differ, 0u) << "of " << clip.patches.pixels.size();
}

// bench mm-processor on the CPU: per-stage statistics, and calibration writes the scale file after
// exactly 16 complete forwards with warm-ups counted (15 requests: no file; 16: the file).
TEST_F(Cli, BenchMmProcessorCalibrates) {
  const std::string base =
      "bench mm-processor --model synthetic:tiny --dataset-name random-mm --random-mm-size 64x96 "
      "--device cpu --mm-encoder-attn-dtype fp8 --metric-percentiles 50,99 ";
  const std::string s15 = file("s15.json"), s16 = file("s16.json"), json = file("mm.json");
  const Result r15 = run(base + "--num-warmups 5 --num-prompts 10 --mm-encoder-fp8-scale-save-path '" + s15 + "'");
  ASSERT_EQ(r15.code, 0) << r15.err;
  EXPECT_FALSE(fs::exists(s15)) << "written before the 16th forward";
  const Result r16 = run(base + "--num-warmups 6 --num-prompts 10 --mm-encoder-fp8-scale-save-path '" + s16 +
                         "' --output-json '" + json + "'");
  ASSERT_EQ(r16.code, 0) << r16.err;
  ASSERT_TRUE(fs::exists(s16));
  EXPECT_EQ(fovea::read_scale_file(s16).layers.size(), 3u);  // synthetic:tiny has 3 blocks
  const auto doc = nlohmann::json::parse(slurp(json));
  for (const char* stage : {"decode", "preprocess", "encoder forward", "total"}) {
    ASSERT_TRUE(doc["stages"].contains(stage)) << stage;
    EXPECT_GE(doc["stages"][stage]["p99_ms"].get<double>(), doc["stages"][stage]["p50_ms"].get<double>());
  }
  EXPECT_GT(doc["stages"]["encoder forward"]["mean_ms"].get<double>(), 0.0);
  // The whole forward and its parts under their own keys: the whole is at least its GPU/CPU part.
  EXPECT_GE(doc["stages"]["encoder forward"]["mean_ms"].get<double>(),
            doc["stages"]["encoder.forward"]["mean_ms"].get<double>());
  for (const char* part : {"encoder.plan", "encoder.upload", "encoder.download"})
    EXPECT_TRUE(doc["stages"].contains(part)) << part;
  // Static scales from that file on the same dataset; a bad dataset path is an error naming it.
  const Result st = run(base + "--num-warmups 0 --num-prompts 2 --mm-encoder-fp8-scale-path '" + s16 + "'");
  EXPECT_EQ(st.code, 0) << st.err;
  EXPECT_NE(st.out.find("static"), std::string::npos) << st.out;
  const Result bad =
      run("bench mm-processor --model synthetic:tiny --dataset-name folder --dataset-path /nonexistent --device cpu");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("/nonexistent"), std::string::npos) << bad.err;
}

// bench mm-processor --dataset-name folder with a clip and an image: items in name order, cycling
// (b.png, h264.mp4, b.png, then h264.mp4, b.png, h264.mp4); other files are left out. The tokens are
// known independently: h264.mp4 (36 frames at 12 fps, 160x120) samples 6 frames at synthetic:tiny's
// class-default video config, grid (3, 8, 12) (tests/data/video/cases.json, "h264.mp4.default"):
// 72 tokens; a 256x256 PNG is inside the image budget and a multiple of 32: grid (1, 16, 16), 64 tokens.
TEST_F(Cli, BenchMmProcessorFolderWithClipsAndImages) {
  const fs::path ds = work / "ds";
  fs::create_directories(ds);
  fs::copy_file(fs::path(FOVEA_SOURCE_DIR) / "tests/data/video/h264.mp4", ds / "h264.mp4");
  fs::rename(png("b.png", 256, 256, 7, 251), ds / "b.png");
  std::ofstream(ds / "notes.txt") << "not an input";
  const std::string json = file("mm.json");
  const Result r =
      run("bench mm-processor --model synthetic:tiny --device cpu --dataset-name folder --dataset-path " +
          q(ds.string()) + " --images-per-request 3 --num-warmups 0 --num-prompts 2 --output-json " + q(json));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "(1 images, 1 clips)");
  EXPECT_HAS(r.out,
             "request 1/2: 200 visual tokens | image b.png grid (1, 16, 16) 64 tokens | video h264.mp4 grid (3, 8, 12) "
             "72 tokens | image b.png grid (1, 16, 16) 64 tokens\n");
  EXPECT_HAS(r.out, "request 2/2: 208 visual tokens | video h264.mp4");
  const auto doc = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(doc["decode"], "files");
  ASSERT_EQ(doc["per_request"].size(), 2u);
  EXPECT_EQ(doc["per_request"][0]["tokens"], 200);
  EXPECT_EQ(doc["per_request"][1]["tokens"], 208);
  const auto& clip = doc["per_request"][1]["items"][0];
  EXPECT_EQ(clip["kind"], "video");
  EXPECT_EQ(clip["file"], (ds / "h264.mp4").string());
  EXPECT_EQ(clip["grid_thw"], nlohmann::json::array({3, 8, 12}));
  // The clip's decode and preprocess (Clip::decode_ms, preprocess_ms) are in the stages.
  for (const char* stage : {"decode", "preprocess", "encoder forward", "total"})
    EXPECT_GT(doc["stages"][stage]["mean_ms"].get<double>(), 0.0) << stage;
  EXPECT_GE(doc["stages"]["total"]["mean_ms"].get<double>(), doc["stages"]["decode"]["mean_ms"].get<double>());

  // A folder with neither images nor clips names the folder; a clip that fails names the file.
  const fs::path none = work / "none", bad = work / "bad";
  fs::create_directories(none);
  fs::create_directories(bad);
  std::ofstream(none / "notes.txt") << "not an input";
  std::ofstream(bad / "broken.mp4") << std::string(
                                           "\0\0\0\x18"
                                           "ftypisom",
                                           12)
                                    << std::string(200, 'x');
  const std::string base =
      "bench mm-processor --model synthetic:tiny --device cpu --dataset-name folder --num-prompts 1 "
      "--dataset-path ";
  expect_one_line_error(run(base + q(none.string())), "'" + none.string() + "' has no images");
  expect_one_line_error(run(base + q(bad.string())), "video '" + (bad / "broken.mp4").string() + "'");
}

// random-mm with --random-mm-num-frames > 1: every item a synthetic clip whose sampled frames are
// made in memory (the decode stage). 8 frames at 30 fps: int(8 / 30 * 2) = 0 frames at 2 fps, so
// min_frames = 4 are sampled; the video budget's minimum (131072 pixels over 4 frames of 64x96)
// scales them to 160x224: grid (2, 10, 14), 70 tokens. 30 frames at 10 fps: 3 s, 6 frames, scaled
// to 128x192: grid (3, 8, 12), 72 tokens.
TEST_F(Cli, BenchMmProcessorRandomClips) {
  const std::string base =
      "bench mm-processor --model synthetic:tiny --device cpu --dataset-name random-mm "
      "--random-mm-size 64x96 --num-warmups 1 --num-prompts 2 ";
  const std::string json = file("mm.json");
  Result r = run(base + "--random-mm-num-frames 8 --images-per-request 2 --output-json " + q(json));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "dataset random-mm 64x96, 8 frames at 30 fps");
  EXPECT_HAS(r.out, "decode: generated in memory");
  EXPECT_HAS(r.out,
             "request 1/3 (warm-up): 140 visual tokens | video random grid (2, 10, 14) 70 tokens | video random "
             "grid (2, 10, 14) 70 tokens\n");
  EXPECT_HAS(r.out, "request 3/3: 140 visual tokens");
  const auto doc = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(doc["decode"], "generated in memory");
  EXPECT_EQ(doc["random_mm"]["num_frames"], 8);
  ASSERT_EQ(doc["per_request"].size(), 3u);
  EXPECT_EQ(doc["per_request"][2]["tokens"], 140);
  EXPECT_EQ(doc["per_request"][2]["items"][1]["grid_thw"], nlohmann::json::array({2, 10, 14}));
  EXPECT_GT(doc["stages"]["decode"]["mean_ms"].get<double>(), 0.0) << "the frames' generation";
  r = run(base + "--random-mm-num-frames 30 --random-mm-fps 10");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "request 3/3: 72 visual tokens | video random grid (3, 8, 12) 72 tokens\n");
  // Images as before (--random-mm-num-frames 1, the default), scaled up to the image budget's minimum
  // (65536 pixels): 224x320, grid (1, 14, 20), 70 tokens; no decode stage.
  r = run(base + "--random-mm-num-frames 1 --output-json " + q(json));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "request 3/3: 70 visual tokens | image random grid (1, 14, 20) 70 tokens\n");
  EXPECT_EQ(nlohmann::json::parse(slurp(json))["stages"]["decode"]["mean_ms"].get<double>(), 0.0);
  // Bad values are clear errors; so is a video config that samples too few frames for a clip.
  expect_one_line_error(run(base + "--random-mm-num-frames 0"),
                        "--random-mm-num-frames must be in 1..4096 (1: images), got 0");
  expect_one_line_error(run(base + "--random-mm-num-frames 8 --random-mm-fps 0"),
                        "--random-mm-fps must be in (0, 1000], got 0");
  expect_one_line_error(
      run(base + "--random-mm-num-frames 8 --video-max-frames 1"),
      "random-mm clip of 8 frames of 64x96 at 30 fps: 1 frame(s): a clip needs at least temporal_patch_size = 2");
}

namespace {

// `fovea encode --ec-storage-path`: one file per image under its key (the sha256 of the file's bytes,
// or its file name), whose one tensor "ec_cache" is BF16 [tokens, out_hidden * (1 + deepstack)]:
// columns [0, O) the bits `encode -o` writes as image.0.embeddings, then image.0.deepstack.k, row for
// row; a second run finds them all and encodes nothing; an unreadable image fails alone; the flags'
// errors are clear.
TEST_F(Cli, EncodeFillsVllmsEncoderCache) {
  std::vector<std::string> images;
  for (int i = 0; i < 3; ++i) {
    std::vector<uint8_t> rgb(size_t(96 + 32 * i) * 80 * 3);
    for (size_t k = 0; k < rgb.size(); ++k) rgb[k] = uint8_t((k * 7 + size_t(i) * 13) % 251);
    const std::vector<uint8_t> png = fovea::test::encode_png_rgb(96 + 32 * i, 80, rgb);
    images.push_back(write("img" + std::to_string(i) + ".png", std::string(png.begin(), png.end())));
  }
  write("broken.png", "not an image");
  const std::string cache = file("cache");
  std::string list;
  for (const auto& p : images) list += " " + q(p);
  Result r = run("encode synthetic:tiny --device cpu" + list + " " + q(file("broken.png")) + " --ec-storage-path " +
                 q(cache) + " --max-batch-tokens 40");
  EXPECT_EQ(r.code, 1) << r.err;  // the broken image
  EXPECT_HAS(r.err, "image '" + file("broken.png") + "'");
  EXPECT_HAS(r.out, "3 written, 0 already there, 0 repeated, 1 failed");
  for (const auto& img : images) {
    const std::string bytes = slurp(img);
    const std::string key = fovea::sha256_hex(bytes);
    const fs::path path = fs::path(cache) / key / "encoder_cache.safetensors";
    ASSERT_TRUE(fs::exists(path)) << path;
    ASSERT_EQ(run("encode synthetic:tiny --device cpu " + q(img) + " -o " + q(file("one.safetensors"))).code, 0);
    const auto one = fovea::Checkpoint::open(file("one.safetensors"));
    const auto ec = fovea::Checkpoint::open(path.string());
    ASSERT_EQ(ec.tensors().size(), 1u);
    const fovea::TensorInfo* t = ec.find("ec_cache");
    ASSERT_NE(t, nullptr);
    const fovea::TensorInfo* merged = one.find("image.0.embeddings");
    ASSERT_NE(merged, nullptr);
    std::vector<const fovea::TensorInfo*> parts = {merged};
    for (int k = 0; const fovea::TensorInfo* d = one.find("image.0.deepstack." + std::to_string(k)); ++k)
      parts.push_back(d);
    const int64_t tokens = merged->shape[0], O = merged->shape[1];
    EXPECT_EQ(t->dtype, fovea::DType::BF16);
    EXPECT_EQ(t->shape, (std::vector<int64_t>{tokens, O * int64_t(parts.size())}));
    ASSERT_GT(parts.size(), 1u) << "synthetic:tiny has deepstack outputs";
    const auto* v = reinterpret_cast<const uint16_t*>(t->data);
    int64_t wrong = 0;
    for (int64_t row = 0; row < tokens; ++row)
      for (size_t p = 0; p < parts.size(); ++p) {
        const auto* src = reinterpret_cast<const uint16_t*>(parts[p]->data) + row * O;
        wrong += std::memcmp(v + row * O * int64_t(parts.size()) + int64_t(p) * O, src, size_t(O) * 2) != 0;
      }
    EXPECT_EQ(wrong, 0) << img;
  }
  r = run("encode synthetic:tiny --device cpu" + list + " --ec-storage-path " + q(cache));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "0 written, 3 already there");
  r = run("encode synthetic:tiny --device cpu" + list + " " + q(images[0]) + " --ec-storage-path " + q(cache) +
          " --uuid-from filename");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "3 written, 0 already there, 1 repeated");
  EXPECT_TRUE(fs::exists(fs::path(cache) / "img1.png" / "encoder_cache.safetensors"));
  // The proxy's keys: the sha256 of the URL a client sends, a data URL of the file or its file:// URL.
  const auto hash = [](const std::string& t) { return fovea::sha256_hex(t); };
  const auto base64 = [](const std::string& in) {  // RFC 4648, written here as the test's own oracle
    const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    for (size_t i = 0; i < in.size(); i += 3) {
      uint32_t v = uint32_t(uint8_t(in[i])) << 16;
      if (i + 1 < in.size()) v |= uint32_t(uint8_t(in[i + 1])) << 8;
      if (i + 2 < in.size()) v |= uint8_t(in[i + 2]);
      const size_t n = std::min<size_t>(3, in.size() - i);  // bytes in this group: n + 1 characters, then '='
      for (size_t k = 0; k < 4; ++k) out += k <= n ? abc[(v >> (18 - 6 * k)) & 63] : '=';
    }
    return out;
  };
  r = run("encode synthetic:tiny --device cpu " + q(images[0]) + " --ec-storage-path " + q(cache) +
          " --uuid-from data-url");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(fs::path(cache) / hash("data:image/png;base64," + base64(slurp(images[0]))) /
                         "encoder_cache.safetensors"));
  const std::string spaced = write("a b%.png", slurp(images[1]));
  r = run("encode synthetic:tiny --device cpu " + q(spaced) + " --ec-storage-path " + q(cache) +
          " --uuid-from file-url");
  EXPECT_EQ(r.code, 0) << r.err;
  std::string as_uri = "file://";
  as_uri += fs::absolute(spaced).parent_path().string();
  as_uri += "/a%20b%25.png";
  EXPECT_TRUE(fs::exists(fs::path(cache) / hash(as_uri) / "encoder_cache.safetensors")) << as_uri;
  expect_one_line_error(run("encode synthetic:tiny --device cpu " + q(write("x.raw", slurp(images[0]))) +
                            " --ec-storage-path " + q(cache) + " --uuid-from data-url"),
                        "is not one it knows");
  expect_one_line_error(
      run("encode synthetic:tiny --device cpu" + list + " --ec-storage-path " + q(cache) + " --uuid-from md5"),
      "--uuid-from: 'md5' is not one of sha256, filename, data-url, file-url");
  expect_one_line_error(
      run("encode synthetic:tiny --device cpu" + list + " --ec-storage-path " + q(cache) + " -o x.safetensors"),
      "two different outputs");
}

// Clips fill the encoder cache too, beside images: the clip's file holds the rows `encode -o` writes
// as video.0 (merger output, then each deepstack output, row for row), bit for bit.
TEST_F(Cli, EncodeFillsTheEncoderCacheWithClips) {
  const std::string clip = std::string(FOVEA_SOURCE_DIR) + "/tests/data/video/vp9.webm";
  std::vector<uint8_t> rgb(size_t(96) * 80 * 3);
  for (size_t k = 0; k < rgb.size(); ++k) rgb[k] = uint8_t((k * 7) % 251);
  const std::vector<uint8_t> png = fovea::test::encode_png_rgb(96, 80, rgb);
  const std::string image = write("still.png", std::string(png.begin(), png.end())), cache = file("cache-clips");
  Result r = run("encode synthetic:tiny --device cpu " + q(image) + " " + q(clip) + " --ec-storage-path " + q(cache));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_HAS(r.out, "2 written, 0 already there");
  ASSERT_EQ(run("encode synthetic:tiny --device cpu " + q(clip) + " -o " + q(file("clip.safetensors"))).code, 0);
  const auto one = fovea::Checkpoint::open(file("clip.safetensors"));
  const std::string bytes = slurp(clip);
  const std::string key = fovea::sha256_hex(bytes);
  const auto ec = fovea::Checkpoint::open((fs::path(cache) / key / "encoder_cache.safetensors").string());
  const fovea::TensorInfo* t = ec.find("ec_cache");
  ASSERT_NE(t, nullptr);
  std::vector<const fovea::TensorInfo*> parts = {one.find("video.0.embeddings")};
  ASSERT_NE(parts[0], nullptr);
  for (int k = 0; const fovea::TensorInfo* d = one.find("video.0.deepstack." + std::to_string(k)); ++k)
    parts.push_back(d);
  const int64_t tokens = parts[0]->shape[0], O = parts[0]->shape[1];
  EXPECT_EQ(tokens, 90);  // vp9.webm at the class defaults: grid (3, 10, 12)
  ASSERT_EQ(t->shape, (std::vector<int64_t>{tokens, O * int64_t(parts.size())}));
  const auto* v = reinterpret_cast<const uint16_t*>(t->data);
  int64_t wrong = 0;
  for (int64_t row = 0; row < tokens; ++row)
    for (size_t p = 0; p < parts.size(); ++p)
      wrong += std::memcmp(v + row * O * int64_t(parts.size()) + int64_t(p) * O,
                           reinterpret_cast<const uint16_t*>(parts[p]->data) + row * O, size_t(O) * 2) != 0;
  EXPECT_EQ(wrong, 0);
}

// A FIFO or a device given as an input is refused at once on every path of `fovea encode` (-o, and
// the encoder cache with each key from the file name, which reads nothing before preparing): a
// blocking open of a FIFO waits for a writer forever, /dev/zero never ends. `timeout 10` makes a
// regression fail instead of hanging.
TEST_F(Cli, EncodeRefusesFifosAndDevicesAtOnce) {
  const std::string fifo = file("clip.mp4");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& input : {fifo, std::string("/dev/zero")}) {
    for (const std::string& out :
         {" -o " + q(file("out.safetensors")), " --ec-storage-path " + q(file("cache")) + " --uuid-from filename"}) {
      SCOPED_TRACE(input + out);
      const auto t0 = std::chrono::steady_clock::now();
      const Result r = run_within(10, "encode synthetic:tiny --device cpu " + q(input) + out);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_NE(r.code, 0);
      EXPECT_NE(r.code, 124) << "timed out";
      EXPECT_HAS(r.err, "'" + input + "': is not a regular file");
      EXPECT_LT(s, 5.0 * fovea::test::kTimeScale);
    }
  }
  EXPECT_FALSE(fs::exists(file("out.safetensors")));
}

}  // namespace
