// fovea/encoder.h: the Qwen3-VL vision encoder on the GPU (bf16 activations, cuBLASLt GEMMs with
// bias / GELU / residual fused into their epilogues, FOVEA attention in BF16 or FP8).
//   plan(grids)  once per set of image grids: lays every activation buffer out in one device
//                arena (allocating only when the batch is the largest yet; nothing is allocated in
//                the layer loop), builds RoPE and position-embedding tables and the attention plan.
//                Not capturable. Host staging is pinned and reused.
//   forward()    the whole encoder from the device pixel buffer; no host synchronization, so it can
//                be captured in a CUDA graph and replayed (dynamic FP8 scaling included).
#pragma once
#include <memory>
#include <vector>

#include "fovea/attention.h"
#include "fovea/model.h"
#include "fovea/scales.h"

namespace fovea::qwen3vl {

// A model of any configuration with fovea's deterministic synthetic weights (what the
// synthetic:<preset> models use), e.g. an 8B-shaped encoder with fewer blocks for tests.
Model synthetic_model(const VisionConfig& config);

namespace cuda {

struct EncoderOptions {
  AttnDtype dtype = AttnDtype::BF16;  // BF16 or FP8 attention
  // FP8 only: the scale book; DYNAMIC and CALIBRATE keep their rings in device memory (copied back
  // to the book after each forward only when calibrating), STATIC uploads its scales once.
  ScaleBook* scales = nullptr;
};

class Encoder {
 public:
  Encoder(const Model& model, const EncoderOptions& options);
  ~Encoder();
  Encoder(const Encoder&) = delete;
  Encoder& operator=(const Encoder&) = delete;

  // Sizes the device arena every per-batch buffer lives in for batches of up to `patches` patches
  // (plan() grows it when a batch needs more, and never shrinks it).
  void reserve(int64_t patches);
  void plan(const std::vector<GridThw>& grids);
  // pixels [N, 1536] (fp32 on the host, rounded to bf16 as transformers does; docs/encoder.md §Patch embedding).
  void upload_pixels(const std::vector<float>& pixels, cudaStream_t stream);
  void forward(cudaStream_t stream);
  // Host-side bookkeeping after a forward (calibration: sync, copy rings, maybe write the file).
  void after_forward(cudaStream_t stream);
  // Copies the device rings and scales into the scale book (dynamic and calibrate modes; syncs).
  void sync_scales(cudaStream_t stream);
  // The outputs as bf16 bits, as computed, into `out` (resized; vectors large enough are reused
  // without reallocation): merged first, then (with_deepstack) each deepstack output, each
  // [N/4, out_hidden]; through pinned staging, one synchronization.
  void outputs_bf16(bool with_deepstack, std::vector<std::vector<uint16_t>>& out, cudaStream_t stream) const;
  std::vector<float> merged(cudaStream_t stream) const;                  // [N/4, out_hidden]
  std::vector<std::vector<float>> deepstack(cudaStream_t stream) const;  // each [N/4, out_hidden]
  int64_t tokens() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cuda
}  // namespace fovea::qwen3vl
