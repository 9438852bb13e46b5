// fovea bench attention: accuracy (and time) of attention backends against the fp64 reference on a
// packed varlen batch. With --device cpu it measures the CPU emulations of the BF16 and FP8 kernels:
// the accuracy oracle the GPU backends plug into.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "fovea/bf16.h"
#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/lists.h"
#include "fovea/random.h"
#include "fovea/rope.h"

#if FOVEA_HAVE_CUDA
#include "fovea/cuda-support.h"
#endif

namespace fovea::cli {

namespace {

struct Args {
  std::string seqlens = "1024";
  int heads = 16;
  int head_dim = 72;
  std::string dist = "normal";
  std::string dtypes = "bf16,fp8";
  std::string device = "cpu";
  std::string backend = "FOVEA";
  int reps = 20;
  int warmup = 3;
  bool check = true;
  uint64_t seed = 0;
  int threads = 0;
  std::string json_path;
  std::string fp8_schemes = "tensor";
};

// FP8 scale schemes the CPU bench compares (fovea/attention.h, Fp8Fine): per-tensor (vLLM's), and
// the parts of the outlier-robust scheme alone and together.
struct Fp8Scheme {
  const char* name;
  cpu::Fp8FineParts parts;
};
constexpr Fp8Scheme kFp8Schemes[] = {
    {"tensor", {}},
    {"smooth-k", {true, false, false}},
    {"per-head", {false, true, false}},
    {"per-channel-v", {false, false, true}},
    {"robust", {true, true, true}},
    {"rotate", {false, false, false, true}},
    {"robust+rotate", {true, true, true, true}},
};

std::vector<Fp8Scheme> parse_schemes(const std::string& s) {
  std::vector<Fp8Scheme> out;
  for (const std::string& item : split_list(s)) {
    const Fp8Scheme* found = nullptr;
    for (const Fp8Scheme& f : kFp8Schemes)
      if (item == f.name) found = &f;
    if (!found) fail("--fp8-scheme: '{}' is not one of tensor, smooth-k, per-head, per-channel-v, robust, rotate, robust+rotate", item);
    out.push_back(*found);
  }
  if (out.empty()) fail("--fp8-scheme: empty list");
  return out;
}

std::vector<AttnDtype> parse_dtypes(const std::string& s) {
  std::vector<AttnDtype> out;
  for (const std::string& item : split_list(s)) {
    const auto d = parse_dtype(item);
    if (!d || *d == AttnDtype::AUTO) fail("--dtype: '{}' is not bf16 or fp8", item);
    out.push_back(*d);
  }
  if (out.empty()) fail("--dtype: empty list");
  return out;
}

nlohmann::ordered_json num(double x) { return std::isfinite(x) ? nlohmann::ordered_json(x) : nlohmann::ordered_json(nullptr); }

int run_bench_cuda(const Args& a, const VarlenShape& shape, const std::vector<int>& seqlens,
                   const std::vector<AttnDtype>& dtypes, const std::vector<float>& qkv, const std::vector<Fp8Scheme>& schemes);

int run_bench(const Args& a) {
  if (a.device != "cpu" && a.device != "cuda") fail("--device: '{}' is not one of cpu, cuda", a.device);
  const auto dist = parse_dist(a.dist);
  if (!dist) fail("--dist: '{}' is not one of normal, outliers, channels", a.dist);
  const std::vector<Fp8Scheme> schemes = parse_schemes(a.fp8_schemes);
  if (a.heads < 1) fail("--heads must be >= 1, got {}", a.heads);
  if (a.head_dim < 1) fail("--head-dim must be >= 1, got {}", a.head_dim);
  const std::vector<AttnDtype> dtypes = parse_dtypes(a.dtypes);
  const std::vector<int> seqlens = parse_int_list(a.seqlens, "--seqlens", 1);
  const VarlenShape shape = varlen_from_seqlens(seqlens, a.heads, a.head_dim);

  // Q, K, V as one fused [N, 3, H, hd] buffer (how the encoder's qkv GEMM lays them out); bf16 values.
  const int64_t N = shape.total_tokens(), H = a.heads, hd = a.head_dim;
  const std::vector<float> qkv = random_qkv(N, int(H), int(hd), *dist, a.seed);
  if (a.device == "cuda") {
    for (const Fp8Scheme& f : schemes)
      if (std::string(f.name) != "tensor" && std::string(f.name) != "robust")
        fail("--fp8-scheme {}: the FOVEA kernels run tensor and robust (--device cpu emulates the others)", f.name);
    return run_bench_cuda(a, shape, seqlens, dtypes, qkv, schemes);
  }
  auto view = [&](int i) { return ThdView<const float>{qkv.data() + i * H * hd, 3 * H * hd, hd}; };
  const auto q = view(0), k = view(1), v = view(2);

  fmt::print("fovea bench attention | device cpu | seqlens {} ({} segments, {} tokens) | heads {} | head_dim {} | "
             "dist {} | seed {}\n",
             a.seqlens, shape.num_segments(), N, H, hd, a.dist, a.seed);
  auto timed = [&](const cpu::RefOptions& o, std::vector<double>& out) {
    const Clock::time_point t0 = Clock::now();
    cpu::attention(shape, q, k, v, o, out.data());
    return ms_since(t0);
  };
  std::vector<double> ref(size_t(N * H * hd)), out(ref.size());
  cpu::RefOptions exact;
  exact.threads = a.threads;
  const double ref_ms = timed(exact, ref);

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  fmt::print("{:<6} | {:<13} | {:<8} | {:>12} | {:>12} | {:>12} | {:>10}\n", "dtype", "fp8 scheme", "backend",
             "rel_l2", "max_abs", "mean_abs", "ms");
  fmt::print("{:<6} | {:<13} | {:<8} | {:>12} | {:>12} | {:>12} | {:>10.1f}\n", "fp64", "", "CPU", "(reference)", "", "",
             ref_ms);
  struct Run {
    AttnDtype dtype;
    const Fp8Scheme* scheme;  // FP8 only
  };
  std::vector<Run> runs;
  for (AttnDtype d : dtypes) {
    if (d != AttnDtype::FP8) runs.push_back({d, nullptr});
    else
      for (const Fp8Scheme& sc : schemes) runs.push_back({d, &sc});
  }
  for (const Run& run : runs) {
    const AttnDtype d = run.dtype;
    cpu::RefOptions o;
    o.threads = a.threads;
    o.mode = d == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
    nlohmann::ordered_json entry = {{"dtype", dtype_name(d)}, {"backend", "CPU"}};
    if (d == AttnDtype::FP8) {
      // Current scaling, as dynamic mode does it on the first forward: s = amax / 448, per tensor,
      // then the scheme's finer scales where it has them.
      ScaleBook book = ScaleBook::dynamic(1);
      o.fp8_scales = book.record(0, amax(shape, q), amax(shape, k), amax(shape, v));
      o.fp8_fine = cpu::current_fine_scales(shape, q, k, v, run.scheme->parts);
      entry["fp8_scheme"] = run.scheme->name;
      entry["scales"] = {{"q", o.fp8_scales.q}, {"k", o.fp8_scales.k}, {"v", o.fp8_scales.v}};
      entry["p_scheme"] = {{"p_scale", o.p.p_scale}, {"block_n", o.p.block_n}, {"reverse_kv", o.p.reverse_kv}};
    }
    const double ms = timed(o, out);
    const ErrorStats e = compare(out.data(), ref.data(), int64_t(ref.size()));
    fmt::print("{:<6} | {:<13} | {:<8} | {:>12.4e} | {:>12.4e} | {:>12.4e} | {:>10.1f}\n", dtype_name(d),
               run.scheme ? run.scheme->name : "", "CPU", e.rel_l2, e.max_abs, e.mean_abs, ms);
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

#if FOVEA_HAVE_CUDA

int run_bench_cuda(const Args& a, const VarlenShape& shape, const std::vector<int>& seqlens,
                   const std::vector<AttnDtype>& dtypes, const std::vector<float>& qkv, const std::vector<Fp8Scheme>& schemes) {
  // --backend: a comma list of FOVEA and CUDNN (FLASHINFER); CUDNN runs the BF16 rows only.
  std::vector<AttnBackend> backends;
  for (const std::string& name : split_list(a.backend)) {
    const auto b = parse_backend(name);
    if (!b || (*b != AttnBackend::FOVEA && *b != AttnBackend::CUDNN))
      fail("--backend: '{}' is not one of FOVEA, CUDNN (FLASHINFER)", name);
    backends.push_back(*b);
  }
  if (backends.empty()) fail("--backend: empty list");
  if (a.reps < 1) fail("--reps must be >= 1, got {}", a.reps);
  const SystemInfo sys = query_system();
  for (const AttnBackend b : backends)
    for (const AttnDtype d : dtypes)
      if (b == AttnBackend::FOVEA || d == AttnDtype::BF16)
        if (auto why = backend_unsupported(b, d, Device::CUDA, sys)) fail("--device cuda --backend {}: {}", backend_name(b), *why);
  const int64_t N = shape.total_tokens(), H = shape.heads, hd = shape.head_dim;

  // Inputs: the fused bf16 qkv and 2D RoPE tables; the fp32 rotated copy feeds the reference.
  std::vector<float> cos, sin;
  rope_tables_grid(shape, cos, sin);
  std::vector<uint16_t> qkv16(qkv.size());
  for (size_t i = 0; i < qkv.size(); ++i) qkv16[i] = bf16_from_float(qkv[i]);
  cuda::DeviceBuffer<uint16_t> d_qkv(qkv16.size()), d_out(size_t(N * H * hd));
  cuda::DeviceBuffer<float> d_cos(cos.size()), d_sin(sin.size());
  FOVEA_CUDA_CHECK(cudaMemcpy(d_qkv.data(), qkv16.data(), d_qkv.bytes(), cudaMemcpyHostToDevice));
  FOVEA_CUDA_CHECK(cudaMemcpy(d_cos.data(), cos.data(), d_cos.bytes(), cudaMemcpyHostToDevice));
  FOVEA_CUDA_CHECK(cudaMemcpy(d_sin.data(), sin.data(), d_sin.bytes(), cudaMemcpyHostToDevice));
  std::vector<float> rot = qkv;
  apply_rope_qk(shape, cos, sin, rot);

  // Error against fp64 on head 0 (the reference is O(sum S^2) on the CPU: skipped past 2^28).
  double s2 = 0;
  for (int n : seqlens) s2 += double(n) * n;
  const bool check = a.check && s2 <= double(1 << 28);
  VarlenShape one = shape;
  one.heads = 1;
  auto all = [&](int w) { return ThdView<const float>{rot.data() + w * H * hd, 3 * H * hd, hd}; };
  std::vector<double> ref;
  if (check) {
    ref.resize(size_t(N * hd));
    cpu::attention(one, all(0), all(1), all(2), {}, ref.data());  // heads = 1: head 0 of each view
  }
  // Static scales for the benchmark: current scaling of these inputs over all heads (what calibration
  // with margin 1 would give).
  const QkvScales st_all = ScaleBook::dynamic(1).record(0, amax(shape, all(0)), amax(shape, all(1)), amax(shape, all(2)));
  cuda::DeviceBuffer<float> d_fixed(3);
  cuda::DeviceBuffer<LayerAmax> d_amax(1);
  const float fixed[3] = {st_all.q, st_all.k, st_all.v};
  FOVEA_CUDA_CHECK(cudaMemcpy(d_fixed.data(), fixed, sizeof fixed, cudaMemcpyHostToDevice));
  LayerAmax fresh;
  for (auto& t : fresh.t) amax_history_reset(t);
  FOVEA_CUDA_CHECK(cudaMemcpy(d_amax.data(), &fresh, sizeof fresh, cudaMemcpyHostToDevice));
  // The robust scheme: static arrays from these inputs likewise (cpu::current_fine_scales), and a
  // second set the dynamic runs fill on the device.
  const cpu::Fp8Fine fine = cpu::current_fine_scales(shape, all(0), all(1), all(2), {true, true, true, false});
  std::vector<cuda::DeviceBuffer<float>> d_fine;
  for (int set = 0; set < 2; ++set)
    for (const std::vector<float>* v : {&fine.k_mean, &fine.q_head, &fine.k_head, &fine.v_channel}) {
      d_fine.emplace_back(v->size());
      FOVEA_CUDA_CHECK(cudaMemcpy(d_fine.back().data(), v->data(), d_fine.back().bytes(), cudaMemcpyHostToDevice));
    }
  // The dynamic runs record into a history, as the encoder's layers do.
  const cuda::DeviceFineHistory d_history{FineHistory(int(H), int(hd))};
  auto fine_arrays = [&](int set) {
    return cuda::FineArrays{d_fine[size_t(4 * set)].data(), d_fine[size_t(4 * set + 1)].data(),
                            d_fine[size_t(4 * set + 2)].data(), d_fine[size_t(4 * set + 3)].data()};
  };

  const GpuInfo& gpu = sys.gpus.at(0);
  fmt::print("fovea bench attention | device cuda ({}) | backend FOVEA | seqlens {} ({} segments, {} tokens) | heads {} | "
             "head_dim {} | dist {} | seed {} | median of {}\n",
             gpu.name, a.seqlens, shape.num_segments(), N, H, hd, a.dist, a.seed, a.reps);
  fmt::print("{:<6} | {:>9} | {:>8} | {:>12} | {:>13} | {:>10} | {:>10} | {:>10}\n", "dtype", "attn ms", "TFLOP/s",
             "prep ms", "prep dyn ms", "total ms", "rel_l2", "max_abs");
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  struct Run {
    AttnDtype dtype;
    bool robust;
    AttnBackend backend;
  };
  std::vector<Run> runs;
  for (const AttnBackend b : backends)
    for (AttnDtype d : dtypes) {
      if (d != AttnDtype::FP8) runs.push_back({d, false, b});  // BF16 has no scale scheme
      else if (b == AttnBackend::FOVEA)
        for (const Fp8Scheme& f : schemes) runs.push_back({d, std::string(f.name) == "robust", b});
    }
  for (const auto& [d, robust, backend] : runs) {
    const bool fp8 = d == AttnDtype::FP8, cudnn = backend == AttnBackend::CUDNN;
    // FP8 rows name the scheme: "fp8" is per-tensor (vLLM's), "fp8-r" the robust one; "cudnn" is the
    // CUDNN backend's BF16.
    const std::string label = cudnn ? "cudnn" : robust ? "fp8-r" : dtype_name(d);
#if FOVEA_HAVE_CUDNN
    const std::unique_ptr<cuda::Attention> attn_ptr =
        cudnn ? cuda::make_cudnn_attention(d, int(H), int(hd)) : std::make_unique<cuda::FlashAttention>(d, int(H), int(hd));
#else
    if (cudnn) fail("--backend CUDNN: this fovea was built without cuDNN");
    const std::unique_ptr<cuda::Attention> attn_ptr = std::make_unique<cuda::FlashAttention>(d, int(H), int(hd));
#endif
    cuda::Attention& attn = *attn_ptr;
    attn.plan(shape.cu_seqlens);
    cuda::DeviceScales st_scales, dyn_scales;
    if (robust) {
      st_scales.fine = fine_arrays(0);
      dyn_scales.fine = fine_arrays(1);
      dyn_scales.fine_current = true;
      dyn_scales.fine_ring = d_history.ring();
    } else {
      st_scales.fixed = d_fixed.data();
      dyn_scales.dynamic = d_amax.data();
    }
    auto prep = [&](const cuda::DeviceScales& sc) { attn.prepare(d_qkv.data(), 3 * H * hd, d_cos.data(), d_sin.data(), sc, nullptr); };
    const double prep_ms = cuda::median_ms([&] { prep(st_scales); }, a.warmup, a.reps);
    const double prep_dyn_ms = fp8 ? cuda::median_ms([&] { prep(dyn_scales); }, a.warmup, a.reps) : prep_ms;
    prep(st_scales);
    const double attn_ms = cuda::median_ms([&] { attn.attend(d_out.data(), nullptr); }, a.warmup, a.reps);
    // Correctness on the static-scale path: poison, run once, compare head 0.
    FOVEA_CUDA_CHECK(cudaMemset(d_out.data(), 0xFF, d_out.bytes()));
    prep(st_scales);
    attn.attend(d_out.data(), nullptr);
    FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
    ErrorStats e{};
    if (check) {
      std::vector<uint16_t> out16(size_t(N * H * hd));
      FOVEA_CUDA_CHECK(cudaMemcpy(out16.data(), d_out.data(), out16.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<double> out(size_t(N * hd));
      for (int64_t t = 0; t < N; ++t)
        for (int64_t i = 0; i < hd; ++i) out[size_t(t * hd + i)] = bf16_to_float(out16[size_t(t * H * hd + i)]);
      e = compare(out.data(), ref.data(), N * hd);
    }
    const double tflops = shape.flops() / (attn_ms * 1e-3) / 1e12;
    const std::string rel = check ? fmt::format("{:.3e}", e.rel_l2) : "-", mx = check ? fmt::format("{:.3e}", e.max_abs) : "-";
    fmt::print("{:<6} | {:>9.4f} | {:>8.1f} | {:>12.4f} | {:>13.4f} | {:>10.4f} | {:>10} | {:>10}\n", label,
               attn_ms, tflops, prep_ms, prep_dyn_ms, attn_ms + prep_ms, rel, mx);
    nlohmann::ordered_json entry = {{"dtype", dtype_name(d)},     {"backend", backend_name(backend)}, {"attn_ms", attn_ms},
                                    {"fp8_scheme", fp8 ? (robust ? "robust" : "tensor") : "-"},
                                    {"tflops", tflops},           {"prepare_ms", prep_ms},  {"prepare_dynamic_ms", prep_dyn_ms},
                                    {"total_ms", attn_ms + prep_ms}};
    entry["rel_l2"] = num(check ? e.rel_l2 : NAN);  // null when not checked
    entry["max_abs"] = num(check ? e.max_abs : NAN);
    entry["checked_heads"] = check ? 1 : 0;
    results.push_back(entry);
  }
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {{"bench", "attention"}, {"device", "cuda"},  {"gpu", gpu.name},
                                        {"seqlens", seqlens},    {"heads", H},        {"head_dim", hd},
                                        {"dist", a.dist},        {"seed", a.seed},    {"flops", shape.flops()},
                                        {"reps", a.reps},        {"results", results}};
    write_file_atomic(a.json_path, doc.dump(2) + "\n", "--json");
    fmt::print("wrote {}\n", a.json_path);
  }
  return 0;
}

#else

int run_bench_cuda(const Args&, const VarlenShape&, const std::vector<int>&, const std::vector<AttnDtype>&,
                   const std::vector<float>&, const std::vector<Fp8Scheme>&) {
  fail("--device cuda: this fovea was built without CUDA");
}

#endif

}  // namespace

void add_bench_attention(CLI::App* bench, Runner& run) {
  auto* cmd = bench->add_subcommand("attention", "attention accuracy (and time) against the fp64 reference");
  auto a = std::make_shared<Args>();
  cmd->add_option("--seqlens", a->seqlens, "comma list of segment lengths forming one packed batch")
      ->capture_default_str();
  cmd->add_option("--heads", a->heads, "attention heads")->capture_default_str();
  cmd->add_option("--head-dim", a->head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--dist", a->dist, "input distribution: normal | outliers (N(0,1) + N(0,100)*Bernoulli(0.001)) | "
                  "channels (outlier channels per head in Q, K and V)")
      ->capture_default_str();
  cmd->add_option("--dtype", a->dtypes, "comma list of dtypes: bf16, fp8")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu (the reference emulations) or cuda (the GPU kernels)")
      ->capture_default_str();
  cmd->add_option("--backend", a->backend, "comma list of GPU backends: FOVEA, CUDNN (FLASHINFER; BF16 rows only)")->capture_default_str();
  cmd->add_option("--reps", a->reps, "GPU: timed repetitions (median reported)")->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "GPU: untimed warm-up runs")->capture_default_str();
  cmd->add_option("--check", a->check, "GPU: error against fp64 on head 0 (skipped when sum(S^2) > 2^28)")
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)")->capture_default_str();
  cmd->add_option("--json", a->json_path, "write the results as JSON to this file");
  cmd->add_option("--fp8-scheme", a->fp8_schemes,
                  "comma list of FP8 scale schemes: tensor (vLLM's), smooth-k, per-head, per-channel-v, robust (all three; these two on the GPU too), "
                  "rotate (Q and K times an orthonormal DCT), robust+rotate")
      ->capture_default_str();
  cmd->callback([&run, a] { run = [a] { return run_bench(*a); }; });
}

}  // namespace fovea::cli
