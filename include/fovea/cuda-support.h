// fovea/cuda-support.h: CUDA plumbing shared by the library, the tests and the benches (CUDA builds
// only): one status check macro, owning types for every CUDA resource (device and pinned buffers,
// events, streams, graphs, library handles) and the benches' event timer.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fovea/error.h"

namespace fovea::cuda {

// The status types FOVEA_CUDA_CHECK accepts: CUDA runtime, cuBLAS(Lt) and, where cudnn.h was included
// before this header, cuDNN.
inline bool status_ok(cudaError_t e) { return e == cudaSuccess; }
inline std::string status_text(cudaError_t e) {
  return std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")";
}
inline bool status_ok(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
inline std::string status_text(cublasStatus_t s) {
  return std::string(cublasLtGetStatusString(s)) + " (cuBLAS status " + std::to_string(int(s)) + ")";
}
#if FOVEA_HAVE_CUDNN && defined(CUDNN_MAJOR)
inline bool status_ok(cudnnStatus_t s) { return s == CUDNN_STATUS_SUCCESS; }
inline std::string status_text(cudnnStatus_t s) { return cudnnGetErrorString(s); }
#endif

}  // namespace fovea::cuda

// Checks a CUDA runtime, cuBLAS(Lt) or cuDNN call; throws fovea::Error naming the call, file and line.
#define FOVEA_CUDA_CHECK(call)                                                                                 \
  do {                                                                                                         \
    const auto st_ = (call);                                                                                   \
    if (!::fovea::cuda::status_ok(st_))                                                                        \
      ::fovea::fail_cat(#call, " failed: ", ::fovea::cuda::status_text(st_), " at ", __FILE__, ":", __LINE__); \
  } while (0)

namespace fovea::cuda {

// An owning buffer of count() T's from Alloc/Free (below); move-only, empty when default-constructed,
// moved from or when the allocation threw.
template <class T, cudaError_t (*Alloc)(void**, size_t), cudaError_t (*Free)(void*)>
class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  explicit OwnedBuffer(size_t count) { reset(count); }
  ~OwnedBuffer() { release(); }
  OwnedBuffer(OwnedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  OwnedBuffer& operator=(OwnedBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;

  // Frees the old buffer first (no peak of both); contents are not kept.
  void reset(size_t count) {
    release();
    if (count == 0) return;
    void* p = nullptr;
    FOVEA_CUDA_CHECK(Alloc(&p, count * sizeof(T)));
    data_ = static_cast<T*>(p);
    count_ = count;
  }

  T* data() const { return data_; }
  size_t count() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool empty() const { return count_ == 0; }

 private:
  void release() {
    if (data_) Free(data_);  // a free that fails (a dead context) has nothing left to release
    data_ = nullptr;
    count_ = 0;
  }
  T* data_ = nullptr;
  size_t count_ = 0;
};

// Where device buffers come from: cudaMalloc, or an allocator the host program installs
// (fovea_attn_set_allocator: the Python package installs torch's caching allocator, so a framework's
// memory accounting sees fovea's buffers). A buffer goes back to the allocator that made it; one made
// by an allocator since uninstalled is left to the process's end (that allocator may be gone).
struct DeviceAllocator {
  void* (*alloc)(size_t bytes, int32_t device, void* ctx) = nullptr;
  void (*free)(void* p, size_t bytes, int32_t device, void* ctx) = nullptr;
  void* ctx = nullptr;
};

namespace detail {
struct HostedBuffers {
  std::mutex m;
  DeviceAllocator installed;
  uint64_t generation = 0;  // of `installed`: a buffer of an older one is not freed through it
  struct Made {
    DeviceAllocator from;
    uint64_t generation;
    size_t bytes;
    int32_t device;
  };
  std::unordered_map<void*, Made> live;
};
inline HostedBuffers& hosted() {
  static HostedBuffers h;
  return h;
}
// The lock is never held across the allocator's calls: they may call back into fovea (a host
// runtime's garbage collector freeing another buffer).
inline cudaError_t device_alloc(void** p, size_t bytes) {
  HostedBuffers& h = hosted();
  std::unique_lock lock(h.m);
  const DeviceAllocator a = h.installed;
  const uint64_t generation = h.generation;
  lock.unlock();
  if (!a.alloc) return cudaMalloc(p, bytes);
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  *p = a.alloc(bytes, device, a.ctx);
  if (!*p) return cudaErrorMemoryAllocation;
  lock.lock();
  h.live[*p] = {a, generation, bytes, device};
  return cudaSuccess;
}
inline cudaError_t device_free(void* p) {
  HostedBuffers& h = hosted();
  std::unique_lock lock(h.m);
  const auto it = h.live.find(p);
  if (it == h.live.end()) {
    lock.unlock();
    return cudaFree(p);
  }
  const HostedBuffers::Made made = it->second;
  const bool current = made.generation == h.generation;
  h.live.erase(it);
  lock.unlock();
  if (current) made.from.free(p, made.bytes, made.device, made.from.ctx);
  return cudaSuccess;
}
inline cudaError_t pinned_alloc(void** p, size_t bytes) { return cudaMallocHost(p, bytes); }
}  // namespace detail

// Installs `a` for the buffers made from now on (alloc and free both set), or cudaMalloc again (both
// null).
inline void set_device_allocator(const DeviceAllocator& a) {
  detail::HostedBuffers& h = detail::hosted();
  std::lock_guard lock(h.m);
  if (a.alloc == h.installed.alloc && a.free == h.installed.free && a.ctx == h.installed.ctx) return;
  h.installed = a;
  ++h.generation;
}

// Device memory (cudaMalloc / cudaFree, or the installed DeviceAllocator).
template <class T>
using DeviceBuffer = OwnedBuffer<T, detail::device_alloc, detail::device_free>;
// Page-locked host memory (cudaMallocHost / cudaFreeHost), the source of asynchronous uploads.
template <class T>
using PinnedBuffer = OwnedBuffer<T, detail::pinned_alloc, cudaFreeHost>;

// Owns one handle of a C API (CUDA runtime, cuBLASLt, cuDNN) and destroys it with Destroy: move-only,
// null when default-constructed or moved from. Destroy's status is ignored: a handle that fails to be
// destroyed (a dead context) has nothing left to release.
template <class H, auto Destroy>
class Handle {
 public:
  Handle() = default;
  explicit Handle(H h) noexcept : h_(h) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, H{})) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, H{});
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  H get() const { return h_; }
  void reset() {
    if (h_) Destroy(h_);
    h_ = H{};
  }

 private:
  H h_{};
};

// A CUDA event; it converts to cudaEvent_t for the runtime's calls.
class Event {
 public:
  explicit Event(unsigned flags = cudaEventDefault) {
    cudaEvent_t e = nullptr;
    FOVEA_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    e_ = Handle<cudaEvent_t, cudaEventDestroy>(e);
  }
  cudaEvent_t get() const { return e_.get(); }
  operator cudaEvent_t() const { return e_.get(); }
  void record(cudaStream_t stream) { FOVEA_CUDA_CHECK(cudaEventRecord(get(), stream)); }
  void synchronize() const { FOVEA_CUDA_CHECK(cudaEventSynchronize(get())); }
  // Milliseconds from `start` to this event, both recorded with timing and complete.
  float ms_since(const Event& start) const {
    float ms = 0;
    FOVEA_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), get()));
    return ms;
  }

 private:
  Handle<cudaEvent_t, cudaEventDestroy> e_;
};

// A CUDA stream (blocking, like cudaStreamCreate's); it converts to cudaStream_t.
class Stream {
 public:
  Stream() {
    cudaStream_t s = nullptr;
    FOVEA_CUDA_CHECK(cudaStreamCreate(&s));
    s_ = Handle<cudaStream_t, cudaStreamDestroy>(s);
  }
  cudaStream_t get() const { return s_.get(); }
  operator cudaStream_t() const { return s_.get(); }
  void synchronize() const { FOVEA_CUDA_CHECK(cudaStreamSynchronize(get())); }

 private:
  Handle<cudaStream_t, cudaStreamDestroy> s_;
};

// The work enqueue() puts on `stream`, captured into a CUDA graph (global capture mode unless told)
// and instantiated; launch() replays it. A throw during capture ends the capture, so the stream is usable.
class Graph {
 public:
  template <class F>
  Graph(cudaStream_t stream, F&& enqueue, cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal) {
    FOVEA_CUDA_CHECK(cudaStreamBeginCapture(stream, mode));
    cudaGraph_t g = nullptr;
    try {
      enqueue();
    } catch (...) {
      if (cudaStreamEndCapture(stream, &g) == cudaSuccess && g) cudaGraphDestroy(g);
      throw;
    }
    FOVEA_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    graph_ = Handle<cudaGraph_t, cudaGraphDestroy>(g);
    cudaGraphExec_t e = nullptr;
    FOVEA_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    exec_ = Handle<cudaGraphExec_t, cudaGraphExecDestroy>(e);
  }
  void launch(cudaStream_t stream) { FOVEA_CUDA_CHECK(cudaGraphLaunch(exec_.get(), stream)); }

 private:
  Handle<cudaGraph_t, cudaGraphDestroy> graph_;
  Handle<cudaGraphExec_t, cudaGraphExecDestroy> exec_;
};

// Pinned host memory that asynchronous copies read or write, reused from batch to batch: take()
// first waits for the event release() recorded after the last use's copies were enqueued, so the
// host never overwrites (or reads) what the GPU has not finished with.
class StagingSlot {
 public:
  StagingSlot() = default;
  StagingSlot(const StagingSlot&) = delete;
  StagingSlot& operator=(const StagingSlot&) = delete;
  // At least `bytes` bytes (grown by a quarter more when too small; the contents are not kept).
  uint8_t* take(size_t bytes) {
    wait();
    if (mem_.count() < bytes) mem_.reset(bytes + bytes / 4);
    return mem_.data();
  }
  // Grows to at least `bytes` now (pinned and faulted in; the contents are not kept), so that a
  // take() of that many later allocates nothing.
  void reserve(size_t bytes) {
    wait();
    if (mem_.count() < bytes) mem_.reset(bytes);
  }
  void release(cudaStream_t stream) {
    done_.record(stream);
    pending_ = true;
  }
  void wait() {
    if (!pending_) return;
    done_.synchronize();
    pending_ = false;
  }
  uint8_t* data() const { return mem_.data(); }

 private:
  PinnedBuffer<uint8_t> mem_;
  Event done_{cudaEventDisableTiming};
  bool pending_ = false;
};

// Median time of fn() over reps runs after warmup runs, with CUDA events recorded on stream around
// each run (fn enqueues its work on the same stream).
template <class F>
double median_ms(F&& fn, int warmup, int reps, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmup; ++i) fn();
  Event e0, e1;
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    e0.record(stream);
    fn();
    e1.record(stream);
    e1.synchronize();
    t.push_back(e1.ms_since(e0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace fovea::cuda
