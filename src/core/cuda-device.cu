// What the machine offers, read through the CUDA runtime (and cuDNN when built in).
#include <cuda_runtime.h>
#if FOVEA_HAVE_CUDNN
#include <cudnn.h>
#endif

#include "fovea/error.h"
#include "fovea/system.h"

namespace fovea {

SystemInfo query_system() {
  SystemInfo s;
  s.cuda_built = true;
  s.cudnn_built = FOVEA_HAVE_CUDNN;
#if FOVEA_HAVE_CUDNN
  s.cudnn_version = cudnnGetVersion();
#endif
  cudaRuntimeGetVersion(&s.cuda_runtime_version);
  cudaDriverGetVersion(&s.cuda_driver_version);
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    s.gpu_error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return s;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    s.gpus.push_back({i, p.name, p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem});
  }
  if (s.gpus.empty()) s.gpu_error = "cudaGetDeviceCount found no device";
  return s;
}

void use_gpu(int index) {
  const cudaError_t err = cudaSetDevice(index);
  if (err != cudaSuccess) fail_cat("GPU ", index, ": cudaSetDevice: ", cudaGetErrorString(err));
}

}  // namespace fovea
