// fovea/system.h: what the machine offers: whether CUDA and cuDNN are built in, their versions, and
// the visible GPUs. query_system() is src/core/cuda-device.cu, or src/core/no-cuda-device.cpp in a
// build without CUDA.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace fovea {

struct GpuInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sms = 0;
  size_t memory_bytes = 0;
};

struct SystemInfo {
  // cudnn_built: the CUDNN attention backend is built in (it also needs cuDNN 9.15 or newer at run time).
  bool cuda_built = false, cudnn_built = false;
  int cuda_runtime_version = 0, cuda_driver_version = 0;  // 13000 = 13.0; 0 = unknown / none
  size_t cudnn_version = 0;                               // 91400 = 9.14.0; 0 = not built / not loadable
  std::vector<GpuInfo> gpus;
  std::string gpu_error;  // why no GPU is visible, when none is
};
SystemInfo query_system();

// Makes GPU `index` the calling thread's CUDA device (each encoder replica's worker thread calls it
// before creating its encoder). Throws fovea::Error naming the index if that fails or CUDA is not
// built in.
void use_gpu(int index);

}  // namespace fovea
