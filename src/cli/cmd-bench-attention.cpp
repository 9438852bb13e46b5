// fovea bench attention: accuracy (and time) of attention backends against the fp64 reference on a
// packed varlen batch. With --device cpu it measures the CPU emulations of the BF16 and FP8 kernels:
// the accuracy oracle the GPU backends plug into.
#include <chrono>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/random.h"

namespace fovea::cli {

namespace {

struct Args {
  std::string seqlens = "1024";
  int heads = 16;
  int head_dim = 72;
  std::string dist = "normal";
  std::string dtypes = "bf16,fp8";
  std::string device = "cpu";
  uint64_t seed = 0;
  int threads = 0;
  std::string json_path;
};

std::vector<int> parse_int_list(const std::string& s, const char* flag) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty() || v < 1) fail("{}: '{}' is not a positive integer", flag, item);
    out.push_back(v);
  }
  if (out.empty()) fail("{}: empty list", flag);
  return out;
}

std::vector<AttnDtype> parse_dtypes(const std::string& s) {
  std::vector<AttnDtype> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto d = parse_dtype(item);
    if (!d || *d == AttnDtype::AUTO) fail("--dtype: '{}' is not bf16 or fp8", item);
    out.push_back(*d);
  }
  if (out.empty()) fail("--dtype: empty list");
  return out;
}

nlohmann::json num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

int run_bench(const Args& a) {
  if (a.device != "cpu")
    fail("--device {}: the attention benchmark runs the CPU reference only so far (GPU kernels: issue #3)", a.device);
  const auto dist = parse_dist(a.dist);
  if (!dist) fail("--dist: '{}' is not one of normal, outliers", a.dist);
  if (a.heads < 1) fail("--heads must be >= 1, got {}", a.heads);
  if (a.head_dim < 1) fail("--head-dim must be >= 1, got {}", a.head_dim);
  const std::vector<AttnDtype> dtypes = parse_dtypes(a.dtypes);
  const std::vector<int> seqlens = parse_int_list(a.seqlens, "--seqlens");
  const VarlenShape shape = varlen_from_seqlens(seqlens, a.heads, a.head_dim);

  // Q, K, V as one fused [N, 3, H, hd] buffer (how the encoder's qkv GEMM lays them out); bf16 values.
  const int64_t N = shape.total_tokens(), H = a.heads, hd = a.head_dim;
  const std::vector<float> qkv = random_values(N * 3 * H * hd, *dist, a.seed);
  auto view = [&](int i) { return ThdView<const float>{qkv.data() + i * H * hd, 3 * H * hd, hd}; };
  const auto q = view(0), k = view(1), v = view(2);

  fmt::print("fovea bench attention | device cpu | seqlens {} ({} segments, {} tokens) | heads {} | head_dim {} | "
             "dist {} | seed {}\n",
             a.seqlens, shape.num_segments(), N, H, hd, a.dist, a.seed);
  using clock = std::chrono::steady_clock;
  auto timed = [&](const cpu::RefOptions& o, std::vector<double>& out) {
    const auto t0 = clock::now();
    cpu::attention(shape, q, k, v, o, out.data());
    return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  };
  std::vector<double> ref(size_t(N * H * hd)), out(ref.size());
  cpu::RefOptions exact;
  exact.threads = a.threads;
  const double ref_ms = timed(exact, ref);

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  fmt::print("{:<6} | {:<8} | {:>12} | {:>12} | {:>12} | {:>10}\n", "dtype", "backend", "rel_l2", "max_abs",
             "mean_abs", "ms");
  fmt::print("{:<6} | {:<8} | {:>12} | {:>12} | {:>12} | {:>10.1f}\n", "fp64", "CPU", "(reference)", "", "", ref_ms);
  for (AttnDtype d : dtypes) {
    cpu::RefOptions o;
    o.threads = a.threads;
    o.mode = d == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    nlohmann::ordered_json entry = {{"dtype", dtype_name(d)}, {"backend", "CPU"}};
    if (d == AttnDtype::FP8) {
      // Current scaling, as dynamic mode does it on the first forward: s = amax / 448.
      ScaleBook book = ScaleBook::dynamic(1);
      o.fp8_scales = book.record(0, amax(shape, q), amax(shape, k), amax(shape, v));
      entry["scales"] = {{"q", o.fp8_scales.q}, {"k", o.fp8_scales.k}, {"v", o.fp8_scales.v}};
      entry["p_scheme"] = {{"p_scale", o.p.p_scale}, {"block_n", o.p.block_n}, {"reverse_kv", o.p.reverse_kv}};
    }
    const double ms = timed(o, out);
    const ErrorStats e = compare(out.data(), ref.data(), int64_t(ref.size()));
    fmt::print("{:<6} | {:<8} | {:>12.4e} | {:>12.4e} | {:>12.4e} | {:>10.1f}\n", dtype_name(d), "CPU", e.rel_l2,
               e.max_abs, e.mean_abs, ms);
    entry["rel_l2"] = num(e.rel_l2);
    entry["max_abs"] = num(e.max_abs);
    entry["mean_abs"] = num(e.mean_abs);
    entry["nonfinite"] = e.nonfinite;
    entry["ms"] = ms;
    results.push_back(entry);
  }
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {
        {"bench", "attention"}, {"device", "cpu"},    {"seqlens", seqlens},     {"heads", H},
        {"head_dim", hd},       {"dist", a.dist},     {"seed", a.seed},         {"flops", shape.flops()},
        {"reference_ms", ref_ms}, {"results", results}};
    write_file_atomic(a.json_path, doc.dump(2) + "\n", "--json");
    fmt::print("wrote {}\n", a.json_path);
  }
  return 0;
}

}  // namespace

void add_bench_attention(CLI::App* bench, Runner& run) {
  auto* cmd = bench->add_subcommand("attention", "attention accuracy (and time) against the fp64 reference");
  auto a = std::make_shared<Args>();
  cmd->add_option("--seqlens", a->seqlens, "comma list of segment lengths forming one packed batch")
      ->capture_default_str();
  cmd->add_option("--heads", a->heads, "attention heads")->capture_default_str();
  cmd->add_option("--head-dim", a->head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--dist", a->dist, "input distribution: normal | outliers (N(0,1) + N(0,100)*Bernoulli(0.001))")
      ->capture_default_str();
  cmd->add_option("--dtype", a->dtypes, "comma list of dtypes: bf16, fp8")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu (the reference emulations)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)")->capture_default_str();
  cmd->add_option("--json", a->json_path, "write the results as JSON to this file");
  cmd->callback([&run, a] { run = [a] { return run_bench(*a); }; });
}

}  // namespace fovea::cli
