// fovea bench calibration: "calibrated on one set, holds on another". For each FP8 scheme asked for,
// calibrates with dynamic scaling on the first images of a folder (16 forwards, margin 1), then
// encodes the other images with FP8-dynamic and FP8-static (the calibrated scales times each margin
// asked for) and reports each one's final embeddings against a reference: BF16 attention (the
// default) or the fp32 CPU forward, where BF16's own error is measured too and each FP8 error is also
// given as a ratio to it. It also calibrates on the held-out images and reports, per field of the
// scale file, how far their amax goes past the first calibration's (what a margin must cover). With
// --fp8-linears the FP8 modes also run the blocks' linears in FP8.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"

namespace fovea::cli {

namespace {

namespace fs = std::filesystem;

struct Args {
  std::string model, path, json_path, scale_path = "calibrated-scales.json", reference = "bf16";
  std::vector<std::string> schemes = {"tensor"};
  std::vector<std::string> margins = {"1.5"};
  int calibration_images = 4;
  int64_t max_pixels = 0;
  EngineOptions engine;  // device / backend; dtype, scheme and scale options are set per mode
};

// A margin for every scale, or one per field: "1.5", or "1.5:fovea_v_channel=1" (1.5 for every field
// but fovea_v_channel). The fields: the scale file's q, k, v, fovea_q_head, fovea_k_head, fovea_v_channel.
struct Margin {
  float all = 1.0f;
  std::map<std::string, float> field;
  std::string name;  // "x1.5", "x1.5 fovea_v_channel=1"
  float of(const std::string& f) const {
    const auto it = field.find(f);
    return it == field.end() ? all : it->second;
  }
};

float margin_value(const std::string& text, const std::string& spec) {
  size_t used = 0;
  float v = 0.0f;
  try {
    v = std::stof(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !std::isfinite(v) || !(v > 0.0f))
    fail("--margins: '{}' in '{}' is not a finite number > 0", text, spec);
  return v;
}

Margin parse_margin(const std::string& spec) {
  static const char* fields[] = {"q", "k", "v", "fovea_q_head", "fovea_k_head", "fovea_v_channel"};
  Margin m;
  size_t start = 0;
  for (int part = 0; start <= spec.size(); ++part) {
    const size_t end = std::min(spec.find(':', start), spec.size());
    const std::string t = spec.substr(start, end - start);
    if (part == 0) {
      m.all = margin_value(t, spec);
      m.name = fmt::format("x{:g}", m.all);
    } else {
      const size_t eq = t.find('=');
      const std::string f = t.substr(0, eq);
      if (eq == std::string::npos || std::find(std::begin(fields), std::end(fields), f) == std::end(fields))
        fail(
            "--margins: '{}' in '{}' is not FIELD=VALUE with FIELD one of q, k, v, fovea_q_head, fovea_k_head, "
            "fovea_v_channel",
            t, spec);
      m.field[f] = margin_value(t.substr(eq + 1), spec);
      m.name += fmt::format(" {}={:g}", f, m.field[f]);
    }
    start = end + 1;
  }
  return m;
}

// `file` (calibrated with margin 1) with each scale times its margin: what calibrating the same
// forwards with that margin writes, bit for bit (the margin is the last factor of each scale). K's
// mean, the split pairs and the gain are not scales and stay as they are.
ScaleFile with_margin(ScaleFile file, const Margin& m) {
  for (auto& [l, s] : file.layers) s = {s.q * m.of("q"), s.k * m.of("k"), s.v * m.of("v")};
  for (auto& [l, f] : file.fine) {
    for (float& x : f.q_head) x *= m.of("fovea_q_head");
    for (float& x : f.k_head) x *= m.of("fovea_k_head");
    for (float& x : f.v_channel) x *= m.of("fovea_v_channel");
  }
  return file;
}

std::vector<QkvScales> layer_list(const ScaleFile& f) {
  std::vector<QkvScales> out;
  for (const auto& [l, s] : f.layers) out.push_back(s);
  return out;
}

void write_with_margin(const ScaleFile& file, const Margin& m, const std::string& path) {
  const ScaleFile s = with_margin(file, m);
  std::vector<FineScales> fine;
  for (const auto& [l, f] : s.fine) fine.push_back(f);
  write_scale_file(path, layer_list(s), fine.empty() ? nullptr : &fine);
}

// Per field, how the held-out calibration's values compare with the first one's (both margin 1): the
// largest ratio and the share of values above 1 (clipping without a margin).
struct Drift {
  double worst = 0.0;
  int64_t above = 0, count = 0;
  void add(float first, float held) {
    const double r = double(held) / double(first);
    worst = std::max(worst, r);
    above += r > 1.0;
    ++count;
  }
};

std::map<std::string, Drift> drift(const ScaleFile& a, const ScaleFile& b) {
  std::map<std::string, Drift> d;
  for (const auto& [l, s] : a.layers) {
    const QkvScales& t = b.layers.at(l);
    d["q"].add(s.q, t.q), d["k"].add(s.k, t.k), d["v"].add(s.v, t.v);
  }
  for (const auto& [l, f] : a.fine) {
    const FineScales& g = b.fine.at(l);
    for (size_t i = 0; i < f.q_head.size(); ++i) d["fovea_q_head"].add(f.q_head[i], g.q_head[i]);
    for (size_t i = 0; i < f.k_head.size(); ++i) d["fovea_k_head"].add(f.k_head[i], g.k_head[i]);
    for (size_t i = 0; i < f.v_channel.size(); ++i) d["fovea_v_channel"].add(f.v_channel[i], g.v_channel[i]);
  }
  return d;
}

struct Mode {
  std::string name;  // "bf16", "<scheme> dynamic", "<scheme> static x<margin>"
  std::unique_ptr<EncoderRunner> runner;
  std::vector<double> err, ratio;  // per held-out image: rel_l2 against the reference, and / BF16's
};

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}
double worst_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// One run: the model, the engines of every mode, and what they measured.
class Bench {
 public:
  Bench(const Args& a, const fs::path& tmp)
      : a_(a),
        tmp_(tmp),
        sys_(query_system()),
        model_(qwen3vl::load_model(a.model)),
        pcfg_(image::load_preprocess_config(a.model, {0, a.max_pixels})),
        fp32_(a.reference == "fp32") {
    for (const std::string& m : a.margins) margins_.push_back(parse_margin(m));
    if (fp32_) modes_.push_back({"bf16", std::make_unique<EncoderRunner>(model_, config("bf16", "", "", "")), {}, {}});
  }

  // Calibrates `scheme` on `calib` (and on `held` for the drift) and adds its dynamic and static modes.
  void add_scheme(const std::string& scheme, const std::vector<std::string>& calib,
                  const std::vector<std::string>& held, bool write_file) {
    // auto calibrates with the robust scheme (resolve_engine): the same forwards, so the same files.
    const std::string as = scheme == "auto" ? "robust" : scheme;
    if (!calibrated_.contains(as))
      calibrated_[as] = {calibrate(as, calib, (tmp_ / (as + "-calibration.json")).string()),
                         calibrate(as, held, (tmp_ / (as + "-held-out.json")).string())};
    const auto& [first, other] = calibrated_.at(as);
    if (write_file) write_with_margin(first, margins_.front(), a_.scale_path);
    fmt::print("{}: calibrated on {} image(s) of {}{}\n", scheme, calib.size(), a_.path,
               write_file ? fmt::format(" -> {} (margin {})", a_.scale_path, margins_.front().name) : "");
    fmt::print("  held-out amax / calibration amax, per field (margin 1): ");
    for (const auto& [field, d] : drift(first, other)) {
      fmt::print("{} worst {:.3f}, {:.1f}% above 1; ", field, d.worst, 100.0 * double(d.above) / double(d.count));
      drift_[scheme][field] = {{"worst", d.worst}, {"above", d.above}, {"count", d.count}};
    }
    fmt::print("\n");
    modes_.push_back(
        {scheme + " dynamic", std::make_unique<EncoderRunner>(model_, config("fp8", scheme, "", "")), {}, {}});
    for (size_t i = 0; i < margins_.size(); ++i) {
      const std::string path = (tmp_ / fmt::format("{}-margin-{}.json", scheme, i)).string();
      write_with_margin(first, margins_[i], path);
      const EngineConfig cfg = config("fp8", scheme, path, "");
      if (!cfg.scheme_note.empty() && i == 0) fmt::print("  static: {}\n", cfg.scheme_note);
      modes_.push_back({scheme + " static " + margins_[i].name, std::make_unique<EncoderRunner>(model_, cfg), {}, {}});
    }
  }

  // Every mode on each held-out image, against the reference.
  void evaluate(const std::vector<std::string>& held) {
    const int O = model_.config.out_hidden;
    fmt::print("held-out images: {} ({})\n", held.size(),
               fp32_ ? "rel_l2 vs the fp32 CPU forward (x BF16's)" : "rel_l2 vs BF16 attention");
    std::unique_ptr<EncoderRunner> bf16_ref;
    if (!fp32_) bf16_ref = std::make_unique<EncoderRunner>(model_, config("bf16", "", "", ""));
    for (const std::string& f : held) {
      const Batch b = load(f);
      const std::vector<float> ref =
          fp32_ ? qwen3vl::forward_cpu(model_, b.pixels, b.grids).merged : bf16_ref->run(b).merged;
      nlohmann::ordered_json row = {{"image", f}, {"tokens", ref.size() / size_t(O)}};
      std::string line = fmt::format("{} ({} tokens):", fs::path(f).filename().string(), ref.size() / size_t(O));
      for (Mode& m : modes_) {
        const double e = qwen3vl::embedding_error(m.runner->run(b).merged, ref, O).rel_l2;
        m.err.push_back(e);
        if (fp32_) m.ratio.push_back(e / modes_.front().err.back());
        row[m.name] = e;
        line += fp32_ && m.name != "bf16" ? fmt::format(" {} {:.3e} ({:.2f}x);", m.name, e, m.ratio.back())
                                          : fmt::format(" {} {:.3e};", m.name, e);
      }
      fmt::print("{}\n", line);
      rows_.push_back(row);
    }
  }

  // Per mode, mean and worst over the held-out images, and static against its scheme's dynamic: printed
  // and returned with the rows and the drift, as the --output-json document.
  nlohmann::ordered_json summary() {
    fmt::print("\n{:<44} | {:>10} | {:>10} | {:>11} | {:>11} | {:>23} | {}\n", "mode", "mean err", "worst err",
               fp32_ ? "mean xbf16" : "", fp32_ ? "worst xbf16" : "", "static/dynamic mean, worst", "guarded q/k/v");
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    const Mode* dynamic = nullptr;
    for (const Mode& m : modes_) {
      if (m.name.ends_with(" dynamic")) dynamic = &m;
      std::string vs_dyn, rx, wx;
      nlohmann::ordered_json s = {{"mode", m.name}, {"mean", mean_of(m.err)}, {"worst", worst_of(m.err)}};
      std::string guard;
      if (m.name.find(" static ") != std::string::npos) {  // layers x images the static range was passed
        const GuardCounts g = m.runner->static_guarded();
        guard = fmt::format("{}/{}/{}", g.q, g.k, g.v);
        s["guarded"] = {{"q", g.q}, {"k", g.k}, {"v", g.v}};
      }
      if (m.name.find(" static ") != std::string::npos && dynamic) {
        std::vector<double> r;
        for (size_t i = 0; i < m.err.size(); ++i) r.push_back(m.err[i] / dynamic->err[i]);
        vs_dyn = fmt::format("{:.2f}, {:.2f}", mean_of(r), worst_of(r));
        s["static_over_dynamic_mean"] = mean_of(r), s["static_over_dynamic_worst"] = worst_of(r);
      }
      if (fp32_ && m.name != "bf16") {
        rx = fmt::format("{:.2f}", mean_of(m.ratio)), wx = fmt::format("{:.2f}", worst_of(m.ratio));
        s["mean_over_bf16"] = mean_of(m.ratio), s["worst_over_bf16"] = worst_of(m.ratio);
      }
      fmt::print("{:<44} | {:>10.3e} | {:>10.3e} | {:>11} | {:>11} | {:>23} | {}\n", m.name, mean_of(m.err),
                 worst_of(m.err), rx, wx, vs_dyn, guard);
      out.push_back(s);
    }
    return {{"model", a_.model},
            {"reference", a_.reference},
            {"calibration_images", a_.calibration_images},
            {"device", device_name(config("bf16", "", "", "").device)},
            {"drift", drift_},
            {"summary", out},
            {"rows", rows_}};
  }

 private:
  Batch load(const std::string& f) const {
    Batch b;
    b.add(image::preprocess(image::decode_file(f, pcfg_), pcfg_));
    return b;
  }

  EngineConfig config(const std::string& dtype, const std::string& scheme, const std::string& scale,
                      const std::string& save) const {
    EngineOptions o = a_.engine;
    o.dtype = dtype;
    o.fp8_scheme = dtype == "fp8" ? scheme : "auto";  // the BF16 reference has no FP8 scheme
    o.scale_path = scale;
    o.scale_save_path = save;
    o.scale_save_margin = 1.0;
    o.fp8_linears = a_.engine.fp8_linears && dtype == "fp8";  // and keeps BF16 linears
    return resolve_engine(o, sys_);
  }

  // 16 forwards cycling through `images` with scheme's calibration; the file at `path` (margin 1).
  ScaleFile calibrate(const std::string& scheme, const std::vector<std::string>& images,
                      const std::string& path) const {
    EncoderRunner runner(model_, config("fp8", scheme, "", path));
    for (int i = 0; !runner.book()->calibration_written(); ++i) {
      runner.run(load(images[size_t(i) % images.size()]));
      if (i > 10 * kAmaxHistoryLen) fail("calibration did not complete");  // cannot happen: 16 forwards write
    }
    return read_scale_file(path);
  }

  const Args& a_;
  fs::path tmp_;
  SystemInfo sys_;
  qwen3vl::Model model_;
  image::PreprocessConfig pcfg_;
  bool fp32_;
  std::vector<Margin> margins_;
  std::vector<Mode> modes_;
  std::map<std::string, std::pair<ScaleFile, ScaleFile>> calibrated_;  // per scheme calibrated with: first, held-out
  nlohmann::ordered_json drift_ = nlohmann::ordered_json::object(), rows_ = nlohmann::ordered_json::array();
};

int run(const Args& a) {
  const std::vector<std::string> files = image::list_images(a.path, "--dataset-path");
  if (a.calibration_images < 1) fail("--calibration-images must be >= 1");
  if (int(files.size()) <= a.calibration_images)
    fail("--dataset-path '{}' has {} images; need more than --calibration-images {} to hold some out", a.path,
         files.size(), a.calibration_images);
  if (a.reference != "bf16" && a.reference != "fp32") fail("--reference: '{}' is not bf16 or fp32", a.reference);
  if (a.margins.empty() || a.schemes.empty()) fail("--margins and --fp8-scheme need at least one value");
  const fs::path tmp = fs::temp_directory_path() / fmt::format("fovea-bench-calibration-{}", ::getpid());
  fs::create_directories(tmp);
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{tmp};
  Bench bench(a, tmp);
  const std::vector<std::string> calib(files.begin(), files.begin() + a.calibration_images),
      held(files.begin() + a.calibration_images, files.end());
  for (const std::string& scheme : a.schemes) bench.add_scheme(scheme, calib, held, &scheme == &a.schemes.front());
  bench.evaluate(held);
  const nlohmann::ordered_json doc = bench.summary();
  if (!a.json_path.empty()) write_file_atomic(a.json_path, doc.dump(2) + "\n", "--output-json");
  return 0;
}

}  // namespace

void add_bench_calibration(CLI::App* bench, Runner& runner) {
  auto* cmd = bench->add_subcommand(
      "calibration",
      "calibrate FP8 scales on some images, check static and dynamic FP8 on the others against BF16 or fp32");
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint folder or synthetic:<preset>")->required();
  cmd->add_option("--dataset-path", a->path,
                  "folder of images: the first --calibration-images calibrate, the rest are held out")
      ->required();
  cmd->add_option("--calibration-images", a->calibration_images, "images used for calibration")->capture_default_str();
  cmd->add_option("--scale-file", a->scale_path,
                  "where the first scheme's calibrated scales are written (first margin)")
      ->capture_default_str();
  cmd->add_option("--fp8-scheme", a->schemes, "FP8 schemes to compare (comma list of auto, tensor, robust)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--margins", a->margins,
                  "margins the static scales are run with (comma list, from one calibration); each one number, or one "
                  "with per-field exceptions: 1.5:fovea_v_channel=1")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--reference", a->reference, "bf16 (BF16 attention on the same device) or fp32 (the CPU forward)")
      ->capture_default_str();
  cmd->add_option("--max-pixels", a->max_pixels, "resize budget override (default: the checkpoint's)");
  cmd->add_option("--output-json", a->json_path, "write the per-image results and the summary as JSON");
  cmd->add_option("--device", a->engine.device, "cuda or cpu (default: cuda when a GPU is visible)");
  cmd->add_option("--mm-encoder-attn-backend", a->engine.backend, "attention backend")->capture_default_str();
  cmd->add_flag(
      "--fp8-linears", a->engine.fp8_linears,
      "the FP8 modes (calibration included) also run the blocks' linears in FP8; the BF16 reference does not");
  cmd->callback([&runner, a] { runner = [a] { return run(*a); }; });
}

}  // namespace fovea::cli
