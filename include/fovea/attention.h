// fovea/attention.h: packed varlen ("THD") attention for vision encoders: the backend enum, the batch
// description, and the CPU reference that is the oracle for every other backend (docs/architecture.md §Engine
// configuration; docs/fp8.md §Correctness).
//
// Layout: q, k, v are [total_tokens, heads, head_dim] views (token and head strides in elements, the
// last dimension contiguous), so they can be read straight out of a fused qkv [N, 3, H, hd] tensor.
// cu_seqlens is int32 [num_segments + 1], 0 = cu[0] < cu[1] < ... = total_tokens. Attention is
// non-causal within each segment and never crosses segments.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fovea/fp8-plan.h"
#include "fovea/scales.h"

typedef struct CUstream_st* cudaStream_t;  // as cuda_runtime_api.h declares it

namespace fovea {

enum class AttnBackend { AUTO, FOVEA, CUDNN, CPU };
enum class AttnDtype { AUTO, BF16, FP8 };

const char* backend_name(AttnBackend b);
const char* dtype_name(AttnDtype d);
// Case-insensitive; FLASHINFER is an alias of CUDNN (vLLM's FLASHINFER encoder backend is cuDNN).
std::optional<AttnBackend> parse_backend(const std::string& s);
std::optional<AttnDtype> parse_dtype(const std::string& s);

// A [tokens, heads, head_dim] view with the last dimension contiguous.
template <class T>
struct ThdView {
  T* data = nullptr;
  int64_t stride_token = 0;  // elements between consecutive tokens
  int64_t stride_head = 0;   // elements between consecutive heads
  T* row(int64_t token, int64_t head) const { return data + token * stride_token + head * stride_head; }
};

struct VarlenShape {
  std::vector<int32_t> cu_seqlens;
  int heads = 0;
  int head_dim = 0;
  int64_t total_tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
  int num_segments() const { return int(cu_seqlens.size()) - 1; }
  int max_seqlen() const;
  double flops() const;  // 4 * sum(S_i^2) * head_dim * heads: QK^T and PV, non-causal
  // Throws fovea::Error naming the offending value: cu_seqlens must start at 0 and strictly
  // increase (every segment has >= 1 token); heads and head_dim must be > 0.
  void validate() const;
};

VarlenShape varlen_from_seqlens(const std::vector<int>& seqlens, int heads, int head_dim);

namespace cpu {

// How the reference computes:
//   EXACT - fp64 throughout, two-pass softmax (the oracle).
//   BF16  - what a BF16 flash-attention kernel computes: Q, K, V rounded to bf16; S = QK^T in fp32;
//           online softmax over KV blocks in fp32; P rounded to bf16 for PV; fp32 accumulation;
//           output rounded to bf16.
//   FP8   - what fovea's FP8 kernel computes: Q, K, V quantized per tensor to E4M3 with the given
//           dequantization scales; S in fp32 times the descales; online softmax over KV blocks;
//           P quantized to E4M3 with the P scheme below; fp32 accumulation; bf16 output.
enum class RefMode { EXACT, BF16, FP8 };
const char* ref_mode_name(RefMode m);

// The P (softmax probabilities) quantization scheme of the FP8 kernel, emulated here.
// Choice (from FlashAttention-3's FP8 path; docs/fp8.md §P scheme):
//   - P is computed per KV block relative to the running row max, so p = exp(s - m) is in (0, 1];
//     it is multiplied by p_scale = 256 before the E4M3 cast (E4M3's top binade is [256, 448), so
//     p = 1 lands exactly on 256 and small p keep 3 mantissa bits down to 2^-6/256 = 2^-14 before
//     going subnormal). The 256 is divided out of the output once, at the end.
//   - The exponent argument is one FMA, s * scale - (m - log2 p_scale), s the raw score and m the
//     row max of the scaled scores; exp2 is the hardware's (the emulation's std::exp2 stands for it)
//     or, for the keys fovea/flash-p.h names, a degree-3 polynomial the emulation runs bit for bit.
//   - The row sum l is the sum of the E4M3 P the PV product multiplies by (fovea/flash-p.h: made by
//     the tensor cores), the normalizer consistent with the quantized P; at head_dim 80 it is the sum
//     of the fp32 p before the cast.
//   - KV blocks of block_n keys, aligned to the segment start, are visited last to first, so a large
//     early key (an attention sink, usually the first patch) sets the row max last and does not
//     flush the other blocks' P to zero in E4M3 before they are rescaled in fp32.
// The BF16 mode uses the same block walk with P rounded to bf16 and p_scale 1.
struct PScheme {
  float p_scale = 256.0f;
  int block_n = 128;
  bool reverse_kv = true;
};

// FP8 scales finer than one per tensor, and K smoothing (docs/fp8.md §Outlier channels). Each part
// is optional; an empty vector leaves RefOptions::fp8_scales' per-tensor value in force.
//   k_mean     [H * hd]: K is quantized as K - k_mean, per head and channel. Any vector shared by all
//              the keys a query sees moves that query's scores by one constant (q . k_mean), so the
//              softmax and the output are unchanged: exact, not an approximation.
//   q_head, k_head [H]: per-head dequantization scales of Q and of (smoothed) K; their product
//              multiplies the head's scores, so they commute with the kernel.
//   v_channel  [H * hd]: per-channel dequantization scales of V; scale c multiplies output column c.
//   rotate_qk  Q and K are multiplied by one orthonormal hd x hd matrix (the DCT-II) before
//              quantization: q.k is unchanged, and a channel that dominates a head is spread over
//              all of them (the FlashAttention-3 paper's "incoherent processing").
//   qk_pair    [H * hd/2]: per rotary pair p (channels p and p + hd/2, the two RoPE rotates
//              together), Q's pair is multiplied by qk_pair[p] and K's (after k_mean) by its
//              reciprocal before quantization. A rotation commutes with a scalar on its pair, so
//              every score is unchanged whatever the positions; powers of two keep it exact in fp32
//              too. Not with rotate_qk. (CPU emulation only: docs/fp8.md §Outlier channels measures
//              that it moves no error, E4M3 being floating point.)
//   qk_split   [H * fp8_split_pairs(hd)]: per head, the rotary pairs whose Q and K are split into two
//              E4M3 terms in the zero padding of the FP8 rows (fovea/scales.h §split pairs), -1 for
//              an unused slot; the kernels run it as it is (the padding is already in their QK^T).
//              Not with rotate_qk or qk_pair.
struct Fp8Fine {
  std::vector<float> k_mean, q_head, k_head, v_channel, qk_pair;
  std::vector<int32_t> qk_split;
  bool rotate_qk = false;
  bool empty() const {
    return k_mean.empty() && q_head.empty() && k_head.empty() && v_channel.empty() && qk_pair.empty() &&
           qk_split.empty() && !rotate_qk;
  }
};

// The robust scheme's arrays (a scale file's, or record_fine's for one batch) as the reference takes them.
inline Fp8Fine robust_fine(const FineScales& f) {
  Fp8Fine o;
  o.k_mean = f.k_mean, o.q_head = f.q_head, o.k_head = f.k_head, o.v_channel = f.v_channel, o.qk_split = f.qk_split;
  return o;
}

// FP8 mode, for measurement only (`fovea bench attention --fp8-exact`): operands kept unquantized
// (x / scale in fp32, under the same scales and K smoothing; Q and K without their split pairs), to
// see what E4M3 costs in each of Q.K^T, V and P (docs/fp8.md §Outlier channels).
struct Fp8Exact {
  bool qk = false, v = false, p = false;
};

struct RefOptions {
  RefMode mode = RefMode::EXACT;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  QkvScales fp8_scales;        // FP8 mode: dequantization scales of Q, K, V
  Fp8Fine fp8_fine;            // FP8 mode: finer scales and K smoothing, where given
  Fp8Exact fp8_exact;          // FP8 mode: nothing by default
  PScheme p;
  int threads = 0;  // 0: all hardware threads
};

// Which parts of Fp8Fine a scheme uses.
struct Fp8FineParts {
  bool smooth_k = false, per_head_qk = false, per_channel_v = false, rotate_qk = false, smooth_qk_pairs = false;
  bool split_pairs = false;  // qk_split: pick_split_pairs from the batch's Q and K - k_mean
};
// The robust scheme as the kernels run it: K smoothing, per-head Q / K, per-channel V, split pairs.
constexpr Fp8FineParts kRobustParts = {true, true, true, false, false, true};
// One rotary pair's smoothing factor from the pair's amax in Q and in K: the power of two nearest
// sqrt(k_amax / q_amax) (SmoothQuant's migration strength 1/2: both sides end at sqrt(q_amax k_amax)),
// within [2^-kQkPairMaxLog2, 2^kQkPairMaxLog2]; 1 where either amax is 0.
constexpr int kQkPairMaxLog2 = 6;
float qk_pair_factor(float q_amax, float k_amax);
// The orthonormal DCT-II matrix of order n, row-major: row i is basis vector i.
std::vector<float> dct_matrix(int n);
// The fine scales dynamic scaling would use for this batch ("current scaling", like the per-tensor
// s = amax / 448 of a first forward): k_mean = K's mean over every token of the batch (one vector for
// all segments: exact, see Fp8Fine), then amax / 448 per head of Q and of K - k_mean, and per channel
// of V, each floored at kMinScale. With smooth_qk_pairs, qk_pair[p] = qk_pair_factor(amax of Q's
// pair p, amax of K's pair p after k_mean), and the per-head amaxes are those of the smoothed Q and
// K. With split_pairs (at head_dim 72 and 80; none elsewhere), qk_split = pick_split_pairs of Q's amax
// and K - k_mean's per channel. Non-finite inputs throw, naming the tensor.
Fp8Fine current_fine_scales(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k,
                            ThdView<const float> v, Fp8FineParts parts);

// One forward's statistics for the robust scheme's history (ScaleBook::record_fine), as
// fine_stats_kernel computes them: K's sum (double), extremes and V's amax per (head, channel), Q's
// amax per channel. A non-finite value clears `finite` (its statistics are then not recorded).
FineBatch fine_batch(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v);

// out: contiguous [total_tokens, heads, head_dim]. In BF16/FP8 modes every value is a bf16 value.
void attention(const VarlenShape& shape, ThdView<const float> q, ThdView<const float> k, ThdView<const float> v,
               const RefOptions& opt, double* out);

}  // namespace cpu

// max |x| over a view (the per-tensor amax of dynamic scaling); non-finite values propagate (inf/NaN
// in -> non-finite out), so the scale book can ignore and count them.
float amax(const VarlenShape& shape, ThdView<const float> x);

// ---- GPU: the FOVEA backend (Hopper, sm_90a) ---------------------------------------------------------
// Built where nvcc exists; runs on compute capability 9.0. Implementation: src/attention/cuda/.

namespace cuda {

// The robust FP8 scheme's arrays of one layer in device memory (docs/fp8.md §Outlier channels; the
// kernels' view of cpu::Fp8Fine without the rotation): K's mean and V's dequantization scales per
// (head, channel) [H * hd], Q's and (smoothed) K's per head [H], and the split pairs
// [H * fp8_split_pairs(hd)] (null where hd has none; -1 for an unused slot).
struct FineArrays {
  float* k_mean = nullptr;
  float* q_head = nullptr;
  float* k_head = nullptr;
  float* v_channel = nullptr;
  int32_t* qk_split = nullptr;
};

// One layer's FineHistory in device memory (its arrays and counters), which prepare() updates in
// place as ScaleBook::record_fine does on the host.
struct FineRing {
  float* q = nullptr;  // [16][H]
  float* k = nullptr;  // [16][H]
  float* v = nullptr;  // [16][H * hd]
  double* k_sum = nullptr;
  float* k_hi = nullptr;
  float* k_lo = nullptr;
  float* q_hi = nullptr;
  FineCounts* counts = nullptr;
};

// The FineRing of a robust state's block (fovea/scales.h: FineStateLayout) at `block`.
FineRing fine_ring_at(void* block, int heads, int head_dim);

// Owns one robust state's block: allocated and uploaded from a host FineHistory, downloaded back into one.
class DeviceFineHistory {
 public:
  explicit DeviceFineHistory(const FineHistory& h);
  ~DeviceFineHistory();
  DeviceFineHistory(const DeviceFineHistory&) = delete;
  DeviceFineHistory& operator=(const DeviceFineHistory&) = delete;
  DeviceFineHistory(DeviceFineHistory&& o) noexcept;
  void upload(const FineHistory& h);
  void download(FineHistory& h) const;  // synchronous
  const FineRing& ring() const { return ring_; }
  // The whole history as one block of device memory, and that block's bytes (copied to the host
  // by the caller, in its stream) back into a FineHistory of the same shape.
  const void* data() const { return mem_.get(); }
  size_t bytes() const;
  void unpack(const void* host, FineHistory& h) const;

 private:
  struct Free {  // cudaFree (flash-attention.cu)
    void operator()(void* p) const;
  };
  int heads_ = 0, head_dim_ = 0;
  std::unique_ptr<uint8_t, Free> mem_;  // owned from the allocation on, so a failed upload frees it
  FineRing ring_;
};

// Where prepare() finds one layer's FP8 scales in device memory, by the layer's scheme
// (fovea/fp8-plan.h): per tensor fixed (q, k, v) or dynamic (the layer's amax ring, updated in
// place), or the robust scheme's arrays, which prepare() reads as they are (ROBUST_STATIC) or first
// fills from this batch (ROBUST_DYNAMIC: one extra launch, all on the device, so it replays in a
// graph), with `ring` from the batch and the layer's history as ScaleBook::record_fine does (updating
// the history), or, with `ring` all null, as cpu::current_fine_scales does (this batch alone).
// BF16 attention reads none of it. Make one with the functions below; prepare() checks that the
// scheme's pointers are all there.
struct DeviceScales {
  LayerScheme scheme = LayerScheme::TENSOR_STATIC;
  const float* fixed = nullptr;  // TENSOR_STATIC: device float[3]
  LayerAmax* dynamic = nullptr;  // TENSOR_DYNAMIC: device LayerAmax
  FineArrays fine;               // ROBUST_*
  FineRing ring;                 // ROBUST_DYNAMIC: the layer's history, or all null
};
inline DeviceScales tensor_static_scales(const float* qkv) {
  return {LayerScheme::TENSOR_STATIC, qkv, nullptr, {}, {}};
}
inline DeviceScales tensor_dynamic_scales(LayerAmax* state) {
  return {LayerScheme::TENSOR_DYNAMIC, nullptr, state, {}, {}};
}
inline DeviceScales robust_static_scales(const FineArrays& arrays) {
  return {LayerScheme::ROBUST_STATIC, nullptr, nullptr, arrays, {}};
}
inline DeviceScales robust_dynamic_scales(const FineArrays& filled, const FineRing& history = {}) {
  return {LayerScheme::ROBUST_DYNAMIC, nullptr, nullptr, filled, history};
}

// Fused RoPE + quantize + layout step and the Hopper flash-attention kernel for one attention shape.
//   plan()    once per batch shape (not capturable: may allocate, encodes TMA maps); its uploads of
//             cu_seqlens and the tile list are enqueued on `stream` from pinned memory, without
//             waiting, so the host plans the next batch while the GPU runs the last one;
//   prepare() reads the fused qkv [N, 3, H, hd] bf16 output, applies 2D RoPE to q and k and writes
//             Q, K and V^T in the kernel's layouts (bf16, or E4M3 with the layer's scales; with dynamic
//             scaling one extra launch first reduces amax and updates the ring, all on the device);
//   attend()  writes bf16 out [N, H, hd] (contiguous), ready for the proj GEMM.
// prepare() and attend() make no host synchronization and can be captured in a CUDA graph.
// Every GPU attention backend (FOVEA, CUDNN) has this interface: the encoder holds an Attention.
class Attention {
 public:
  virtual ~Attention() = default;
  virtual void plan(const std::vector<int32_t>& cu_seqlens, cudaStream_t stream = nullptr) = 0;
  // qkv: device bf16, token stride qkv_token_stride elements (3*H*hd when packed); rope_cos/sin:
  // device fp32 [N, hd/2] (angle of dims d and d + hd/2), or both null for no RoPE.
  virtual void prepare(const void* qkv, int64_t qkv_token_stride, const float* rope_cos, const float* rope_sin,
                       const DeviceScales& scales, cudaStream_t stream) = 0;
  virtual void attend(void* out, cudaStream_t stream) = 0;
  virtual const VarlenShape& shape() const = 0;
  virtual AttnDtype dtype() const = 0;
};

class FlashAttention final : public Attention {
 public:
  FlashAttention(AttnDtype dtype, int heads, int head_dim);
  ~FlashAttention() override;
  FlashAttention(const FlashAttention&) = delete;
  FlashAttention& operator=(const FlashAttention&) = delete;

  // A layout the host holds: sized exactly for it, then schedule() on its upload.
  void plan(const std::vector<int32_t>& cu_seqlens, cudaStream_t stream = nullptr) override;
  // A capacity instead: buffers, descriptors and grids for any layout of at most max_tokens tokens
  // in at most max_segments segments (max_seqlen, the longest segment expected, only picks the
  // tile size; 0: max_tokens). Allocates: never under a graph capture. shape().cu_seqlens is empty.
  void plan_capacity(int64_t max_tokens, int max_segments, int max_seqlen = 0);
  // Enqueues the schedule step, which reads the layout from device memory when it runs:
  // cu_seqlens [segments + 1] int32 (segments <= the plan's): 0, then non-decreasing offsets up to
  // the capacity, then only zeros after a drop (a buffer zeroed, then the real offsets copied to
  // its front: the rest are empty segments). Any other layout attends nothing (layout_error() says
  // where). schedule, prepare and attend captured once in a graph replay every layout within the plan.
  void schedule(const int32_t* cu_seqlens, int segments, cudaStream_t stream);
  // 0 if the last scheduled layout was valid, else 1 + the index of its first bad entry; waits for
  // the stream.
  int layout_error(cudaStream_t stream) const;
  void prepare(const void* qkv, int64_t qkv_token_stride, const float* rope_cos, const float* rope_sin,
               const DeviceScales& scales, cudaStream_t stream) override;
  void attend(void* out, cudaStream_t stream) override;

  const VarlenShape& shape() const override;
  AttnDtype dtype() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The CUDNN backend (src/attention/cudnn/; built where cudnn.h is found): cuDNN's fused flash attention
// in BF16 over the packed segments, any GPU from sm_80 with cuDNN 9.15 or newer at run time. prepare()
// rotates q and k into a buffer of its own; plans are cached per shape bucket. Throws for FP8 (see
// docs/backends.md) and where cuDNN is too old.
std::unique_ptr<Attention> make_cudnn_attention(AttnDtype dtype, int heads, int head_dim);

// Head dims the FOVEA kernels are built for: the one list the kernel dispatch
// (src/attention/cuda/head-dims.cuh), the tests and the benches iterate.
inline constexpr int kFlashHeadDims[] = {64, 72, 80, 128};

constexpr bool flash_supports_head_dim(int head_dim) {
  for (int d : kFlashHeadDims)
    if (d == head_dim) return true;
  return false;
}

}  // namespace cuda

struct ErrorStats {
  double rel_l2 = 0;   // ||out - ref||_2 / ||ref||_2; NaN if out has a non-finite value
  double max_abs = 0;  // max |out - ref|; NaN likewise
  double mean_abs = 0;
  int64_t nonfinite = 0;  // non-finite values in out
};
ErrorStats compare(const double* out, const double* ref, int64_t n);

}  // namespace fovea
