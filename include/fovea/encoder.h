// fovea/encoder.h: the Qwen3-VL vision encoder on the GPU (bf16 activations, cuBLASLt GEMMs with
// bias / GELU / residual fused into their epilogues, FOVEA attention in BF16 or FP8).
//   plan(grids)  once per set of image grids: allocates every activation buffer (nothing is
//                allocated inside the layer loop), builds RoPE and position-embedding tables and the
//                attention plan. Not capturable.
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

  void plan(const std::vector<GridThw>& grids);
  // pixels [N, 1536] (fp32 on the host, rounded to bf16 as transformers does; docs/encoder.md §Patch embedding).
  void upload_pixels(const std::vector<float>& pixels, cudaStream_t stream);
  void forward(cudaStream_t stream);
  // Host-side bookkeeping after a forward (calibration: sync, copy rings, maybe write the file).
  void after_forward(cudaStream_t stream);
  // Copies the device rings and scales into the scale book (dynamic and calibrate modes; syncs).
  void sync_scales(cudaStream_t stream);
  std::vector<float> merged(cudaStream_t stream) const;                  // [N/4, out_hidden]
  std::vector<std::vector<float>> deepstack(cudaStream_t stream) const;  // each [N/4, out_hidden]
  int64_t tokens() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace cuda
}  // namespace fovea::qwen3vl
