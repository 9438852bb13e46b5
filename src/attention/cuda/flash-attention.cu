// fovea::cuda::FlashAttention: plans a capacity (buffers, TMA descriptors, grids), schedules a layout
// on the device, and runs the prepare step and the flash kernel (schedule.cu, prepare.cu,
// flash-fwd.cu).
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>

#include "attention/cuda/head-dims.cuh"
#include "attention/cuda/kernels.cuh"
#include "attention/cuda/layout.cuh"
#include "attention/cuda/tile-plan.h"
#include "fovea/attention.h"
#include "fovea/attention-gpu.h"

namespace fovea::cuda {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (!fn) fail_cat("FOVEA attention: the CUDA driver has no cuTensorMapEncodeTiled (driver too old?)");
  return fn;
}

// A 3D tiled tensor map over a [d2][d1][d0] array of elem-byte elements.
CUtensorMap tensor_map(void* base, bool fp8, uint64_t d0, uint64_t d1, uint64_t d2, uint32_t box0, uint32_t box1,
                       CUtensorMapSwizzle swizzle) {
  const uint64_t es = fp8 ? 1 : 2;
  const cuuint64_t dims[3] = {d0, d1, d2};
  const cuuint64_t strides[2] = {d0 * es, d0 * d1 * es};
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUtensorMap m;
  const CUresult r = encode_fn()(&m, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base,
                                 dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    fail_cat("FOVEA attention: cuTensorMapEncodeTiled failed (", int(r), ") for dims ", d0, "x", d1, "x", d2, " box ",
             box0, "x", box1);
  return m;
}

// Grows dst (it never shrinks; a free waits for the GPU) to hold src, copies src into pinned memory
// at *h and enqueues its upload from there; *h moves past it (16-byte aligned).
template <class T>
void upload(DeviceBuffer<T>& dst, const std::vector<T>& src, uint8_t*& h, cudaStream_t stream) {
  if (src.size() > dst.count()) dst.reset(src.size());
  std::memcpy(h, src.data(), src.size() * sizeof(T));
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(dst.data(), h, src.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  h += (src.size() * sizeof(T) + 15) / 16 * 16;
}

}  // namespace

struct FlashAttention::Impl {
  AttnDtype dtype;
  bool fp8;
  VarlenShape shape;    // heads and head_dim; cu_seqlens: the host layout of plan(), empty after plan_capacity()
  int hd_pad = 0;       // Q / K row width (layout.cuh)
  int hd_pad_wide = 0;  // the robust scheme's (FP8 at head_dim 64 and 128: wider; else hd_pad)
  // Capacity (what the buffers, descriptors and grids are sized for) and the scheduled layout's
  // segment count.
  int64_t max_tokens = 0, n_pad = 0;
  int max_segments = 0, max_tiles = 0, segments = 0;
  int consumers = 2;                     // consumer warpgroups of this plan's CTAs (tile-plan.h)
  int sms = 0;                           // the device's SM count
  DeviceBuffer<int32_t> d_cu_in;         // plan()'s host layout, uploaded
  DeviceBuffer<int32_t> d_cu, d_cu_pad;  // the schedule step's outputs
  DeviceBuffer<int2> d_tiles;
  DeviceBuffer<int32_t> d_sched;         // [0] tiles listed, [1] the layout's status
  DeviceBuffer<uint8_t> buf;             // q, k and v^t, one allocation
  DeviceBuffer<unsigned int> d_scratch;  // amax scratch [3] + CTA counter
  DeviceBuffer<uint8_t> d_fine_scratch;  // FP8: FineScratch's arrays (robust scheme, current scaling)
  FineScratch fine_scratch;
  // FP8: the scales a guarded static layer quantizes with (the static guard writes them, prepare and
  // the flash kernel read them; the caller's stay as given): per tensor q, k, v [3], then the robust
  // scheme's q_head [H], k_head [H] and v_channel [H * hd].
  DeviceBuffer<float> d_guarded;
  DeviceBuffer<int32_t> d_no_split;  // FP8: H * fp8_split_pairs(hd) -1s, for robust arrays without qk_split
  StagingSlot staging[2];            // the plan uploads' pinned sources, alternately
  int next_staging = 0;
  FlashMaps maps{}, maps_wide{};  // maps_wide: Q and K over hd_pad_wide (where it differs)
  const float* scale_ptr[3] = {nullptr, nullptr, nullptr};
  bool fine = false;  // the last prepare() used the robust scheme's arrays (and its rows)
  bool planned = false, scheduled = false, prepared = false;

  void* q() const { return buf.data(); }
  void* k() const { return buf.data() + qk_bytes(); }
  void* vt() const { return buf.data() + 2 * qk_bytes(); }
  size_t es() const { return fp8 ? 1 : 2; }
  size_t qk_bytes() const { return size_t(shape.heads) * n_pad * hd_pad_wide * es(); }  // either width fits
  size_t v_bytes() const { return size_t(shape.heads) * shape.head_dim * n_pad * es(); }
  // Sizes everything for the capacity (n_pad padded rows, max_tiles tiles of 64 * consumers rows).
  void reserve(int64_t tokens, int segs, int64_t rows, int64_t tiles, int warpgroups);
};

FlashAttention::FlashAttention(AttnDtype dtype, int heads, int head_dim) : impl_(std::make_unique<Impl>()) {
  if (dtype != AttnDtype::BF16 && dtype != AttnDtype::FP8) fail_cat("FOVEA attention: dtype must be bf16 or fp8");
  if (!flash_supports_head_dim(head_dim)) fail_head_dim(head_dim);
  if (heads <= 0) fail_cat("FOVEA attention: heads must be > 0, got ", heads);
  impl_->dtype = dtype;
  impl_->fp8 = dtype == AttnDtype::FP8;
  impl_->shape.heads = heads;
  impl_->shape.head_dim = head_dim;
  impl_->hd_pad = layout::qk_pad(head_dim, impl_->fp8, false);
  impl_->hd_pad_wide = layout::qk_pad(head_dim, impl_->fp8, true);
  int dev = 0;
  FOVEA_CUDA_CHECK(cudaGetDevice(&dev));
  FOVEA_CUDA_CHECK(cudaDeviceGetAttribute(&impl_->sms, cudaDevAttrMultiProcessorCount, dev));
  impl_->d_scratch.reset(4);
  FOVEA_CUDA_CHECK(cudaMemset(impl_->d_scratch.data(), 0, impl_->d_scratch.bytes()));
  if (impl_->fp8) {  // allocated here, not in prepare(), which a CUDA graph may capture
    const size_t cells = size_t(heads) * size_t(head_dim);
    Impl& m = *impl_;
    m.d_fine_scratch.reset(cells * (8 + 6 * 4) + size_t(heads) * 4 * 4 + 8);
    uint8_t* b = m.d_fine_scratch.data();
    m.fine_scratch.k_sum = reinterpret_cast<double*>(b);
    m.fine_scratch.k_max = reinterpret_cast<unsigned int*>(b + cells * 8);
    m.fine_scratch.k_neg_max = m.fine_scratch.k_max + cells;
    m.fine_scratch.v_amax = m.fine_scratch.k_neg_max + cells;
    m.fine_scratch.q_amax = m.fine_scratch.v_amax + cells;
    m.fine_scratch.done = m.fine_scratch.q_amax + cells;
    m.fine_scratch.bad = m.fine_scratch.done + 1;
    float* prev = reinterpret_cast<float*>(m.fine_scratch.bad + 1);
    for (int i = 0; i < 2; ++i, prev += cells) m.fine_scratch.v_prev[i] = prev;
    for (int i = 0; i < 2; ++i, prev += 2 * heads)
      m.fine_scratch.q_prev[i] = prev, m.fine_scratch.k_prev[i] = prev + heads;
    FOVEA_CUDA_CHECK(cudaMemset(b, 0, m.d_fine_scratch.bytes()));
    m.d_guarded.reset(3 + 2 * size_t(heads) + cells);
    if (const size_t n = size_t(heads) * size_t(fp8_split_pairs(head_dim))) {
      m.d_no_split.reset(n);
      FOVEA_CUDA_CHECK(cudaMemset(m.d_no_split.data(), 0xFF, m.d_no_split.bytes()));  // -1: no pair split
    }
  }
}

FlashAttention::~FlashAttention() = default;

const VarlenShape& FlashAttention::shape() const { return impl_->shape; }
AttnDtype FlashAttention::dtype() const { return impl_->dtype; }

void FlashAttention::Impl::reserve(int64_t tokens, int segs, int64_t rows, int64_t tiles, int warpgroups) {
  planned = scheduled = prepared = false;  // until the plan is complete (a throw leaves no stale plan)
  if (rows > INT32_MAX) fail_cat("FOVEA attention: ", rows, " padded tokens exceed int32");
  if (tiles > INT32_MAX) fail_cat("FOVEA attention: ", tiles, " query tiles exceed int32");
  max_tokens = tokens, max_segments = segs, n_pad = rows, max_tiles = int(tiles), consumers = warpgroups;
  if (size_t(segs) + 1 > d_cu.count()) d_cu.reset(size_t(segs) + 1), d_cu_pad.reset(size_t(segs) + 1);
  if (size_t(tiles) > d_tiles.count()) d_tiles.reset(size_t(tiles));
  if (d_sched.count() < 2) d_sched.reset(2);
  const size_t need = 2 * qk_bytes() + v_bytes();
  if (need > buf.count()) buf.reset(need);
  const int H = shape.heads, hd = shape.head_dim;
  const uint32_t kstep = uint32_t(layout::kstep(fp8));
  for (FlashMaps* mp : {&maps, &maps_wide}) {
    const uint64_t width = uint64_t(mp == &maps ? hd_pad : hd_pad_wide);
    mp->q = tensor_map(q(), fp8, width, uint64_t(n_pad), uint64_t(H), kstep, uint32_t(64 * consumers),
                       CU_TENSOR_MAP_SWIZZLE_32B);
    mp->k =
        tensor_map(k(), fp8, width, uint64_t(n_pad), uint64_t(H), kstep, layout::kBlockN, CU_TENSOR_MAP_SWIZZLE_32B);
    mp->v = tensor_map(vt(), fp8, uint64_t(n_pad), uint64_t(hd), uint64_t(H), fp8 ? 128u : 64u, uint32_t(hd),
                       CU_TENSOR_MAP_SWIZZLE_128B);
  }
  planned = true;
}

void FlashAttention::plan(const std::vector<int32_t>& cu_seqlens, cudaStream_t stream) {
  Impl& m = *impl_;
  m.planned = m.scheduled = m.prepared = false;
  VarlenShape sh = m.shape;
  sh.cu_seqlens = cu_seqlens;
  sh.validate();
  const int segs = sh.num_segments();
  std::vector<int> lens(static_cast<size_t>(segs));
  for (int s = 0; s < segs; ++s) lens[size_t(s)] = cu_seqlens[size_t(s) + 1] - cu_seqlens[size_t(s)];
  const int consumers =
      choose_consumer_warpgroups(lens, sh.heads, layout::max_consumer_warpgroups(m.fp8, sh.head_dim), m.sms);
  int64_t rows = 0, tiles = 0;  // exactly this layout's: the grids are the host plan's of before
  for (int len : lens) rows += layout::round_up_tile(len), tiles += (len + 64 * consumers - 1) / (64 * consumers);
  m.shape = sh;
  m.reserve(sh.total_tokens(), segs, rows, tiles, consumers);
  StagingSlot& st = m.staging[m.next_staging];
  m.next_staging ^= 1;
  uint8_t* h = st.take(cu_seqlens.size() * 4 + 16);
  upload(m.d_cu_in, cu_seqlens, h, stream);
  st.release(stream);
  schedule(m.d_cu_in.data(), segs, stream);
}

void FlashAttention::plan_capacity(int64_t max_tokens, int max_segments, int max_seqlen) {
  Impl& m = *impl_;
  m.planned = m.scheduled = m.prepared = false;
  if (max_tokens < 1 || max_tokens > INT32_MAX)
    fail_cat("FOVEA attention: a capacity of ", max_tokens, " tokens (1 to 2^31 - 1)");
  if (max_segments < 1) fail_cat("FOVEA attention: a capacity of ", max_segments, " segments (at least 1)");
  if (max_seqlen < 0 || max_seqlen > max_tokens)
    fail_cat("FOVEA attention: max_seqlen ", max_seqlen, " for a capacity of ", max_tokens, " tokens");
  // The tile size for the layout the capacity suggests: max_tokens in segments of max_seqlen.
  const int longest = max_seqlen > 0 ? max_seqlen : int(max_tokens);
  std::vector<int> lens(size_t(max_tokens / longest), longest);
  if (max_tokens % longest) lens.push_back(int(max_tokens % longest));
  const int consumers =
      choose_consumer_warpgroups(lens, m.shape.heads, layout::max_consumer_warpgroups(m.fp8, m.shape.head_dim), m.sms);
  const int block_m = 64 * consumers;
  m.shape.cu_seqlens.clear();
  m.reserve(max_tokens, max_segments, layout::round_up_tile(int(max_tokens)) + int64_t(layout::kTilePad) * max_segments,
            (max_tokens + block_m - 1) / block_m + max_segments, consumers);
}

void FlashAttention::schedule(const int32_t* cu_seqlens, int segments, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.planned) fail_cat("FOVEA attention: schedule() before a plan");
  if (!cu_seqlens) fail_cat("FOVEA attention: cu_seqlens is null");
  if (segments < 1 || segments > m.max_segments)
    fail_cat("FOVEA attention: ", segments, " segments for a plan of 1 to ", m.max_segments);
  ScheduleArgs a;
  a.cu_in = cu_seqlens;
  a.segments = segments;
  a.max_tokens = m.max_tokens;
  a.block_m = 64 * m.consumers;
  a.cu = m.d_cu.data();
  a.cu_padded = m.d_cu_pad.data();
  a.tiles = m.d_tiles.data();
  a.num_tiles = m.d_sched.data();
  a.status = m.d_sched.data() + 1;
  launch_schedule(a, stream);
  m.segments = segments;
  m.scheduled = true;
  m.prepared = false;
}

int FlashAttention::layout_error(cudaStream_t stream) const {
  const Impl& m = *impl_;
  if (!m.scheduled) fail_cat("FOVEA attention: layout_error() before schedule()");
  int32_t status = 0;
  FOVEA_CUDA_CHECK(cudaMemcpyAsync(&status, m.d_sched.data() + 1, 4, cudaMemcpyDeviceToHost, stream));
  FOVEA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return status;
}

namespace {

// The pointers `scales`' scheme needs, all there (BF16 attention reads none).
void check_scales(const DeviceScales& scales, bool fp8, int head_dim) {
  const FineArrays& f = scales.fine;
  const FineRing& r = scales.ring;
  if (!fp8) {
    if (is_robust(scales.scheme) && f.q_head) fail_cat("FOVEA attention: fine FP8 scales given to a bf16 attention");
    return;
  }
  if (scales.guard && (scales.scheme == LayerScheme::TENSOR_DYNAMIC || scales.scheme == LayerScheme::ROBUST_DYNAMIC))
    fail_cat("FOVEA attention: the static guard's counters given with dynamic scales");
  switch (scales.scheme) {
    case LayerScheme::TENSOR_STATIC:
      if (!scales.fixed) fail_cat("FOVEA attention: FP8 with static scales needs the q, k, v scales (fixed)");
      return;
    case LayerScheme::TENSOR_DYNAMIC:
      if (!scales.dynamic) fail_cat("FOVEA attention: FP8 with dynamic scales needs the layer's amax state");
      return;
    case LayerScheme::ROBUST_STATIC:
    case LayerScheme::ROBUST_DYNAMIC: break;
  }
  if (!(f.q_head && f.k_head && f.k_mean && f.v_channel))
    fail_cat("FOVEA attention: the robust FP8 scheme needs all four arrays (k_mean, q_head, k_head, v_channel)");
  if (fp8_split_pairs(head_dim) > 0 && !f.qk_split && scales.scheme == LayerScheme::ROBUST_DYNAMIC)
    fail_cat("FOVEA attention: robust dynamic scaling at head_dim ", head_dim, " needs its qk_split array to write");
  const bool ring = r.q || r.k || r.v || r.k_sum || r.k_hi || r.k_lo || r.q_hi || r.counts;
  if (ring && !(r.q && r.k && r.v && r.k_sum && r.k_hi && r.k_lo && r.q_hi && r.counts))
    fail_cat("FOVEA attention: the robust scheme's history needs all its arrays");
  if (ring && scales.scheme == LayerScheme::ROBUST_STATIC)
    fail_cat("FOVEA attention: a fine history given with static robust arrays");
}

}  // namespace

void FlashAttention::prepare(const void* qkv, int64_t qkv_token_stride, const float* rope_cos, const float* rope_sin,
                             const DeviceScales& scales, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.scheduled) fail_cat("FOVEA attention: prepare() before plan() or schedule()");
  if (!qkv) fail_cat("FOVEA attention: qkv is null");
  if (qkv_token_stride < 3 * int64_t(m.shape.heads) * m.shape.head_dim || qkv_token_stride % 8 != 0)
    fail_cat("FOVEA attention: qkv token stride ", qkv_token_stride,
             " must be >= 3*H*hd = ", 3 * m.shape.heads * m.shape.head_dim, " and a multiple of 8 (16-byte rows)");
  if (reinterpret_cast<uintptr_t>(qkv) % 16 != 0) fail_cat("FOVEA attention: qkv must be 16-byte aligned");
  if (bool(rope_cos) != bool(rope_sin)) fail_cat("FOVEA attention: give both RoPE tables or neither");
  check_scales(scales, m.fp8, m.shape.head_dim);
  FineArrays fine = scales.fine;
  if (!fine.qk_split) fine.qk_split = m.d_no_split.data();  // static: no pair split (check_scales)
  const bool robust = m.fp8 && is_robust(scales.scheme);
  GuardLaunch guard;  // static scales with the layer's counters (check_scales: static only): guarded, into d_guarded
  const bool guarded = m.fp8 && scales.guard;
  PrepareArgs a;
  a.qkv = static_cast<const __nv_bfloat16*>(qkv);
  a.qkv_token_stride = qkv_token_stride;
  a.rope_cos = rope_cos;
  a.rope_sin = rope_sin;
  a.cu_seqlens = m.d_cu.data();
  a.cu_padded = m.d_cu_pad.data();
  a.num_segments = m.segments;
  a.heads = m.shape.heads;
  a.total_tokens = m.max_tokens;
  a.n_pad = m.n_pad;
  a.q = m.q();
  a.k = m.k();
  a.vt = m.vt();
  a.fixed = scales.scheme == LayerScheme::TENSOR_STATIC ? scales.fixed : nullptr;
  a.dynamic = scales.scheme == LayerScheme::TENSOR_DYNAMIC ? scales.dynamic : nullptr;
  a.amax_scratch = m.d_scratch.data();
  a.amax_done = m.d_scratch.data() + 3;
  FineLaunch fl;
  if (robust) {
    fl.arrays = fine;
    fl.current = scales.scheme == LayerScheme::ROBUST_DYNAMIC;
    fl.scratch = m.fine_scratch;
    fl.ring = scales.ring;
  }
  if (guarded) {
    float* g = m.d_guarded.data();
    const int H = m.shape.heads;
    guard.counts = scales.guard;
    if (robust) {  // the file's K mean and split pairs, the guarded scales
      guard.file = fine;
      fl.arrays.q_head = g + 3, fl.arrays.k_head = g + 3 + H, fl.arrays.v_channel = g + 3 + 2 * H;
    } else {
      guard.fixed = scales.fixed, guard.scales = g;
      a.fixed = g;
    }
  }
  launch_prepare(a, m.fp8, m.shape.head_dim, stream, robust ? &fl : nullptr, guarded ? &guard : nullptr);
  m.fine = robust;
  if (robust) {
    m.scale_ptr[0] = fl.arrays.q_head, m.scale_ptr[1] = fl.arrays.k_head, m.scale_ptr[2] = fl.arrays.v_channel;
  } else if (m.fp8) {
    for (int i = 0; i < 3; ++i) m.scale_ptr[i] = a.dynamic ? &a.dynamic->t[i].scale : a.fixed + i;
  }
  m.prepared = true;
}

// ---- DeviceFineHistory: the robust state's block (fovea/scales.h: FineStateLayout) in device memory ----

FineRing fine_ring_at(void* block, int heads, int head_dim) {
  const FineStateLayout l(heads, head_dim);
  auto* b = static_cast<uint8_t*>(block);
  FineRing r;
  r.k_sum = reinterpret_cast<double*>(b + l.k_sum);
  r.counts = reinterpret_cast<FineCounts*>(b + l.counts);
  r.k_hi = reinterpret_cast<float*>(b + l.k_hi);
  r.k_lo = reinterpret_cast<float*>(b + l.k_lo);
  r.q_hi = reinterpret_cast<float*>(b + l.q_hi);
  r.q = reinterpret_cast<float*>(b + l.q);
  r.k = reinterpret_cast<float*>(b + l.k);
  r.v = reinterpret_cast<float*>(b + l.v);
  return r;
}

void DeviceFineHistory::Free::operator()(void* p) const { cudaFree(p); }

DeviceFineHistory::DeviceFineHistory(const FineHistory& h) : heads_(h.heads), head_dim_(h.head_dim) {
  void* p = nullptr;
  FOVEA_CUDA_CHECK(cudaMalloc(&p, bytes()));
  mem_.reset(static_cast<uint8_t*>(p));
  ring_ = fine_ring_at(mem_.get(), heads_, head_dim_);
  upload(h);
}

DeviceFineHistory::~DeviceFineHistory() = default;

DeviceFineHistory::DeviceFineHistory(DeviceFineHistory&& o) noexcept
    : heads_(o.heads_), head_dim_(o.head_dim_), mem_(std::move(o.mem_)), ring_(std::exchange(o.ring_, {})) {}

void DeviceFineHistory::upload(const FineHistory& h) {
  if (h.heads != heads_ || h.head_dim != head_dim_)
    fail_cat("FOVEA attention: a fine history of ", h.heads, " x ", h.head_dim, " for a device one of ", heads_, " x ",
             head_dim_);
  std::vector<uint8_t> host(bytes());
  pack_fine_state(h, host.data());
  FOVEA_CUDA_CHECK(cudaMemcpy(mem_.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
}

size_t DeviceFineHistory::bytes() const { return FineStateLayout(heads_, head_dim_).bytes; }

void DeviceFineHistory::unpack(const void* host, FineHistory& h) const {
  h = unpack_fine_state(host, heads_, head_dim_, "FOVEA attention: the device's robust state");
}

void DeviceFineHistory::download(FineHistory& h) const {
  std::vector<uint8_t> host(bytes());
  FOVEA_CUDA_CHECK(cudaMemcpy(host.data(), mem_.get(), host.size(), cudaMemcpyDeviceToHost));
  unpack(host.data(), h);
}

std::array<const float*, 3> FlashAttention::scales_in_use() const {
  const Impl& m = *impl_;
  if (!m.prepared || !m.fp8) fail_cat("FOVEA attention: scales_in_use() before an FP8 prepare()");
  return {m.scale_ptr[0], m.scale_ptr[1], m.scale_ptr[2]};
}

void FlashAttention::attend(void* out, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.prepared) fail_cat("FOVEA attention: attend() before prepare()");
  if (!out) fail_cat("FOVEA attention: out is null");
  FlashParams p;
  p.tiles = m.d_tiles.data();
  p.num_tiles = m.d_sched.data();
  p.cu_seqlens = m.d_cu.data();
  p.cu_padded = m.d_cu_pad.data();
  p.out = static_cast<__nv_bfloat16*>(out);
  p.heads = m.shape.heads;
  p.q_scale = m.scale_ptr[0];
  p.k_scale = m.scale_ptr[1];
  p.v_scale = m.scale_ptr[2];
  p.fine = m.fine;
  p.softmax_scale_log2 = float(M_LOG2E / std::sqrt(double(m.shape.head_dim)));
  const bool wide = m.fine && m.hd_pad_wide != m.hd_pad;
  launch_flash(p, wide ? m.maps_wide : m.maps, m.max_tiles, m.fp8, m.shape.head_dim, m.consumers, wide, stream);
}

}  // namespace fovea::cuda
