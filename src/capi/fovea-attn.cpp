// The C ABI of fovea's attention (include/fovea/fovea_attn.h): a thin layer over the backends the
// encoder uses (cuda::Attention: FOVEA, CUDNN) and the CPU reference, with the engine's backend
// rules. No exception crosses it: each entry point runs its body in `guarded`, which turns them into
// status codes and the thread's last error.
#include "fovea/fovea_attn.h"

#include <cmath>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <memory>
#include <string>
#include <vector>

#include "fovea/attention.h"
#include "fovea/attention-gpu.h"
#include "fovea/attention-ref.h"
#include "fovea/bf16.h"
#include "fovea/engine.h"
#include "fovea/error.h"
#include "fovea/fp8-plan.h"
#include "fovea/rope.h"
#include "fovea/scales.h"
#include "fovea/system.h"
#if FOVEA_HAVE_CUDA
#include <cuda_runtime.h>

#include "fovea/cuda-support.h"
#endif

namespace fovea {
namespace {

// LayerAmax is the ABI's fovea_attn_amax_state: the kernels update it in place.
static_assert(sizeof(fovea_attn_amax_history) == sizeof(AmaxHistory));
static_assert(offsetof(fovea_attn_amax_history, scale) == offsetof(AmaxHistory, scale));
static_assert(offsetof(fovea_attn_amax_history, filled) == offsetof(AmaxHistory, filled));
static_assert(offsetof(fovea_attn_amax_history, pos) == offsetof(AmaxHistory, pos));
static_assert(offsetof(fovea_attn_amax_history, updates) == offsetof(AmaxHistory, updates));
static_assert(offsetof(fovea_attn_amax_history, nonfinite) == offsetof(AmaxHistory, nonfinite));
static_assert(sizeof(fovea_attn_amax_state) == sizeof(LayerAmax) && sizeof(LayerAmax) == 252);
static_assert(alignof(fovea_attn_amax_state) == 4 && alignof(LayerAmax) == 4);
static_assert(FOVEA_ATTN_HISTORY_LEN == kAmaxHistoryLen);
static_assert(FOVEA_ATTN_MAX_LAYERS == kMaxScaleLayers);
static_assert(FOVEA_ATTN_SCALES_STATIC == 1 && FOVEA_ATTN_SCALES_ROBUST_DYNAMIC == 4);

struct AbiError : Error {
  int32_t code;
  AbiError(int32_t c, const std::string& what) : Error(what), code(c) {}
};
template <class... Args>
[[noreturn]] void refuse(int32_t code, const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  throw AbiError(code, s.str());
}

thread_local std::string last_error;

// Runs an entry point's body: OK, or the code of what it threw with its message kept. fovea's own
// errors from below (planning, kernels, files) are FOVEA_ATTN_RUNTIME unless the body classified them.
template <class F>
int32_t guarded(const char* fn, F&& body) {
  try {
    body();
    last_error.clear();
    return FOVEA_ATTN_OK;
  } catch (const AbiError& e) {
    last_error = std::string(fn) + ": " + e.what();
    return e.code;
  } catch (const std::bad_alloc&) {
    last_error = std::string(fn) + ": out of host memory";
    return FOVEA_ATTN_RUNTIME;
  } catch (const std::exception& e) {
    last_error = std::string(fn) + ": " + e.what();
    return FOVEA_ATTN_RUNTIME;
  }
}

void need(bool ok, const char* what) {
  if (!ok) refuse(FOVEA_ATTN_INVALID, what);
}

void check_aligned(const void* p, size_t align, const char* name) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0) refuse(FOVEA_ATTN_INVALID, name, " is not ", align, "-byte aligned");
}

// ---- sizes from the caller's numbers -----------------------------------------------------------------
// Every size the caller's numbers make (elements, bytes, extents) is computed with overflow checks and
// must stay within PTRDIFF_MAX bytes, or the call is refused naming the field: nothing is sized,
// indexed or allocated from a product that wrapped. A token's budget is its q, k and v rows
// (3 x heads x head_dim) at the widest element the library keeps for them (the CPU reference's fp64
// output; fp32 scratch, bf16 on the GPU), so every buffer of a planned shape is within it.
constexpr int64_t kMaxBytes = PTRDIFF_MAX;
constexpr int64_t kWidestElement = sizeof(double);

// The product of sizes (each >= 0), or -1 when it exceeds PTRDIFF_MAX.
int64_t size_product(std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(r, f, &r) || r > kMaxBytes) return -1;
  return r;
}

// a x b for a, b >= 0, saturated at INT64_MAX: a bound to compare a stride with, never a size.
int64_t saturated_mul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

int64_t token_bytes(int64_t heads, int64_t head_dim) { return size_product({3, heads, head_dim, kWidestElement}); }

// ---- FP8 state in host memory ------------------------------------------------------------------------
// A dynamic state as fovea_attn_amax_state_init and forwards leave it (a forward writes ring[pos]):
// 0 <= pos < 16, 0 <= filled <= 16, pos == filled until the ring wraps, live slots finite and >= 0.
// The counters and the scale may hold anything (they wrap; the scale is an output).
void check_amax_history(const AmaxHistory& t, const std::string& name, int i) {
  const std::string f = name + ".t[" + std::to_string(i) + "].";
  const char* w = kQkvNames[i];
  if (t.pos < 0 || t.pos >= kAmaxHistoryLen)
    refuse(FOVEA_ATTN_INVALID, f, "pos (", w, "'s ring position) = ", t.pos, " is outside [0, ", kAmaxHistoryLen, ")");
  if (t.filled < 0 || t.filled > kAmaxHistoryLen)
    refuse(FOVEA_ATTN_INVALID, f, "filled (", w, "'s fill count) = ", t.filled, " is outside [0, ", kAmaxHistoryLen,
           "]");
  if (t.filled < kAmaxHistoryLen && t.pos != t.filled)
    refuse(FOVEA_ATTN_INVALID, f, "pos (", w, "'s ring position) = ", t.pos, " with filled = ", t.filled,
           ": a ring that has not wrapped writes slot `filled` next");
  for (int j = 0; j < t.filled; ++j)
    if ((float_bits(t.ring[j]) & 0x7F800000u) == 0x7F800000u || t.ring[j] < 0.0f)  // bit test: immune to fast-math
      refuse(FOVEA_ATTN_INVALID, f, "ring[", j, "] (", w, "'s amax) = ", t.ring[j], " is not a finite number >= 0");
}

void check_amax_state(const LayerAmax& st, const std::string& name) {
  for (int i = 0; i < 3; ++i) check_amax_history(st.t[i], name, i);
}

#if FOVEA_HAVE_CUDA
// Makes the handle's GPU current for a call and restores the caller's (a torch process keeps its own).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FOVEA_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) FOVEA_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};
#endif

}  // namespace
}  // namespace fovea

using namespace fovea;

struct fovea_attn {
  AttnDtype dtype = AttnDtype::BF16;
  AttnBackend backend = AttnBackend::CPU;
  int heads = 0, head_dim = 0, device = FOVEA_ATTN_DEVICE_CPU;
  VarlenShape shape;  // of the last plan (a capacity plan: {0, max_tokens}, the views' extent)
  bool planned = false, prepared = false;
  bool by_capacity = false, scheduled = false;  // fovea_attn_plan_capacity; a schedule since
  // CPU: the prepared inputs as fp32 [N, H, hd] and the options they are attended with.
  std::vector<float> q, k, v;
  cpu::RefOptions opt;
#if FOVEA_HAVE_CUDA
  std::unique_ptr<cuda::Attention> gpu;
  cuda::DeviceBuffer<uint16_t> fused;  // [N, 3, H, hd]: three views gathered for prepare
  cuda::DeviceBuffer<uint16_t> out;    // [N, H, hd]: attend's output when the caller's is strided
  cuda::DeviceBuffer<float> fine;      // FP8 FOVEA: the arrays robust dynamic scaling fills per batch
  cuda::DeviceBuffer<int32_t> split;   // and its split pairs [H * fp8_split_pairs(hd)]
#endif
  int64_t row() const { return int64_t(heads) * head_dim; }
};

namespace fovea {
namespace {

AttnBackend resolve_backend(int32_t backend, AttnDtype dtype, int head_dim, int device) {
  if (backend < FOVEA_ATTN_AUTO || backend > FOVEA_ATTN_CPU) refuse(FOVEA_ATTN_INVALID, "unknown backend ", backend);
  const auto b = AttnBackend(backend);  // the enums share their order
  static_assert(int(AttnBackend::AUTO) == FOVEA_ATTN_AUTO && int(AttnBackend::CPU) == FOVEA_ATTN_CPU);
  if (device == FOVEA_ATTN_DEVICE_CPU) {
    if (b != AttnBackend::AUTO && b != AttnBackend::CPU)
      refuse(FOVEA_ATTN_UNSUPPORTED, "the ", backend_name(b), " backend runs on a GPU (device >= 0), not on the CPU");
    return AttnBackend::CPU;
  }
  if (device < 0) refuse(FOVEA_ATTN_INVALID, "device ", device, " is neither a GPU index nor FOVEA_ATTN_DEVICE_CPU");
  const SystemInfo all = query_system();
  if (!all.cuda_built) refuse(FOVEA_ATTN_UNSUPPORTED, "this fovea was built without CUDA");
  if (size_t(device) >= all.gpus.size())
    refuse(FOVEA_ATTN_INVALID, "device ", device, ": ", all.gpus.size(), " GPU(s) visible",
           all.gpus.empty() ? " (" + all.gpu_error + ")" : "");
  SystemInfo sys = all;  // the engine's rules look at GPU 0: this one
  sys.gpus = {all.gpus[size_t(device)]};
  const auto why = [&](AttnBackend c) -> std::optional<std::string> {
    if (c == AttnBackend::FOVEA && !cuda::flash_supports_head_dim(head_dim))
      return "the FOVEA kernels are built for head_dim 64, 72, 80 and 128, not " + std::to_string(head_dim);
    return backend_unsupported(c, dtype, Device::CUDA, sys);
  };
  const AttnBackend chosen =
      b == AttnBackend::AUTO ? best_backend(dtype, Device::CUDA, sys, cuda::flash_supports_head_dim(head_dim)) : b;
  if (auto w = why(chosen))
    refuse(FOVEA_ATTN_UNSUPPORTED, dtype_name(dtype), " attention on the ", backend_name(chosen), " backend: ", *w);
  return chosen;
}

void check_head_sizes(int32_t heads, int32_t head_dim) {
  if (heads <= 0 || head_dim <= 0 || head_dim % 2 != 0)
    refuse(FOVEA_ATTN_INVALID, "heads must be > 0 and head_dim even and > 0 (got ", heads, ", ", head_dim, ")");
  if (token_bytes(heads, head_dim) < 0)
    refuse(FOVEA_ATTN_INVALID, "heads x head_dim = ", heads, " x ", head_dim,
           ": a token's q, k and v (3 x heads x head_dim x ", kWidestElement, " bytes) exceed PTRDIFF_MAX bytes");
}

// The bytes a view of `n` tokens spans from `data`, (n - 1) x stride_token + (heads - 1) x stride_head +
// head_dim elements of bf16, within PTRDIFF_MAX and the address space.
void check_extent(const fovea_attn& h, const void* data, int64_t stride_token, int64_t stride_head, int64_t row_elems,
                  const char* name) {
  const int64_t n = h.shape.total_tokens();
  int64_t a = 0, b = 0, e = 0;
  const bool wraps = __builtin_mul_overflow(n - 1, stride_token, &a) ||
                     __builtin_mul_overflow(stride_head, int64_t(h.heads) - 1, &b) ||
                     __builtin_add_overflow(a, b, &e) || __builtin_add_overflow(e, row_elems, &e);
  const int64_t bytes = wraps ? -1 : size_product({e, int64_t(sizeof(uint16_t))});
  if (bytes < 0 || reinterpret_cast<uintptr_t>(data) > UINTPTR_MAX - uint64_t(bytes))
    refuse(FOVEA_ATTN_INVALID, name, ": ", n, " tokens at stride_token ", stride_token, " and ", h.heads,
           " heads at stride_head ", stride_head, " reach past PTRDIFF_MAX bytes or the end of the address space");
}

void check_view(const fovea_attn& h, const fovea_attn_view* v, const char* name) {
  if (!v || !v->data) refuse(FOVEA_ATTN_INVALID, name, " is null");
  check_aligned(v->data, sizeof(uint16_t), name);
  if (v->stride_token <= 0 || v->stride_head <= 0)
    refuse(FOVEA_ATTN_INVALID, name, ": strides must be > 0 (token ", v->stride_token, ", head ", v->stride_head, ")");
  check_extent(h, v->data, v->stride_token, v->stride_head, h.head_dim, name);
  // Rows of one token (heads) and of consecutive tokens must not overlap.
  const bool heads_inner = v->stride_head >= h.head_dim && v->stride_token >= saturated_mul(v->stride_head, h.heads);
  const bool tokens_inner =
      v->stride_token >= h.head_dim && v->stride_head >= saturated_mul(v->stride_token, h.shape.total_tokens());
  if (!heads_inner && !tokens_inner)
    refuse(FOVEA_ATTN_INVALID, name, ": strides (token ", v->stride_token, ", head ", v->stride_head,
           ") overlap rows of ", h.head_dim, " elements");
}

// A robust static layer's arrays read from host memory, checked: k_mean finite, the scales finite
// and > 0, the split pairs -1 or distinct pairs of each head.
FineScales host_fine(const fovea_attn& h, const fovea_attn_fine& f) {
  const size_t H = size_t(h.heads), cells = size_t(h.row());
  FineScales o;
  const auto take = [](const float* p, size_t n, bool positive, const char* name) {
    std::vector<float> v(p, p + n);
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(v[i]) || (positive && !(v[i] > 0.0f)))
        refuse(FOVEA_ATTN_INVALID, "robust static scales: ", name, "[", i, "] = ", v[i], " is not a finite number",
               positive ? " > 0" : "");
    return v;
  };
  o.k_mean = take(f.k_mean, cells, false, "k_mean");
  o.q_head = take(f.q_head, H, true, "q_head"), o.k_head = take(f.k_head, H, true, "k_head");
  o.v_channel = take(f.v_channel, cells, true, "v_channel");
  if (const size_t n = H * size_t(fp8_split_pairs(h.head_dim)); n && f.qk_split)  // null: no pair split
    o.qk_split.assign(f.qk_split, f.qk_split + n);
  try {
    check_split_pairs(o.qk_split, h.heads, h.head_dim, "robust static scales: qk_split");
  } catch (const Error& e) {
    refuse(FOVEA_ATTN_INVALID, e.what());
  }
  return o;
}

FineHistory host_robust_state(const fovea_attn& h, const void* state) {
  try {
    return unpack_fine_state(state, h.heads, h.head_dim, "robust state");
  } catch (const Error& e) {
    refuse(FOVEA_ATTN_INVALID, e.what());
  }
}

// What check_scales read from a CPU handle's host memory, checked, for cpu_scales to use as it is.
struct HostScales {
  std::optional<FineScales> fine;    // ROBUST_STATIC
  std::optional<FineHistory> state;  // ROBUST_DYNAMIC
};

HostScales check_scales(const fovea_attn& h, const fovea_attn_scales* s) {
  const int32_t mode = s ? s->mode : FOVEA_ATTN_SCALES_NONE;
  if (h.dtype == AttnDtype::BF16) {
    if (mode != FOVEA_ATTN_SCALES_NONE) refuse(FOVEA_ATTN_INVALID, "FP8 scales given to a BF16 attention");
    return {};
  }
  if ((mode == FOVEA_ATTN_SCALES_ROBUST_STATIC || mode == FOVEA_ATTN_SCALES_ROBUST_DYNAMIC) &&
      int64_t(h.heads) * h.head_dim > kMaxFineScales)
    refuse(FOVEA_ATTN_INVALID, "the robust scheme holds at most ", kMaxFineScales, " (head, channel) cells, not ",
           h.heads, " x ", h.head_dim);
  switch (mode) {
    case FOVEA_ATTN_SCALES_STATIC:
      need(s->fixed != nullptr, "static scales: `fixed` is null");
      check_aligned(s->fixed, alignof(float), "static scales: `fixed`");
      break;
    case FOVEA_ATTN_SCALES_DYNAMIC:
      need(s->state != nullptr, "dynamic scales: `state` is null");
      check_aligned(s->state, alignof(LayerAmax), "dynamic scales: `state`");
      break;
    case FOVEA_ATTN_SCALES_ROBUST_STATIC: {
      need(s->fine != nullptr, "robust static scales: `fine` is null");
      const fovea_attn_fine& f = *s->fine;
      need(f.k_mean && f.q_head && f.k_head && f.v_channel, "robust static scales: an array of `fine` is null");
      for (const float* p : {f.k_mean, f.q_head, f.k_head, f.v_channel})
        check_aligned(p, alignof(float), "robust static scales: an array of `fine`");
      if (fp8_split_pairs(h.head_dim) > 0 && f.qk_split)  // null: no pair split
        check_aligned(f.qk_split, alignof(int32_t), "robust static scales: qk_split");
      break;
    }
    case FOVEA_ATTN_SCALES_ROBUST_DYNAMIC:
      need(s->state != nullptr, "robust dynamic scales: `state` is null");
      check_aligned(s->state, alignof(double), "robust dynamic scales: `state`");
      break;
    default:
      refuse(FOVEA_ATTN_INVALID, "FP8 attention needs static, dynamic, robust static or robust dynamic scales (mode ",
             mode, ")");
  }
  if (s->guard) {
    if (mode != FOVEA_ATTN_SCALES_STATIC && mode != FOVEA_ATTN_SCALES_ROBUST_STATIC)
      refuse(FOVEA_ATTN_INVALID, "the static guard's counts (`guard`) are for static or robust static scales, not ",
             mode == FOVEA_ATTN_SCALES_DYNAMIC ? "dynamic" : "robust dynamic", " ones");
    check_aligned(s->guard, alignof(uint64_t), "the static guard's counts (`guard`)");
  }
  // Host memory is checked before a forward reads or writes it; a GPU handle's is device memory, which
  // the host does not read (prepare makes no host synchronization).
  if (h.backend != AttnBackend::CPU) return {};
  HostScales read;
  if (mode == FOVEA_ATTN_SCALES_DYNAMIC) {
    check_amax_state(*static_cast<const LayerAmax*>(s->state), "amax_state");
  } else if (mode == FOVEA_ATTN_SCALES_ROBUST_STATIC) {
    read.fine = host_fine(h, *s->fine);
  } else if (mode == FOVEA_ATTN_SCALES_ROBUST_DYNAMIC) {
    read.state = host_robust_state(h, s->state);
  } else {
    for (int i = 0; i < 3; ++i)
      if (!(s->fixed[i] > 0.0f) || (float_bits(s->fixed[i]) & 0x7F800000u) == 0x7F800000u)
        refuse(FOVEA_ATTN_INVALID, "static scales: fixed[", i, "] (", kQkvNames[i], ") = ", s->fixed[i],
               " is not a finite number > 0");
  }
  return read;
}

// ---- the CPU reference -----------------------------------------------------------------------------

void cpu_gather(const fovea_attn& h, const fovea_attn_view& v, std::vector<float>& dst) {
  const int64_t n = h.shape.total_tokens();
  dst.resize(size_t(n * h.row()));
  const auto* src = static_cast<const uint16_t*>(v.data);
  for (int64_t t = 0; t < n; ++t)
    for (int hh = 0; hh < h.heads; ++hh)
      for (int d = 0; d < h.head_dim; ++d)
        dst[size_t((t * h.heads + hh) * h.head_dim + d)] =
            bf16_to_float(src[t * v.stride_token + hh * v.stride_head + d]);
}

// The scales the CPU attends with: fixed, or this batch recorded into the host state first (`read`:
// what check_scales read and checked).
void cpu_scales(fovea_attn& h, const fovea_attn_scales* s, HostScales&& read) {
  h.opt.mode = h.dtype == AttnDtype::FP8 ? cpu::RefMode::FP8 : cpu::RefMode::BF16;
  h.opt.fp8_fine = {};
  if (h.dtype != AttnDtype::FP8) return;
  const auto view = [&](const std::vector<float>& x) { return ThdView<const float>{x.data(), h.row(), h.head_dim}; };
  GuardCounts counts;  // the static guard: the caller's counts, written back
  if (s->guard) counts = {s->guard[0], s->guard[1], s->guard[2]};
  const auto count = [&] {
    if (s->guard) s->guard[0] = counts.q, s->guard[1] = counts.k, s->guard[2] = counts.v;
  };
  switch (s->mode) {
    case FOVEA_ATTN_SCALES_STATIC: {
      const QkvScales file = {s->fixed[0], s->fixed[1], s->fixed[2]};
      h.opt.fp8_scales = s->guard ? guard_tensor(file, amax(h.shape, view(h.q)), amax(h.shape, view(h.k)),
                                                 amax(h.shape, view(h.v)), counts)
                                  : file;
      return count();
    }
    case FOVEA_ATTN_SCALES_ROBUST_STATIC:
      h.opt.fp8_fine = cpu::robust_fine(
          s->guard ? guard_fine(*read.fine, cpu::fine_batch(h.shape, view(h.q), view(h.k), view(h.v)), counts)
                   : *read.fine);
      return count();
    case FOVEA_ATTN_SCALES_ROBUST_DYNAMIC: {
      FineHistory& hist = *read.state;
      const FineScales f = record_fine(hist, cpu::fine_batch(h.shape, view(h.q), view(h.k), view(h.v)), "robust state");
      pack_fine_state(hist, s->state);
      h.opt.fp8_fine = cpu::robust_fine(f);
      return;
    }
    default: break;
  }
  auto& st = *static_cast<LayerAmax*>(s->state);
  const std::vector<float>* x[3] = {&h.q, &h.k, &h.v};
  float sc[3];
  for (int i = 0; i < 3; ++i) sc[i] = amax_history_record(st.t[i], amax(h.shape, view(*x[i])));
  h.opt.fp8_scales = {sc[0], sc[1], sc[2]};
}

void cpu_prepare_fused(fovea_attn& h, const void* qkv, int64_t stride, const float* cos, const float* sin) {
  const int64_t n = h.shape.total_tokens(), row = h.row();
  std::vector<float> all(size_t(n * 3 * row));
  const auto* src = static_cast<const uint16_t*>(qkv);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < 3 * row; ++i) all[size_t(t * 3 * row + i)] = bf16_to_float(src[t * stride + i]);
  if (cos) {
    const size_t half = size_t(n) * size_t(h.head_dim / 2);
    apply_rope_qk(h.shape, std::vector<float>(cos, cos + half), std::vector<float>(sin, sin + half), all);
  }
  std::vector<float>* dst[3] = {&h.q, &h.k, &h.v};
  for (int w = 0; w < 3; ++w) {
    dst[w]->resize(size_t(n * row));
    for (int64_t t = 0; t < n; ++t) std::copy_n(all.begin() + (t * 3 + w) * row, row, dst[w]->begin() + t * row);
  }
}

void cpu_attend(fovea_attn& h, const fovea_attn_view& out) {
  const ThdView<const float> q{h.q.data(), h.row(), h.head_dim}, k{h.k.data(), h.row(), h.head_dim},
      v{h.v.data(), h.row(), h.head_dim};
  std::vector<double> o(h.q.size());
  cpu::attention(h.shape, q, k, v, h.opt, o.data());
  auto* dst = static_cast<uint16_t*>(out.data);
  for (int64_t t = 0; t < h.shape.total_tokens(); ++t)
    for (int hh = 0; hh < h.heads; ++hh)
      for (int d = 0; d < h.head_dim; ++d)
        dst[t * out.stride_token + hh * out.stride_head + d] =
            bf16_from_float(float(o[size_t((t * h.heads + hh) * h.head_dim + d)]));
}

// ---- the GPU backends ------------------------------------------------------------------------------
#if FOVEA_HAVE_CUDA
static_assert(sizeof(GuardCounts) == 3 * sizeof(uint64_t) && alignof(GuardCounts) == alignof(uint64_t) &&
              offsetof(GuardCounts, v) == 2 * sizeof(uint64_t));  // fovea_attn_scales.guard is one

cuda::DeviceScales device_scales(fovea_attn& h, const fovea_attn_scales* s) {
  GuardCounts* guard = s ? reinterpret_cast<GuardCounts*>(s->guard) : nullptr;
  switch (s ? s->mode : FOVEA_ATTN_SCALES_NONE) {
    case FOVEA_ATTN_SCALES_STATIC: return cuda::tensor_static_scales(s->fixed, guard);
    case FOVEA_ATTN_SCALES_DYNAMIC: return cuda::tensor_dynamic_scales(static_cast<LayerAmax*>(s->state));
    case FOVEA_ATTN_SCALES_ROBUST_STATIC: {
      const fovea_attn_fine& f = *s->fine;  // prepare reads these arrays, never writes them
      return cuda::robust_static_scales(
          {const_cast<float*>(f.k_mean), const_cast<float*>(f.q_head), const_cast<float*>(f.k_head),
           const_cast<float*>(f.v_channel), const_cast<int32_t*>(f.qk_split)},
          guard);
    }
    case FOVEA_ATTN_SCALES_ROBUST_DYNAMIC: {
      if (!h.fine.data()) refuse(FOVEA_ATTN_UNSUPPORTED, "robust dynamic scales need the FOVEA backend");
      const size_t H = size_t(h.heads), cells = size_t(h.row());
      float* a = h.fine.data();
      return cuda::robust_dynamic_scales({a, a + cells, a + cells + H, a + cells + 2 * H, h.split.data()},
                                         cuda::fine_ring_at(s->state, h.heads, h.head_dim));
    }
    default: return cuda::tensor_static_scales(nullptr);  // BF16
  }
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  FOVEA_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  return st != cudaStreamCaptureStatusNone;
}

// Grows a scratch buffer outside a capture (an allocation cannot be captured).
void ensure(cuda::DeviceBuffer<uint16_t>& buf, size_t count, cudaStream_t stream, const char* what) {
  if (buf.count() >= count) return;
  if (capturing(stream))
    refuse(FOVEA_ATTN_INVALID, what,
           " needs a larger buffer, which cannot be allocated during a CUDA graph capture: "
           "run this shape once before capturing it");
  buf.reset(count);
}

// Copies a [N, H, hd] view into (dst_token_stride, contiguous heads) rows, or back: one 2D copy when
// the view's heads are contiguous, else one per head. Async and capturable.
void copy_rows(void* dst, int64_t dst_token, int64_t dst_head, const void* src, int64_t src_token, int64_t src_head,
               int64_t n, int heads, int hd, cudaStream_t stream) {
  constexpr size_t b = sizeof(uint16_t);
  if (dst_head == hd && src_head == hd) {
    FOVEA_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(dst_token) * b, src, size_t(src_token) * b, size_t(heads) * hd * b,
                                       size_t(n), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  for (int h = 0; h < heads; ++h)
    FOVEA_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint16_t*>(dst) + h * dst_head, size_t(dst_token) * b,
                                       static_cast<const uint16_t*>(src) + h * src_head, size_t(src_token) * b,
                                       size_t(hd) * b, size_t(n), cudaMemcpyDeviceToDevice, stream));
}

void gpu_prepare_views(fovea_attn& h, const fovea_attn_view* const (&x)[3], const fovea_attn_scales* s,
                       cudaStream_t stream) {
  const int64_t n = h.shape.total_tokens(), row = h.row();
  ensure(h.fused, size_t(n * 3 * row), stream, "prepare from three views");
  for (int w = 0; w < 3; ++w)
    copy_rows(h.fused.data() + w * row, 3 * row, h.head_dim, x[w]->data, x[w]->stride_token, x[w]->stride_head, n,
              h.heads, h.head_dim, stream);
  h.gpu->prepare(h.fused.data(), 3 * row, nullptr, nullptr, device_scales(h, s), stream);
}

cuda::FlashAttention& flash_of(fovea_attn& h, const char* what) {
  auto* f = dynamic_cast<cuda::FlashAttention*>(h.gpu.get());
  if (!f)
    refuse(FOVEA_ATTN_UNSUPPORTED, what, ": segments read on the device need the FOVEA backend, not ",
           backend_name(h.backend));
  return *f;
}

void gpu_attend(fovea_attn& h, const fovea_attn_view& out, cudaStream_t stream) {
  const int64_t n = h.shape.total_tokens(), row = h.row();
  const bool packed =
      out.stride_token == row && out.stride_head == h.head_dim && reinterpret_cast<uintptr_t>(out.data) % 16 == 0;
  if (packed) return h.gpu->attend(out.data, stream);
  ensure(h.out, size_t(n * row), stream, "attend into a strided output");
  h.gpu->attend(h.out.data(), stream);
  copy_rows(out.data, out.stride_token, out.stride_head, h.out.data(), row, h.head_dim, n, h.heads, h.head_dim, stream);
}
#endif

void check_layers(int32_t num_layers) {
  if (num_layers <= 0 || num_layers > kMaxScaleLayers)
    refuse(FOVEA_ATTN_INVALID, "num_layers = ", num_layers, " is outside [1, ", kMaxScaleLayers,
           "] (FOVEA_ATTN_MAX_LAYERS)");
}

// cu_seqlens read entry by entry and refused at the first out of order (a num_segments larger than the
// array is not read past it), its token count within the size budget.
std::vector<int32_t> read_cu_seqlens(const fovea_attn& h, const int32_t* cu, int32_t num_segments) {
  need(cu != nullptr, "cu_seqlens is null");
  check_aligned(cu, alignof(int32_t), "cu_seqlens");
  if (num_segments <= 0) refuse(FOVEA_ATTN_INVALID, "num_segments must be > 0, got ", num_segments);
  if (cu[0] != 0) refuse(FOVEA_ATTN_INVALID, "cu_seqlens[0] = ", cu[0], " must be 0");
  std::vector<int32_t> out{0};
  for (int64_t i = 1; i <= int64_t(num_segments); ++i) {
    if (cu[i] <= cu[i - 1])
      refuse(FOVEA_ATTN_INVALID, "cu_seqlens[", i, "] = ", cu[i], " is not above cu_seqlens[", i - 1, "] = ", cu[i - 1],
             " (segment ", i - 1, " would be empty or negative)");
    out.push_back(cu[i]);
  }
  if (size_product({out.back(), token_bytes(h.heads, h.head_dim)}) < 0)
    refuse(FOVEA_ATTN_INVALID, "cu_seqlens[", num_segments, "] = ", out.back(), " tokens of ", h.heads, " heads x ",
           h.head_dim, ": the tokens' q, k and v (tokens x 3 x heads x head_dim x ", kWidestElement,
           " bytes) exceed PTRDIFF_MAX bytes");
  return out;
}

// Per-layer scales as the ABI's [layers * 3] floats.
void write_rows(const std::vector<QkvScales>& s, float* qkv) {
  for (size_t i = 0; i < s.size(); ++i)
    for (int j = 0; j < 3; ++j) qkv[3 * i + size_t(j)] = s[i][j];
}

int32_t scale_mode_of(LayerScheme s) {
  switch (s) {
    case LayerScheme::TENSOR_STATIC: return FOVEA_ATTN_SCALES_STATIC;
    case LayerScheme::TENSOR_DYNAMIC: return FOVEA_ATTN_SCALES_DYNAMIC;
    case LayerScheme::ROBUST_STATIC: return FOVEA_ATTN_SCALES_ROBUST_STATIC;
    case LayerScheme::ROBUST_DYNAMIC: return FOVEA_ATTN_SCALES_ROBUST_DYNAMIC;
  }
  return FOVEA_ATTN_SCALES_NONE;
}

// The robust static layers' arrays of a plan into the caller's layer-major rows (zero rows and -1
// split pairs for the other layers).
void write_fine_rows(const Fp8Plan& plan, int heads, int head_dim, const fovea_attn_fine_rows* rows) {
  need(rows != nullptr, "fine is null, and the file runs the robust scheme on some layers");
  const size_t H = size_t(heads), cells = H * size_t(head_dim), n = H * size_t(fp8_split_pairs(head_dim));
  need(rows->k_mean && rows->q_head && rows->k_head && rows->v_channel && (n == 0 || rows->qk_split),
       "an array of fine is null");
  for (const float* p : {rows->k_mean, rows->q_head, rows->k_head, rows->v_channel})
    check_aligned(p, alignof(float), "an array of fine");
  check_aligned(rows->qk_split, alignof(int32_t), "fine.qk_split");
  for (int l = 0; l < plan.layers(); ++l) {
    const size_t L = size_t(l);
    const bool robust = plan.at(l) == LayerScheme::ROBUST_STATIC;
    const FineScales& f = plan.fine(l);
    const auto put = [&](float* dst, const std::vector<float>& v, size_t len) {
      for (size_t i = 0; i < len; ++i) dst[L * len + i] = robust ? v[i] : 0.0f;
    };
    put(rows->k_mean, f.k_mean, cells), put(rows->v_channel, f.v_channel, cells);
    put(rows->q_head, f.q_head, H), put(rows->k_head, f.k_head, H);
    for (size_t i = 0; i < n; ++i) rows->qk_split[L * n + i] = robust && !f.qk_split.empty() ? f.qk_split[i] : -1;
  }
}

fovea_attn& handle(fovea_attn* h) {
  if (!h) refuse(FOVEA_ATTN_INVALID, "the handle is null");
  return *h;
}

}  // namespace
}  // namespace fovea

extern "C" {

int32_t fovea_attn_abi_version(void) { return FOVEA_ATTN_ABI_VERSION; }
const char* fovea_attn_version(void) { return FOVEA_VERSION; }
const char* fovea_attn_last_error(void) { return last_error.c_str(); }

void fovea_attn_amax_state_init(fovea_attn_amax_state* state) {
  if (!state) return;
  for (auto& t : state->t) {
    AmaxHistory h;
    amax_history_reset(h);
    std::memcpy(&t, &h, sizeof h);
  }
}

int32_t fovea_attn_set_allocator(fovea_attn_alloc_fn alloc, fovea_attn_free_fn free_fn, void* ctx) {
  return guarded("fovea_attn_set_allocator", [&] {
    if (!alloc != !free_fn)
      refuse(FOVEA_ATTN_INVALID, "alloc and free must both be set (an allocator) or both be NULL (cudaMalloc)");
#if FOVEA_HAVE_CUDA
    cuda::set_device_allocator({alloc, free_fn, alloc ? ctx : nullptr});
#else
    (void)ctx;  // a CPU-only build makes no device buffers
#endif
  });
}

int32_t fovea_attn_create(int32_t dtype, int32_t backend, int32_t heads, int32_t head_dim, int32_t device,
                          fovea_attn** out) {
  return guarded("fovea_attn_create", [&] {
    need(out != nullptr, "`out` is null");
    *out = nullptr;
    if (dtype != FOVEA_ATTN_BF16 && dtype != FOVEA_ATTN_FP8) refuse(FOVEA_ATTN_INVALID, "unknown dtype ", dtype);
    check_head_sizes(heads, head_dim);
    auto h = std::make_unique<fovea_attn>();
    h->dtype = dtype == FOVEA_ATTN_FP8 ? AttnDtype::FP8 : AttnDtype::BF16;
    h->heads = heads, h->head_dim = head_dim, h->device = device;
    h->backend = resolve_backend(backend, h->dtype, head_dim, device);
#if FOVEA_HAVE_CUDA
    if (h->backend != AttnBackend::CPU) {
      DeviceGuard g(device);
      if (h->backend == AttnBackend::FOVEA) {
        h->gpu = std::make_unique<cuda::FlashAttention>(h->dtype, heads, head_dim);
        if (h->dtype == AttnDtype::FP8) {  // made here: a capture of robust dynamic prepare cannot allocate
          h->fine.reset(size_t(h->row()) * 2 + size_t(heads) * 2);
          if (const size_t n = size_t(heads) * size_t(fp8_split_pairs(head_dim))) h->split.reset(n);
        }
      } else
        h->gpu = cuda::make_cudnn_attention(h->dtype, heads, head_dim);
    }
#endif
    *out = h.release();
  });
}

void fovea_attn_destroy(fovea_attn* h) {
  if (!h) return;
#if FOVEA_HAVE_CUDA
  if (h->gpu) {
    try {
      DeviceGuard g(h->device);  // its buffers are freed on their own device
      delete h;
      return;
    } catch (...) {}
  }
#endif
  delete h;
}

int32_t fovea_attn_backend_of(const fovea_attn* h) { return h ? int32_t(h->backend) : -1; }

int32_t fovea_attn_plan(fovea_attn* hp, const int32_t* cu_seqlens, int32_t num_segments, void* stream) {
  return guarded("fovea_attn_plan", [&] {
    fovea_attn& h = handle(hp);
    h.planned = h.prepared = h.scheduled = false;
    VarlenShape shape{read_cu_seqlens(h, cu_seqlens, num_segments), h.heads, h.head_dim};
    try {
      shape.validate();
    } catch (const Error& e) {
      refuse(FOVEA_ATTN_INVALID, e.what());
    }
#if FOVEA_HAVE_CUDA
    if (h.gpu) {
      DeviceGuard g(h.device);
      h.gpu->plan(shape.cu_seqlens, static_cast<cudaStream_t>(stream));
    }
#endif
    (void)stream;
    h.shape = std::move(shape);
    h.planned = true;
    h.by_capacity = false;
  });
}

int32_t fovea_attn_plan_capacity(fovea_attn* hp, int64_t max_tokens, int32_t max_segments, int32_t max_seqlen) {
  return guarded("fovea_attn_plan_capacity", [&] {
    fovea_attn& h = handle(hp);
    h.planned = h.prepared = h.scheduled = false;
    if (max_tokens < 1 || max_tokens > INT32_MAX)
      refuse(FOVEA_ATTN_INVALID, "max_tokens = ", max_tokens, " is outside [1, 2^31 - 1]");
    if (max_segments < 1) refuse(FOVEA_ATTN_INVALID, "max_segments = ", max_segments, " must be > 0");
    if (max_seqlen < 0 || max_seqlen > max_tokens)
      refuse(FOVEA_ATTN_INVALID, "max_seqlen = ", max_seqlen, " is outside [0, max_tokens = ", max_tokens, "]");
    if (size_product({max_tokens, token_bytes(h.heads, h.head_dim)}) < 0)
      refuse(FOVEA_ATTN_INVALID, "max_tokens = ", max_tokens, " tokens of ", h.heads, " heads x ", h.head_dim,
             " exceed PTRDIFF_MAX bytes");
#if FOVEA_HAVE_CUDA
    if (h.gpu) {
      DeviceGuard g(h.device);
      flash_of(h, "fovea_attn_plan_capacity").plan_capacity(max_tokens, max_segments, max_seqlen);
      h.shape = VarlenShape{{0, int32_t(max_tokens)}, h.heads, h.head_dim};
      h.planned = h.by_capacity = true;
      return;
    }
#endif
    refuse(FOVEA_ATTN_UNSUPPORTED, "fovea_attn_plan_capacity: segments read on the device need a GPU handle");
  });
}

int32_t fovea_attn_schedule(fovea_attn* hp, const int32_t* cu_seqlens, int32_t num_segments, void* stream) {
  return guarded("fovea_attn_schedule", [&] {
    fovea_attn& h = handle(hp);
    if (!h.planned || !h.by_capacity) refuse(FOVEA_ATTN_INVALID, "schedule before plan_capacity");
    need(cu_seqlens != nullptr, "cu_seqlens is null");
    check_aligned(cu_seqlens, alignof(int32_t), "cu_seqlens");
    if (num_segments <= 0) refuse(FOVEA_ATTN_INVALID, "num_segments must be > 0, got ", num_segments);
    h.prepared = false;
#if FOVEA_HAVE_CUDA
    cuda::FlashAttention& f = flash_of(h, "fovea_attn_schedule");
    DeviceGuard g(h.device);
    try {
      f.schedule(cu_seqlens, num_segments, static_cast<cudaStream_t>(stream));
    } catch (const Error& e) {
      refuse(FOVEA_ATTN_INVALID, e.what());
    }
    h.scheduled = true;
#else
    (void)stream;
#endif
  });
}

int32_t fovea_attn_layout_error(fovea_attn* hp, void* stream, int32_t* out) {
  return guarded("fovea_attn_layout_error", [&] {
    fovea_attn& h = handle(hp);
    need(out != nullptr, "out is null");
    if (!h.scheduled) refuse(FOVEA_ATTN_INVALID, "layout_error before schedule");
#if FOVEA_HAVE_CUDA
    DeviceGuard g(h.device);
    *out = flash_of(h, "fovea_attn_layout_error").layout_error(static_cast<cudaStream_t>(stream));
#else
    (void)stream;
#endif
  });
}

int32_t fovea_attn_prepare(fovea_attn* hp, const fovea_attn_view* q, const fovea_attn_view* k, const fovea_attn_view* v,
                           const fovea_attn_scales* scales, float softmax_scale, void* stream) {
  return guarded("fovea_attn_prepare", [&] {
    fovea_attn& h = handle(hp);
    if (!h.planned) refuse(FOVEA_ATTN_INVALID, "prepare before plan");
    if (h.by_capacity && !h.scheduled) refuse(FOVEA_ATTN_INVALID, "prepare before schedule (a capacity plan)");
    const float want = 1.0f / std::sqrt(float(h.head_dim));
    if (softmax_scale != 0.0f && !(std::fabs(softmax_scale - want) <= 1e-6f * want))
      refuse(FOVEA_ATTN_UNSUPPORTED, "softmax scale ", softmax_scale, ": the kernels take 1/sqrt(head_dim) = ", want,
             " only");
    check_view(h, q, "q"), check_view(h, k, "k"), check_view(h, v, "v");
    HostScales read = check_scales(h, scales);
    h.prepared = false;
#if FOVEA_HAVE_CUDA
    if (h.gpu) {
      DeviceGuard g(h.device);
      gpu_prepare_views(h, {q, k, v}, scales, static_cast<cudaStream_t>(stream));
      h.prepared = true;
      return;
    }
#endif
    (void)stream;
    cpu_gather(h, *q, h.q), cpu_gather(h, *k, h.k), cpu_gather(h, *v, h.v);
    cpu_scales(h, scales, std::move(read));
    h.prepared = true;
  });
}

int32_t fovea_attn_prepare_fused(fovea_attn* hp, const void* qkv, int64_t token_stride, const float* rope_cos,
                                 const float* rope_sin, const fovea_attn_scales* scales, void* stream) {
  return guarded("fovea_attn_prepare_fused", [&] {
    fovea_attn& h = handle(hp);
    if (!h.planned) refuse(FOVEA_ATTN_INVALID, "prepare before plan");
    if (h.by_capacity && !h.scheduled) refuse(FOVEA_ATTN_INVALID, "prepare before schedule (a capacity plan)");
    need(qkv != nullptr, "qkv is null");
    if (bool(rope_cos) != bool(rope_sin)) refuse(FOVEA_ATTN_INVALID, "give both RoPE tables or neither");
    check_aligned(rope_cos, alignof(float), "rope_cos"), check_aligned(rope_sin, alignof(float), "rope_sin");
    if (token_stride < 3 * h.row() || token_stride % 8 != 0 || reinterpret_cast<uintptr_t>(qkv) % 16 != 0)
      refuse(FOVEA_ATTN_INVALID, "qkv: token stride ", token_stride, " must be >= 3*heads*head_dim = ", 3 * h.row(),
             " and a multiple of 8, and the buffer 16-byte aligned");
    check_extent(h, qkv, token_stride, 0, 3 * h.row(), "qkv");
    HostScales read = check_scales(h, scales);
    h.prepared = false;
#if FOVEA_HAVE_CUDA
    if (h.gpu) {
      DeviceGuard g(h.device);
      h.gpu->prepare(qkv, token_stride, rope_cos, rope_sin, device_scales(h, scales),
                     static_cast<cudaStream_t>(stream));
      h.prepared = true;
      return;
    }
#endif
    (void)stream;
    cpu_prepare_fused(h, qkv, token_stride, rope_cos, rope_sin);
    cpu_scales(h, scales, std::move(read));
    h.prepared = true;
  });
}

int32_t fovea_attn_attend(fovea_attn* hp, const fovea_attn_view* out, void* stream) {
  return guarded("fovea_attn_attend", [&] {
    fovea_attn& h = handle(hp);
    if (!h.prepared) refuse(FOVEA_ATTN_INVALID, "attend before prepare");
    check_view(h, out, "out");
#if FOVEA_HAVE_CUDA
    if (h.gpu) {
      DeviceGuard g(h.device);
      gpu_attend(h, *out, static_cast<cudaStream_t>(stream));
      return;
    }
#endif
    (void)stream;
    cpu_attend(h, *out);
  });
}

int32_t fovea_attn_scale_file_read(const char* path, int32_t num_layers, float* qkv) {
  return guarded("fovea_attn_scale_file_read", [&] {
    need(path && qkv, "path or qkv is null");
    check_aligned(qkv, alignof(float), "qkv");
    check_layers(num_layers);
    const std::vector<QkvScales> s = scales_for_model(read_scale_file(path), num_layers);
    write_rows(s, qkv);
  });
}

int32_t fovea_attn_scale_file_write(const char* path, int32_t num_layers, const float* qkv) {
  return guarded("fovea_attn_scale_file_write", [&] {
    need(path && qkv, "path or qkv is null");
    check_aligned(qkv, alignof(float), "qkv");
    check_layers(num_layers);
    std::vector<QkvScales> s(static_cast<size_t>(num_layers));
    for (int32_t i = 0; i < num_layers; ++i) {
      s[size_t(i)] = {qkv[3 * i], qkv[3 * i + 1], qkv[3 * i + 2]};
      for (int j = 0; j < 3; ++j)
        if (!(std::isfinite(qkv[3 * i + j]) && qkv[3 * i + j] > 0))
          refuse(FOVEA_ATTN_INVALID, "layer ", i, ": scale ", kQkvNames[j], " = ", qkv[3 * i + j],
                 " is not a finite number > 0");
    }
    write_scale_file(path, s);
  });
}

int32_t fovea_attn_calibrated_scales(const fovea_attn_amax_state* states, int32_t num_layers, float margin,
                                     float* qkv) {
  return guarded("fovea_attn_calibrated_scales", [&] {
    need(states && qkv, "states or qkv is null");
    check_aligned(states, alignof(LayerAmax), "states"), check_aligned(qkv, alignof(float), "qkv");
    check_layers(num_layers);
    if (!(margin > 0) || !std::isfinite(margin))
      refuse(FOVEA_ATTN_INVALID, "margin must be a finite number > 0, got ", margin);
    ScaleBook book = ScaleBook::dynamic(num_layers);
    for (int32_t i = 0; i < num_layers; ++i) {
      std::memcpy(&book.amax_state()[size_t(i)], &states[i], sizeof(LayerAmax));
      check_amax_state(book.amax_state()[size_t(i)], "states[" + std::to_string(i) + "]");
    }
    const std::vector<QkvScales> s = book.calibrated(margin);
    write_rows(s, qkv);
  });
}

int32_t fovea_attn_split_pairs(int32_t head_dim) {
  return head_dim > 0 && head_dim <= kMaxFineScales ? fp8_split_pairs(head_dim) : 0;  // no robust state is wider
}

int64_t fovea_attn_robust_state_bytes(int32_t heads, int32_t head_dim) {
  if (heads <= 0 || head_dim <= 0 || int64_t(heads) * head_dim > kMaxFineScales) return -1;
  return int64_t(FineStateLayout(heads, head_dim).bytes);
}

int32_t fovea_attn_robust_state_init(void* state, int64_t bytes, int32_t heads, int32_t head_dim) {
  return guarded("fovea_attn_robust_state_init", [&] {
    need(state != nullptr, "state is null");
    check_aligned(state, alignof(double), "state");
    const int64_t want = fovea_attn_robust_state_bytes(heads, head_dim);
    if (want < 0)
      refuse(FOVEA_ATTN_INVALID, "heads x head_dim = ", heads, " x ", head_dim, ": both must be > 0, at most ",
             kMaxFineScales, " cells");
    if (bytes != want)
      refuse(FOVEA_ATTN_INVALID, "a robust state of ", heads, " heads x ", head_dim, " is ", want, " bytes, not ",
             bytes);
    pack_fine_state(FineHistory(heads, head_dim), state);
  });
}

int32_t fovea_attn_robust_state_forwards(const void* state, int64_t bytes, int32_t heads, int32_t head_dim,
                                         uint32_t* forwards) {
  return guarded("fovea_attn_robust_state_forwards", [&] {
    need(state != nullptr && forwards != nullptr, "state or forwards is null");
    check_aligned(state, alignof(double), "state");
    const int64_t want = fovea_attn_robust_state_bytes(heads, head_dim);
    if (want < 0 || bytes != want)
      refuse(FOVEA_ATTN_INVALID, "a robust state of ", heads, " heads x ", head_dim, " is ", want, " bytes, not ",
             bytes);
    try {
      *forwards = unpack_fine_state(state, heads, head_dim, "robust state").counts.updates;
    } catch (const Error& e) {
      refuse(FOVEA_ATTN_INVALID, e.what());
    }
  });
}

int32_t fovea_attn_robust_calibrate(const void* states, int32_t num_layers, int32_t heads, int32_t head_dim,
                                    float margin, const char* path) {
  return guarded("fovea_attn_robust_calibrate", [&] {
    need(states && path, "states or path is null");
    check_aligned(states, alignof(double), "states");
    check_layers(num_layers);
    const int64_t bytes = fovea_attn_robust_state_bytes(heads, head_dim);
    if (bytes < 0)
      refuse(FOVEA_ATTN_INVALID, "heads x head_dim = ", heads, " x ", head_dim, " is not a robust state's");
    if (!(margin > 0) || !std::isfinite(margin))
      refuse(FOVEA_ATTN_INVALID, "margin must be a finite number > 0, got ", margin);
    ScaleBook book = ScaleBook::dynamic(num_layers);
    book.enable_fine(heads, head_dim);
    for (int32_t i = 0; i < num_layers; ++i) {
      const auto* at = static_cast<const uint8_t*>(states) + size_t(i) * size_t(bytes);
      try {
        book.fine_state()[size_t(i)] = unpack_fine_state(at, heads, head_dim, "states[" + std::to_string(i) + "]");
      } catch (const Error& e) {
        refuse(FOVEA_ATTN_INVALID, e.what());
      }
    }
    book.save(path, margin);
  });
}

int32_t fovea_attn_fp8_plan(const char* scheme, const char* path, int32_t calibrating, int32_t num_layers,
                            int32_t heads, int32_t head_dim, int32_t* modes, float* qkv,
                            const fovea_attn_fine_rows* fine) {
  return guarded("fovea_attn_fp8_plan", [&] {
    need(scheme && modes, "scheme or modes is null");
    const std::optional<SchemeChoice> c = parse_scheme_choice(scheme);
    if (!c) refuse(FOVEA_ATTN_INVALID, "scheme '", scheme, "' is not one of auto, tensor, robust");
    check_layers(num_layers);
    check_aligned(modes, alignof(int32_t), "modes");
    if (fovea_attn_robust_state_bytes(heads, head_dim) < 0)
      refuse(FOVEA_ATTN_INVALID, "heads x head_dim = ", heads, " x ", head_dim, ": both must be > 0, at most ",
             kMaxFineScales, " cells");
    std::optional<ScaleFile> file;
    if (path) {
      need(qkv != nullptr, "qkv is null (a scale file's per-tensor scales go there)");
      check_aligned(qkv, alignof(float), "qkv");
      file = read_scale_file(path);
    }
    const ScaleMode mode = path ? ScaleMode::STATIC : calibrating ? ScaleMode::CALIBRATE : ScaleMode::DYNAMIC;
    Fp8Plan plan;
    try {
      if (file) write_rows(scales_for_model(*file, num_layers), qkv);
      plan = Fp8Plan::choose(*c, mode, file ? &*file : nullptr, num_layers, heads, head_dim);
    } catch (const Error& e) {
      refuse(FOVEA_ATTN_INVALID, path ? std::string(path) + ": " : std::string(), e.what());
    }
    if (plan.any(LayerScheme::ROBUST_STATIC)) write_fine_rows(plan, heads, head_dim, fine);
    for (int32_t l = 0; l < num_layers; ++l) modes[l] = scale_mode_of(plan.at(l));
  });
}

}  // extern "C"
