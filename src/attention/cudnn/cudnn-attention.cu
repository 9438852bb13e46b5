// The CUDNN attention backend (docs/backends.md §CUDNN): cuDNN's fused flash attention, BF16, on packed
// variable-length segments, through the cuDNN graph API (the backend descriptors, no frontend library).
//
// One SDPA forward operation (CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR, cuDNN 9.15 or newer: it takes
// the sequence lengths) over Q, K, V and O described as [segments, H, S, hd] with the token stride of
// the packed layout and ragged offsets (the element offset of each segment's first token), so no
// segment is padded in memory: the engine masks past each segment's length. A plan is built once per
// shape bucket (segments rounded up to a power of two, S up to a multiple of 256; the unused segments
// get length 0) and cached; a new batch of the same bucket only uploads its offsets and lengths, which
// the plan reads from device memory, so attend() replays in a CUDA graph.
//
// prepare() writes q and k rotated (2D RoPE, rounded as the CPU reference rounds it) and v as it is
// into a [N, 3, H, hd] buffer of its own; cuDNN reads them from there.
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "attention/cuda/rope.cuh"
#include "fovea/attention.h"
#include "fovea/attention-gpu.h"
#include "fovea/cuda-support.h"
#include "fovea/error.h"

namespace fovea::cuda {
namespace {

constexpr size_t kMinCudnnVersion = 91500;  // the SDPA operation with sequence lengths

void check(cudnnStatus_t s, const char* what) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof detail);
  fail_cat("CUDNN attention: ", what, ": ", cudnnGetErrorString(s), detail[0] ? " (" : "", detail,
           detail[0] ? ")" : "");
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &d_), "creating a descriptor");
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* value) {
    check(cudnnBackendSetAttribute(d_, name, type, count, value), "setting an attribute");
    return *this;
  }
  Desc& set(cudnnBackendAttributeName_t name, const Desc& other) {
    const cudnnBackendDescriptor_t o = other.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &o);
  }
  Desc& finalize(const char* what) {
    check(cudnnBackendFinalize(d_), what);
    return *this;
  }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

enum Uid : int64_t { kQ = 1, kK, kV, kO, kScale, kSeqLen, kSeqLenKv, kRaggedQkv, kRaggedO };

Desc tensor(int64_t uid, cudnnDataType_t type, std::array<int64_t, 4> dims, std::array<int64_t, 4> strides,
            const Desc* ragged = nullptr, bool by_value = false) {
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t align = 16;
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)
      .set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
  if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
  if (ragged) t.set(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, *ragged);
  t.finalize("a tensor descriptor");
  return t;
}

// A finalized execution plan for one shape bucket, with every descriptor it was built from.
struct Plan {
  std::vector<Desc> keep;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace = 0;
};

Plan build_plan(cudnnHandle_t handle, int64_t b, int64_t S, int64_t H, int64_t hd) {
  Plan p;
  const int64_t ts = 3 * H * hd;  // token stride of the [N, 3, H, hd] buffer prepare() writes
  auto& k = p.keep;
  k.reserve(16);  // before any reference into it is taken
  k.push_back(tensor(kRaggedQkv, CUDNN_DATA_INT64, {b + 1, 1, 1, 1}, {1, 1, 1, 1}));
  k.push_back(tensor(kRaggedO, CUDNN_DATA_INT64, {b + 1, 1, 1, 1}, {1, 1, 1, 1}));
  const Desc& rag_qkv = k[0];
  const Desc& rag_o = k[1];
  const std::array<int64_t, 4> dims = {b, H, S, hd}, qkv_strides = {S * ts, hd, ts, 1},
                               o_strides = {S * H * hd, hd, H * hd, 1};
  for (int64_t uid : {int64_t(kQ), int64_t(kK), int64_t(kV)})
    k.push_back(tensor(uid, CUDNN_DATA_BFLOAT16, dims, qkv_strides, &rag_qkv));
  k.push_back(tensor(kO, CUDNN_DATA_BFLOAT16, dims, o_strides, &rag_o));
  k.push_back(tensor(kScale, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, nullptr, true));
  k.push_back(tensor(kSeqLen, CUDNN_DATA_INT32, {b, 1, 1, 1}, {1, 1, 1, 1}));
  k.push_back(
      tensor(kSeqLenKv, CUDNN_DATA_INT32, {b, 1, 1, 1}, {1, 1, 1, 1}));  // the same lengths, a tensor of its own
  Desc op(CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR);
  op.set(CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, k[2])
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, k[3])
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, k[4])
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, k[5])
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, k[6])
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_SEQ_LEN_QDESC, k[7])
      .set(CUDNN_ATTR_OPERATION_SDPA_FWD_SEQ_LEN_KVDESC, k[8])
      .finalize("the SDPA operation");
  Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  const cudnnBackendDescriptor_t ops = op.get();
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ops)
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
      .finalize("the operation graph");
  k.push_back(std::move(op));
  // Engine configurations from the heuristics (mode A, then the fallback list); the first that
  // finalizes into an execution plan is used.
  std::string why;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) continue;
    int64_t n = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n,
                                   nullptr),
          "counting engine configurations");
    std::vector<Desc> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < n; ++i)
      cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR), raw.push_back(cfgs.back().get());
    int64_t got = 0;
    if (n > 0)
      check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got,
                                     raw.data()),
            "reading engine configurations");
    for (int64_t i = 0; i < got; ++i) {
      Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[size_t(i)])
          .set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) {
        char detail[512] = {0};
        cudnnGetLastErrorString(detail, sizeof detail);
        why = detail;
        continue;
      }
      int64_t ws = 0, count = 0;
      check(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &count,
                                     &ws),
            "reading the workspace size");
      p.plan = plan.get();
      p.workspace = ws;
      k.push_back(std::move(plan));
      k.push_back(std::move(cfgs[size_t(i)]));
      k.push_back(std::move(graph));
      return p;
    }
  }
  fail_cat("CUDNN attention: cuDNN ", cudnnGetVersion(), " has no engine for BF16 attention over ", b,
           " segments of up to ", S, " tokens, ", H, " heads of ", hd, why.empty() ? "" : " (" + why + ")");
}

// q and k rotated, v copied, into [N, 3, H, hd]: a thread per column pair (d, d + hd/2) of one
// (token, head) row, the rotation unfused and rounded as the CPU reference's.
__global__ void rope_copy_kernel(const __nv_bfloat16* qkv, int64_t stride, const float* cos, const float* sin,
                                 __nv_bfloat16* out, int64_t rows, int heads, int half) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * half) return;
  const int64_t row = i / half;
  const int c = int(i % half), hd = 2 * half;
  const int64_t t = row / heads;
  const int h = int(row % heads);
  const __nv_bfloat16* src = qkv + t * stride + int64_t(h) * hd;
  __nv_bfloat16* dst = out + t * 3 * int64_t(heads) * hd + int64_t(h) * hd;
  const int64_t which = int64_t(heads) * hd;
  for (int w = 0; w < 3; ++w) {
    float x1 = __bfloat162float(src[w * which + c]), x2 = __bfloat162float(src[w * which + c + half]);
    if (w < 2 && cos) rope_pair(x1, x2, cos[t * half + c], sin[t * half + c]);
    dst[w * which + c] = __float2bfloat16_rn(x1);
    dst[w * which + c + half] = __float2bfloat16_rn(x2);
  }
}

class CudnnAttention final : public Attention {
 public:
  CudnnAttention(AttnDtype dtype, int heads, int head_dim) : dtype_(dtype) {
    if (dtype != AttnDtype::BF16)
      fail_cat(
          "CUDNN attention runs BF16: cuDNN's FP8 attention on Hopper writes FP8 output and takes no packed segments, "
          "and fovea's FP8 path through cuDNN on Blackwell is not written; use --mm-encoder-attn-backend FOVEA for "
          "FP8");
    if (heads <= 0 || head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256)
      fail_cat("CUDNN attention: head_dim must be a multiple of 8 up to 256 and heads > 0; got ", heads, " heads of ",
               head_dim);
    if (cudnnGetVersion() < kMinCudnnVersion)
      fail_cat(
          "CUDNN attention needs cuDNN 9.15 or newer at run time (its SDPA operation with sequence lengths); this "
          "process "
          "loaded cuDNN ",
          cudnnGetVersion());
    shape_.heads = heads;
    shape_.head_dim = head_dim;
    scale_ = float(1.0 / std::sqrt(double(head_dim)));
    cudnnHandle_t h = nullptr;
    check(cudnnCreate(&h), "creating the cuDNN handle");
    handle_ = Handle<cudnnHandle_t, cudnnDestroy>(h);
  }

  void plan(const std::vector<int32_t>& cu_seqlens, cudaStream_t stream) override {
    planned_ = prepared_ = false;
    VarlenShape sh = shape_;
    sh.cu_seqlens = cu_seqlens;
    sh.validate();
    const int64_t b = sh.num_segments(), H = sh.heads, hd = sh.head_dim;
    int64_t S = 0;
    for (int64_t i = 0; i < b; ++i) S = std::max<int64_t>(S, cu_seqlens[size_t(i) + 1] - cu_seqlens[size_t(i)]);
    int64_t bb = 1;
    while (bb < b) bb *= 2;
    const int64_t sb = std::max<int64_t>(256, (S + 255) / 256 * 256);
    auto it = plans_.find({bb, sb});
    if (it == plans_.end()) it = plans_.emplace(std::pair{bb, sb}, build_plan(handle_.get(), bb, sb, H, hd)).first;
    current_ = &it->second;
    if (size_t(current_->workspace) > workspace_.count()) workspace_.reset(size_t(current_->workspace));
    // Lengths (0 for the bucket's unused segments) and the element offsets of each segment's first
    // token in the qkv buffer and in out.
    StagingSlot& st = staging_[next_staging_];
    next_staging_ ^= 1;
    const size_t rag_at = (size_t(bb) * 4 + 7) / 8 * 8, bytes = rag_at + 2 * size_t(bb + 1) * 8;
    uint8_t* h = st.take(bytes);
    auto* len = reinterpret_cast<int32_t*>(h);
    auto* rag = reinterpret_cast<int64_t*>(h + rag_at);
    for (int64_t i = 0; i < bb; ++i) len[i] = i < b ? cu_seqlens[size_t(i) + 1] - cu_seqlens[size_t(i)] : 0;
    const int64_t N = sh.total_tokens();
    for (int64_t i = 0; i <= bb; ++i) {
      const int64_t tok = i <= b ? cu_seqlens[size_t(i)] : N;
      rag[i] = tok * 3 * H * hd;
      rag[bb + 1 + i] = tok * H * hd;
    }
    if (d_meta_.count() < bytes) d_meta_.reset(bytes);
    FOVEA_CUDA_CHECK(cudaMemcpyAsync(d_meta_.data(), h, bytes, cudaMemcpyHostToDevice, stream));
    st.release(stream);
    d_len_ = reinterpret_cast<int32_t*>(d_meta_.data());
    d_rag_ = reinterpret_cast<int64_t*>(d_meta_.data() + rag_at);
    bb_ = bb;
    const size_t need = size_t(N) * 3 * H * hd;
    if (need > buf_.count()) buf_.reset(need);
    shape_ = sh;
    planned_ = true;
  }

  void prepare(const void* qkv, int64_t qkv_token_stride, const float* rope_cos, const float* rope_sin,
               const DeviceScales& scales, cudaStream_t stream) override {
    (void)scales;  // BF16 only (FP8 is refused at construction): no scales, so nothing to guard
    if (!planned_) fail_cat("CUDNN attention: prepare() before plan()");
    if (!qkv) fail_cat("CUDNN attention: qkv is null");
    const int64_t H = shape_.heads, hd = shape_.head_dim;
    if (qkv_token_stride < 3 * H * hd)
      fail_cat("CUDNN attention: qkv token stride ", qkv_token_stride, " is below 3*H*hd = ", 3 * H * hd);
    if (bool(rope_cos) != bool(rope_sin)) fail_cat("CUDNN attention: give both RoPE tables or neither");
    const int64_t rows = shape_.total_tokens() * H, threads = rows * (hd / 2);
    if (threads > 0)
      rope_copy_kernel<<<unsigned((threads + 255) / 256), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(qkv),
                                                                            qkv_token_stride, rope_cos, rope_sin,
                                                                            buf_.data(), rows, int(H), int(hd / 2));
    FOVEA_CUDA_CHECK(cudaGetLastError());
    prepared_ = true;
  }

  void attend(void* out, cudaStream_t stream) override {
    if (!prepared_) fail_cat("CUDNN attention: attend() before prepare()");
    if (!out) fail_cat("CUDNN attention: out is null");
    const int64_t Hd = int64_t(shape_.heads) * shape_.head_dim;
    check(cudnnSetStream(handle_.get(), stream), "setting the stream");
    __nv_bfloat16* base = buf_.data();
    const int64_t uids[] = {kQ, kK, kV, kO, kScale, kSeqLen, kSeqLenKv, kRaggedQkv, kRaggedO};
    void* ptrs[] = {base, base + Hd, base + 2 * Hd, out, &scale_, d_len_, d_len_, d_rag_, d_rag_ + bb_ + 1};
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    void* ws = workspace_.data();
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 9, uids)
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 9, ptrs)
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws)
        .finalize("the variant pack");
    check(cudnnBackendExecute(handle_.get(), current_->plan, pack.get()), "running the attention");
  }

  const VarlenShape& shape() const override { return shape_; }
  AttnDtype dtype() const override { return dtype_; }

 private:
  AttnDtype dtype_;
  VarlenShape shape_;
  Handle<cudnnHandle_t, cudnnDestroy> handle_;
  std::map<std::pair<int64_t, int64_t>, Plan> plans_;  // by (segments bucket, S bucket); destroyed before handle_
  Plan* current_ = nullptr;
  DeviceBuffer<uint8_t> workspace_, d_meta_;
  DeviceBuffer<__nv_bfloat16> buf_;  // q, k rotated and v: [N, 3, H, hd]
  StagingSlot staging_[2];
  int next_staging_ = 0;
  int32_t* d_len_ = nullptr;
  int64_t* d_rag_ = nullptr;  // [bb + 1] for qkv, then [bb + 1] for out
  int64_t bb_ = 0;
  float scale_ = 0;  // 1 / sqrt(hd), by value: a captured graph holds it
  bool planned_ = false, prepared_ = false;
};

}  // namespace

std::unique_ptr<Attention> make_cudnn_attention(AttnDtype dtype, int heads, int head_dim) {
  return std::make_unique<CudnnAttention>(dtype, heads, head_dim);
}

}  // namespace fovea::cuda
