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
#include "fovea/attention-gpu.h"
#include "fovea/attention-ref.h"
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
  std::string fp8_exact;  // CPU, measurement only: operands FP8 leaves unquantized (qk, v, p)
  bool rope = false;      // CPU: RoPE on q and k first (the GPU bench always applies it)
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
    {"robust", cpu::kRobustParts},
    {"robust-nosplit", {true, true, true}},
    {"rotate", {false, false, false, true}},
    {"robust+rotate", {true, true, true, true}},
    {"pairs", {false, true, false, false, true}},
    {"robust+pairs", {true, true, true, false, true}},
};

std::vector<Fp8Scheme> parse_schemes(const std::string& s) {
  std::vector<Fp8Scheme> out;
  for (const std::string& item : split_list(s)) {
    const Fp8Scheme* found = nullptr;
    for (const Fp8Scheme& f : kFp8Schemes)
      if (item == f.name) found = &f;
    if (!found)
      fail(
          "--fp8-scheme: '{}' is not one of tensor, smooth-k, per-head, per-channel-v, robust, robust-nosplit, rotate, "
          "robust+rotate, pairs, robust+pairs",
          item);
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

nlohmann::ordered_json num(double x) {
  return std::isfinite(x) ? nlohmann::ordered_json(x) : nlohmann::ordered_json(nullptr);
}

// What both devices bench: the parsed flags and one packed varlen batch.
struct Bench {
  const Args& a;
  VarlenShape shape;
  std::vector<int> seqlens;
  std::vector<AttnDtype> dtypes;
  std::vector<Fp8Scheme> schemes;
  cpu::Fp8Exact exact;  // --fp8-exact
  // Q, K, V as one fused [N, 3, H, hd] buffer (how the encoder's qkv GEMM lays them out); bf16 values.
  std::vector<float> qkv;
};

// Q (which 0), K (1) or V (2) of a fused [N, 3, H, hd] buffer.
ThdView<const float> qkv_view(const std::vector<float>& qkv, int which, int64_t H, int64_t hd) {
  return ThdView<const float>{qkv.data() + which * H * hd, 3 * H * hd, hd};
}

void write_json(const std::string& path, const nlohmann::ordered_json& doc) {
  write_file_atomic(path, doc.dump(2) + "\n", "--json");
  fmt::print("wrote {}\n", path);
}

// ---- --device cpu: the BF16 and FP8 emulations against the fp64 reference --------------------------

struct CpuInputs {
  const VarlenShape& shape;
  ThdView<const float> q, k, v;
};

// One CPU attention into `out`; wall ms.
double timed_attention(const CpuInputs& in, const cpu::RefOptions& o, std::vector<double>& out) {
  const Clock::time_point t0 = Clock::now();
  cpu::attention(in.shape, in.q, in.k, in.v, o, out.data());
  return ms_since(t0);
}

// A table row: BF16 once, FP8 once per scale scheme.
struct CpuRun {
  AttnDtype dtype;
  const Fp8Scheme* scheme;  // FP8 only
};

std::vector<CpuRun> cpu_runs(const Bench& b) {
  std::vector<CpuRun> runs;
  for (AttnDtype d : b.dtypes) {
    if (d != AttnDtype::FP8)
      runs.push_back({d, nullptr});
    else
      for (const Fp8Scheme& sc : b.schemes) runs.push_back({d, &sc});
  }
  return runs;
}

// Runs one row against `ref`, prints it, and returns its JSON entry.
nlohmann::ordered_json cpu_row(const Bench& b, const CpuInputs& in, const CpuRun& run, const std::vector<double>& ref,
                               std::vector<double>& out) {
  const AttnDtype d = run.dtype;
  cpu::RefOptions o;
  o.threads = b.a.threads;
  o.mode = d == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
  nlohmann::ordered_json entry = {{"dtype", dtype_name(d)}, {"backend", "CPU"}};
  if (d == AttnDtype::FP8) {
    // Current scaling, as dynamic mode does it on the first forward: s = amax / 448, per tensor,
    // then the scheme's finer scales where it has them.
    ScaleBook book = ScaleBook::dynamic(1);
    o.fp8_scales = book.record(0, amax(in.shape, in.q), amax(in.shape, in.k), amax(in.shape, in.v));
    o.fp8_fine = cpu::current_fine_scales(in.shape, in.q, in.k, in.v, run.scheme->parts);
    o.fp8_exact = b.exact;
    if (!b.a.fp8_exact.empty()) entry["fp8_exact"] = b.a.fp8_exact;
    entry["fp8_scheme"] = run.scheme->name;
    entry["scales"] = {{"q", o.fp8_scales.q}, {"k", o.fp8_scales.k}, {"v", o.fp8_scales.v}};
    entry["p_scheme"] = {{"p_scale", o.p.p_scale}, {"block_n", o.p.block_n}, {"reverse_kv", o.p.reverse_kv}};
  }
  const double ms = timed_attention(in, o, out);
  const ErrorStats e = compare(out.data(), ref.data(), int64_t(ref.size()));
  fmt::print("{:<6} | {:<13} | {:<8} | {:>12.4e} | {:>12.4e} | {:>12.4e} | {:>10.1f}\n", dtype_name(d),
             run.scheme ? run.scheme->name : "", "CPU", e.rel_l2, e.max_abs, e.mean_abs, ms);
  entry["rel_l2"] = num(e.rel_l2);
  entry["max_abs"] = num(e.max_abs);
  entry["mean_abs"] = num(e.mean_abs);
  entry["nonfinite"] = e.nonfinite;
  entry["ms"] = ms;
  return entry;
}

int run_bench_cpu(const Bench& b) {
  const Args& a = b.a;
  const int64_t N = b.shape.total_tokens(), H = a.heads, hd = a.head_dim;
  std::vector<float> roped;  // --rope: q and k rotated with the GPU bench's tables
  if (a.rope) {
    std::vector<float> cos, sin;
    rope_tables_grid(b.shape, cos, sin);
    roped = b.qkv;
    apply_rope_qk(b.shape, cos, sin, roped);
  }
  const std::vector<float>& qkv = a.rope ? roped : b.qkv;
  const CpuInputs in{b.shape, qkv_view(qkv, 0, H, hd), qkv_view(qkv, 1, H, hd), qkv_view(qkv, 2, H, hd)};
  fmt::print(
      "fovea bench attention | device cpu | seqlens {} ({} segments, {} tokens) | heads {} | head_dim {} | "
      "dist {}{} | seed {}\n",
      a.seqlens, b.shape.num_segments(), N, H, hd, a.dist, a.rope ? " | rope" : "", a.seed);
  std::vector<double> ref(size_t(N * H * hd)), out(ref.size());
  cpu::RefOptions exact;
  exact.threads = a.threads;
  const double ref_ms = timed_attention(in, exact, ref);

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  fmt::print("{:<6} | {:<13} | {:<8} | {:>12} | {:>12} | {:>12} | {:>10}\n", "dtype", "fp8 scheme", "backend", "rel_l2",
             "max_abs", "mean_abs", "ms");
  fmt::print("{:<6} | {:<13} | {:<8} | {:>12} | {:>12} | {:>12} | {:>10.1f}\n", "fp64", "", "CPU", "(reference)", "",
             "", ref_ms);
  for (const CpuRun& run : cpu_runs(b)) results.push_back(cpu_row(b, in, run, ref, out));
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {
        {"bench", "attention"},     {"device", "cpu"},        {"seqlens", b.seqlens}, {"heads", H},
        {"head_dim", hd},           {"dist", a.dist},         {"rope", a.rope},       {"seed", a.seed},
        {"flops", b.shape.flops()}, {"reference_ms", ref_ms}, {"results", results}};
    write_json(a.json_path, doc);
  }
  return 0;
}

int run_bench_cuda(const Bench& b);

int run_bench(const Args& a) {
  if (a.device != "cpu" && a.device != "cuda") fail("--device: '{}' is not one of cpu, cuda", a.device);
  const auto dist = parse_dist(a.dist);
  if (!dist) fail("--dist: '{}' is not one of normal, outliers, channels, key-channels", a.dist);
  std::vector<Fp8Scheme> schemes = parse_schemes(a.fp8_schemes);
  if (a.heads < 1) fail("--heads must be >= 1, got {}", a.heads);
  if (a.head_dim < 1) fail("--head-dim must be >= 1, got {}", a.head_dim);
  std::vector<AttnDtype> dtypes = parse_dtypes(a.dtypes);
  std::vector<int> seqlens = parse_int_list(a.seqlens, "--seqlens", 1);
  const VarlenShape shape = varlen_from_seqlens(seqlens, a.heads, a.head_dim);
  cpu::Fp8Exact exact;
  for (const std::string& p : split_list(a.fp8_exact)) {
    if (p == "qk")
      exact.qk = true;
    else if (p == "v")
      exact.v = true;
    else if (p == "p")
      exact.p = true;
    else
      fail("--fp8-exact: '{}' is not one of qk, v, p", p);
  }
  if (a.device == "cuda" && !a.fp8_exact.empty()) fail("--fp8-exact is for the CPU emulation (--device cpu) only");
  const Bench b{a,
                shape,
                std::move(seqlens),
                std::move(dtypes),
                std::move(schemes),
                exact,
                random_qkv(shape.total_tokens(), a.heads, a.head_dim, *dist, a.seed)};
  if (a.device == "cuda") {
    for (const Fp8Scheme& f : b.schemes)
      if (std::string(f.name) != "tensor" && std::string(f.name) != "robust")
        fail("--fp8-scheme {}: the FOVEA kernels run tensor and robust (--device cpu emulates the others)", f.name);
    return run_bench_cuda(b);
  }
  return run_bench_cpu(b);
}

#if FOVEA_HAVE_CUDA

// ---- --device cuda: the GPU kernels, timed, against the fp64 reference on head 0 --------------------

// --backend: a comma list of FOVEA and CUDNN (FLASHINFER); CUDNN runs the BF16 rows only.
std::vector<AttnBackend> parse_backends(const std::string& list) {
  std::vector<AttnBackend> backends;
  for (const std::string& name : split_list(list)) {
    const auto b = parse_backend(name);
    if (!b || (*b != AttnBackend::FOVEA && *b != AttnBackend::CUDNN))
      fail("--backend: '{}' is not one of FOVEA, CUDNN (FLASHINFER)", name);
    backends.push_back(*b);
  }
  if (backends.empty()) fail("--backend: empty list");
  return backends;
}

// A host vector copied into new device memory.
template <class T>
cuda::DeviceBuffer<T> upload(const std::vector<T>& host) {
  cuda::DeviceBuffer<T> d(host.size());
  if (d.count()) FOVEA_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), d.bytes(), cudaMemcpyHostToDevice));
  return d;
}

// The inputs on the device (fused bf16 qkv, 2D RoPE tables) and the output.
struct DeviceInputs {
  cuda::DeviceBuffer<uint16_t> qkv, out;
  cuda::DeviceBuffer<float> cos, sin;
  std::vector<float> rot;  // host: the fp32 qkv with RoPE applied, for the reference and the scales
};

DeviceInputs upload_inputs(const Bench& b) {
  std::vector<float> cos, sin;
  rope_tables_grid(b.shape, cos, sin);
  std::vector<uint16_t> qkv16(b.qkv.size());
  for (size_t i = 0; i < b.qkv.size(); ++i) qkv16[i] = bf16_from_float(b.qkv[i]);
  const size_t out_size = size_t(b.shape.total_tokens() * b.shape.heads * b.shape.head_dim);
  DeviceInputs in{upload(qkv16), cuda::DeviceBuffer<uint16_t>(out_size), upload(cos), upload(sin), b.qkv};
  apply_rope_qk(b.shape, cos, sin, in.rot);
  return in;
}

// Error against fp64 on head 0 (the reference is O(sum S^2) on the CPU: skipped past 2^28).
bool check_head0(const Bench& b) {
  double s2 = 0;
  for (int n : b.seqlens) s2 += double(n) * n;
  return b.a.check && s2 <= double(1 << 28);
}

std::vector<double> head0_reference(const Bench& b, const std::vector<float>& rot) {
  const int64_t H = b.shape.heads, hd = b.shape.head_dim;
  VarlenShape one = b.shape;
  one.heads = 1;
  std::vector<double> ref(size_t(b.shape.total_tokens() * hd));
  cpu::attention(one, qkv_view(rot, 0, H, hd), qkv_view(rot, 1, H, hd), qkv_view(rot, 2, H, hd), {},
                 ref.data());  // heads = 1: head 0 of each view
  return ref;
}

// The FP8 rows' scales in device memory. Static ones are current scaling of these inputs over all
// heads (what calibration with margin 1 would give), used as given (the C ABI's static path: "prep
// ms") or guarded as the encoder runs them ("prep guard ms", docs/fp8.md §Static guard: these inputs
// stay in their range, so the guard's pass runs and switches nothing); dynamic ones start fresh and
// record on the device.
struct BenchScales {
  cuda::DeviceBuffer<float> fixed;        // per tensor, static: q, k, v
  cuda::DeviceBuffer<LayerAmax> amax;     // per tensor, dynamic
  cuda::DeviceBuffer<GuardCounts> guard;  // static, guarded: the guard's counts
  // The robust scheme's arrays (k_mean, q_head, k_head, v_channel), two sets: 0 static, 1 the one
  // the dynamic runs fill.
  std::vector<cuda::DeviceBuffer<float>> fine;
  cuda::DeviceFineHistory history;                 // the dynamic runs record into a history, as the encoder's layers do
  std::vector<cuda::DeviceBuffer<int32_t>> split;  // the split pairs of each set (none where head_dim has no room)

  cuda::FineArrays fine_arrays(int set) const {
    return cuda::FineArrays{fine[size_t(4 * set)].data(), fine[size_t(4 * set + 1)].data(),
                            fine[size_t(4 * set + 2)].data(), fine[size_t(4 * set + 3)].data(),
                            split[size_t(set)].data()};
  }
  cuda::DeviceScales static_scales(bool robust, bool guarded = false) const {
    GuardCounts* g = guarded ? guard.data() : nullptr;
    return robust ? cuda::robust_static_scales(fine_arrays(0), g) : cuda::tensor_static_scales(fixed.data(), g);
  }
  cuda::DeviceScales dynamic_scales(bool robust) const {
    return robust ? cuda::robust_dynamic_scales(fine_arrays(1), history.ring())
                  : cuda::tensor_dynamic_scales(amax.data());
  }
};

BenchScales make_scales(const Bench& b, const std::vector<float>& rot) {
  const int64_t H = b.shape.heads, hd = b.shape.head_dim;
  auto all = [&](int w) { return qkv_view(rot, w, H, hd); };
  const QkvScales st_all =
      ScaleBook::dynamic(1).record(0, amax(b.shape, all(0)), amax(b.shape, all(1)), amax(b.shape, all(2)));
  LayerAmax fresh;
  for (auto& t : fresh.t) amax_history_reset(t);
  BenchScales sc{upload(std::vector<float>{st_all.q, st_all.k, st_all.v}),
                 upload(std::vector<LayerAmax>{fresh}),
                 upload(std::vector<GuardCounts>(1)),
                 {},
                 cuda::DeviceFineHistory{FineHistory(int(H), int(hd))},
                 {}};
  // Both robust sets start from these inputs' arrays (cpu::current_fine_scales).
  const cpu::Fp8Fine fine = cpu::current_fine_scales(b.shape, all(0), all(1), all(2), cpu::kRobustParts);
  for (int set = 0; set < 2; ++set) {
    for (const std::vector<float>* v : {&fine.k_mean, &fine.q_head, &fine.k_head, &fine.v_channel})
      sc.fine.push_back(upload(*v));
    sc.split.push_back(upload(fine.qk_split));
  }
  return sc;
}

// A table row: one backend and dtype; FOVEA's FP8 once per scale scheme.
struct CudaRun {
  AttnDtype dtype;
  bool robust;
  AttnBackend backend;
};

std::vector<CudaRun> cuda_runs(const Bench& b, const std::vector<AttnBackend>& backends) {
  std::vector<CudaRun> runs;
  for (const AttnBackend be : backends)
    for (AttnDtype d : b.dtypes) {
      if (d != AttnDtype::FP8)
        runs.push_back({d, false, be});  // BF16 has no scale scheme
      else if (be == AttnBackend::FOVEA)
        for (const Fp8Scheme& f : b.schemes) runs.push_back({d, std::string(f.name) == "robust", be});
    }
  return runs;
}

std::unique_ptr<cuda::Attention> make_attention(const CudaRun& run, int heads, int head_dim) {
#if FOVEA_HAVE_CUDNN
  if (run.backend == AttnBackend::CUDNN) return cuda::make_cudnn_attention(run.dtype, heads, head_dim);
#else
  if (run.backend == AttnBackend::CUDNN) fail("--backend CUDNN: this fovea was built without cuDNN");
#endif
  return std::make_unique<cuda::FlashAttention>(run.dtype, heads, head_dim);
}

// What every row reads: the inputs, their scales, and the head-0 reference (empty unless `check`).
struct CudaBench {
  const Bench& b;
  const DeviceInputs& in;
  const BenchScales& scales;
  bool check;
  const std::vector<double>& ref;
};

void prepare(const CudaBench& c, cuda::Attention& attn, const cuda::DeviceScales& sc) {
  const int64_t H = c.b.shape.heads, hd = c.b.shape.head_dim;
  attn.prepare(c.in.qkv.data(), 3 * H * hd, c.in.cos.data(), c.in.sin.data(), sc, nullptr);
}

struct CudaTimes {
  double prep_ms, prep_guard_ms, prep_dyn_ms, attn_ms;  // medians
};

// The prepare step with static scales as given, guarded and dynamic (FP8; BF16 has one), and attend.
CudaTimes time_row(const CudaBench& c, cuda::Attention& attn, const cuda::DeviceScales& st,
                   const cuda::DeviceScales& guarded, const cuda::DeviceScales& dyn, bool fp8) {
  const Args& a = c.b.a;
  CudaTimes t{};
  t.prep_ms = cuda::median_ms([&] { prepare(c, attn, st); }, a.warmup, a.reps);
  t.prep_guard_ms = fp8 ? cuda::median_ms([&] { prepare(c, attn, guarded); }, a.warmup, a.reps) : t.prep_ms;
  t.prep_dyn_ms = fp8 ? cuda::median_ms([&] { prepare(c, attn, dyn); }, a.warmup, a.reps) : t.prep_ms;
  prepare(c, attn, st);
  t.attn_ms = cuda::median_ms([&] { attn.attend(c.in.out.data(), nullptr); }, a.warmup, a.reps);
  return t;
}

// Correctness on the static-scale path: poison, run once, compare head 0 (zeros when not checked).
ErrorStats verify_row(const CudaBench& c, cuda::Attention& attn, const cuda::DeviceScales& st) {
  FOVEA_CUDA_CHECK(cudaMemset(c.in.out.data(), 0xFF, c.in.out.bytes()));
  prepare(c, attn, st);
  attn.attend(c.in.out.data(), nullptr);
  FOVEA_CUDA_CHECK(cudaDeviceSynchronize());
  if (!c.check) return ErrorStats{};
  const int64_t N = c.b.shape.total_tokens(), H = c.b.shape.heads, hd = c.b.shape.head_dim;
  std::vector<uint16_t> out16(size_t(N * H * hd));
  FOVEA_CUDA_CHECK(cudaMemcpy(out16.data(), c.in.out.data(), out16.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<double> out(size_t(N * hd));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t i = 0; i < hd; ++i) out[size_t(t * hd + i)] = bf16_to_float(out16[size_t(t * H * hd + i)]);
  return compare(out.data(), c.ref.data(), N * hd);
}

// Prints the row and returns its JSON entry (error fields "-" and null when not checked).
nlohmann::ordered_json report_row(const CudaBench& c, const CudaRun& run, const CudaTimes& t, const ErrorStats& e) {
  const AttnDtype d = run.dtype;
  const bool fp8 = d == AttnDtype::FP8, cudnn = run.backend == AttnBackend::CUDNN, check = c.check;
  // FP8 rows name the scheme: "fp8" is per-tensor (vLLM's), "fp8-r" the robust one; "cudnn" is the
  // CUDNN backend's BF16.
  const std::string label = cudnn ? "cudnn" : run.robust ? "fp8-r" : dtype_name(d);
  const double tflops = c.b.shape.flops() / (t.attn_ms * 1e-3) / 1e12;
  const std::string rel = check ? fmt::format("{:.3e}", e.rel_l2) : "-",
                    mx = check ? fmt::format("{:.3e}", e.max_abs) : "-";
  fmt::print("{:<6} | {:>9.4f} | {:>8.1f} | {:>12.4f} | {:>13.4f} | {:>13.4f} | {:>10.4f} | {:>10} | {:>10}\n", label,
             t.attn_ms, tflops, t.prep_ms, t.prep_guard_ms, t.prep_dyn_ms, t.attn_ms + t.prep_ms, rel, mx);
  nlohmann::ordered_json entry = {{"dtype", dtype_name(d)},
                                  {"backend", backend_name(run.backend)},
                                  {"attn_ms", t.attn_ms},
                                  {"fp8_scheme", fp8 ? (run.robust ? "robust" : "tensor") : "-"},
                                  {"tflops", tflops},
                                  {"prepare_ms", t.prep_ms},
                                  {"prepare_guard_ms", t.prep_guard_ms},
                                  {"prepare_dynamic_ms", t.prep_dyn_ms},
                                  {"total_ms", t.attn_ms + t.prep_ms}};
  entry["rel_l2"] = num(check ? e.rel_l2 : NAN);  // null when not checked
  entry["max_abs"] = num(check ? e.max_abs : NAN);
  entry["checked_heads"] = check ? 1 : 0;
  return entry;
}

nlohmann::ordered_json cuda_row(const CudaBench& c, const CudaRun& run) {
  const std::unique_ptr<cuda::Attention> attn = make_attention(run, c.b.shape.heads, c.b.shape.head_dim);
  attn->plan(c.b.shape.cu_seqlens);
  const cuda::DeviceScales st = c.scales.static_scales(run.robust), dyn = c.scales.dynamic_scales(run.robust);
  const cuda::DeviceScales guarded = c.scales.static_scales(run.robust, true);
  const CudaTimes t = time_row(c, *attn, st, guarded, dyn, run.dtype == AttnDtype::FP8);
  return report_row(c, run, t, verify_row(c, *attn, st));
}

int run_bench_cuda(const Bench& b) {
  const Args& a = b.a;
  const std::vector<AttnBackend> backends = parse_backends(a.backend);
  if (a.reps < 1) fail("--reps must be >= 1, got {}", a.reps);
  const SystemInfo sys = query_system();
  for (const AttnBackend be : backends)
    for (const AttnDtype d : b.dtypes)
      if (be == AttnBackend::FOVEA || d == AttnDtype::BF16)
        if (auto why = backend_unsupported(be, d, Device::CUDA, sys))
          fail("--device cuda --backend {}: {}", backend_name(be), *why);
  const int64_t N = b.shape.total_tokens(), H = b.shape.heads, hd = b.shape.head_dim;

  const DeviceInputs in = upload_inputs(b);
  const bool check = check_head0(b);
  const std::vector<double> ref = check ? head0_reference(b, in.rot) : std::vector<double>{};
  const BenchScales scales = make_scales(b, in.rot);

  const GpuInfo& gpu = sys.gpus.at(0);
  fmt::print(
      "fovea bench attention | device cuda ({}) | backend FOVEA | seqlens {} ({} segments, {} tokens) | heads {} | "
      "head_dim {} | dist {} | seed {} | median of {}\n",
      gpu.name, a.seqlens, b.shape.num_segments(), N, H, hd, a.dist, a.seed, a.reps);
  fmt::print("{:<6} | {:>9} | {:>8} | {:>12} | {:>13} | {:>13} | {:>10} | {:>10} | {:>10}\n", "dtype", "attn ms",
             "TFLOP/s", "prep ms", "prep guard ms", "prep dyn ms", "total ms", "rel_l2", "max_abs");
  const CudaBench c{b, in, scales, check, ref};
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const CudaRun& run : cuda_runs(b, backends)) results.push_back(cuda_row(c, run));
  if (!a.json_path.empty()) {
    const nlohmann::ordered_json doc = {{"bench", "attention"}, {"device", "cuda"},  {"gpu", gpu.name},
                                        {"seqlens", b.seqlens}, {"heads", H},        {"head_dim", hd},
                                        {"dist", a.dist},       {"seed", a.seed},    {"flops", b.shape.flops()},
                                        {"reps", a.reps},       {"results", results}};
    write_json(a.json_path, doc);
  }
  return 0;
}

#else

int run_bench_cuda(const Bench&) { fail("--device cuda: this fovea was built without CUDA"); }

#endif

}  // namespace

void add_bench_attention(CLI::App* bench, Runner& run) {
  auto* cmd = bench->add_subcommand("attention", "attention accuracy (and time) against the fp64 reference");
  auto a = std::make_shared<Args>();
  cmd->add_option("--seqlens", a->seqlens, "comma list of segment lengths forming one packed batch")
      ->capture_default_str();
  cmd->add_option("--heads", a->heads, "attention heads")->capture_default_str();
  cmd->add_option("--head-dim", a->head_dim, "head dimension")->capture_default_str();
  cmd->add_option("--dist", a->dist,
                  "input distribution: normal | outliers (N(0,1) + N(0,100)*Bernoulli(0.001)) | "
                  "channels (outlier channels per head in Q, K and V) | key-channels (K's outlier channels larger than "
                  "Q's, apart)")
      ->capture_default_str();
  cmd->add_option("--dtype", a->dtypes, "comma list of dtypes: bf16, fp8")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu (the reference emulations) or cuda (the GPU kernels)")
      ->capture_default_str();
  cmd->add_option("--backend", a->backend, "comma list of GPU backends: FOVEA, CUDNN (FLASHINFER; BF16 rows only)")
      ->capture_default_str();
  cmd->add_option("--reps", a->reps, "GPU: timed repetitions (median reported)")->capture_default_str();
  cmd->add_option("--warmup", a->warmup, "GPU: untimed warm-up runs")->capture_default_str();
  cmd->add_option("--check", a->check, "GPU: error against fp64 on head 0 (skipped when sum(S^2) > 2^28)")
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (0: all)")->capture_default_str();
  cmd->add_option("--json", a->json_path, "write the results as JSON to this file");
  cmd->add_option(
      "--fp8-exact", a->fp8_exact,
      "CPU, measurement only: comma list of FP8 operands left unquantized (qk, v, p), to see what E4M3 costs "
      "in each");
  cmd->add_option(
         "--fp8-scheme", a->fp8_schemes,
         "comma list of FP8 scale schemes: tensor (vLLM's), smooth-k, per-head, per-channel-v, robust (all three, "
         "and each head's largest rotary pairs split into two E4M3 terms; these two on the GPU "
         "too), robust-nosplit, rotate (Q and K times an orthonormal DCT), robust+rotate, pairs (Q and K rescaled "
         "per rotary pair, per-head scales), robust+pairs")
      ->capture_default_str();
  cmd->add_option("--rope", a->rope, "--device cpu: apply RoPE to q and k first (the GPU bench always does)")
      ->capture_default_str();
  cmd->callback([&run, a] { run = [a] { return run_bench(*a); }; });
}

}  // namespace fovea::cli
