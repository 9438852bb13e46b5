// fovea/attention-gpu.h: the GPU attention backends behind one interface (Attention: FOVEA's
// Hopper kernels, cuDNN's), and the FP8 scale state they read in device memory: a layer's per-tensor
// scales or amax ring, or the robust scheme's arrays and history (DeviceScales). Implementations:
// src/attention/cuda/ and src/attention/cudnn/.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "fovea/attention.h"
#include "fovea/fp8-plan.h"
#include "fovea/scales.h"

namespace fovea {

// ---- GPU: the FOVEA backend (Hopper, sm_90a) ---------------------------------------------------------
// Built where nvcc exists; runs on compute capability 9.0. Implementation: src/attention/cuda/.

namespace cuda {

// The robust FP8 scheme's arrays of one layer in device memory (docs/fp8.md §Outlier channels; the
// kernels' view of cpu::Fp8Fine without the rotation): K's mean and V's dequantization scales per
// (head, channel) [H * hd], Q's and (smoothed) K's per head [H], and the split pairs
// [H * fp8_split_pairs(hd)] (-1 for an unused slot; static arrays may leave it null: no pair split;
// dynamic scaling writes it).
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
// Static scales with `guard` (the layer's counters) are guarded (docs/fp8.md §Static guard): one
// extra launch takes this batch's statistics, and where the batch passes a scale's range the
// attention quantizes with the batch's own scale instead (ScaleBook::record's and guard_fine's
// arithmetic), in a copy of the attention's own: the given scales are never written. Without
// `guard` static scales are used as given (the C ABI's static scales). BF16 attention reads none of
// it. Make one with the functions below; prepare() checks that the scheme's pointers are all there.
struct DeviceScales {
  LayerScheme scheme = LayerScheme::TENSOR_STATIC;
  const float* fixed = nullptr;  // TENSOR_STATIC: device float[3]
  LayerAmax* dynamic = nullptr;  // TENSOR_DYNAMIC: device LayerAmax
  FineArrays fine;               // ROBUST_*
  FineRing ring;                 // ROBUST_DYNAMIC: the layer's history, or all null
  GuardCounts* guard = nullptr;  // *_STATIC: device; each forward adds the tensors it switched
};
inline DeviceScales tensor_static_scales(const float* qkv, GuardCounts* guard = nullptr) {
  return {LayerScheme::TENSOR_STATIC, qkv, nullptr, {}, {}, guard};
}
inline DeviceScales tensor_dynamic_scales(LayerAmax* state) {
  return {LayerScheme::TENSOR_DYNAMIC, nullptr, state, {}, {}, nullptr};
}
inline DeviceScales robust_static_scales(const FineArrays& arrays, GuardCounts* guard = nullptr) {
  return {LayerScheme::ROBUST_STATIC, nullptr, nullptr, arrays, {}, guard};
}
inline DeviceScales robust_dynamic_scales(const FineArrays& filled, const FineRing& history = {}) {
  return {LayerScheme::ROBUST_DYNAMIC, nullptr, nullptr, filled, history, nullptr};
}

// Fused RoPE + quantize + layout step and the Hopper flash-attention kernel for one attention shape.
//   plan()    once per batch shape (not capturable: may allocate, encodes TMA maps); its uploads of
//             cu_seqlens and the tile list are enqueued on `stream` from pinned memory, without
//             waiting, so the host plans the next batch while the GPU runs the last one;
//   prepare() reads the fused qkv [N, 3, H, hd] bf16 output, applies 2D RoPE to q and k and writes
//             Q, K and V^T in the kernel's layouts (bf16, or E4M3 with the layer's scales; with dynamic
//             scaling or the static guard one extra launch first reduces amax and updates the ring or
//             the guarded scales, all on the device);
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
  // FP8: where attend() reads the dequantization scales of the last prepare() (device; q, k, v: one
  // each per tensor, the robust scheme's [H], [H], [H * hd]): the caller's, or the static guard's.
  std::array<const float*, 3> scales_in_use() const;

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

}  // namespace cuda

}  // namespace fovea
