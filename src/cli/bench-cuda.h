// Shared by the GPU benchmarks of the fovea command: a CUDA call check that throws fovea::Error.
#pragma once
#if FOVEA_HAVE_CUDA
#include <cuda_runtime.h>

#include "fovea/error.h"

#define BENCH_CUDA(call)                                                         \
  do {                                                                           \
    const cudaError_t e_ = (call);                                               \
    if (e_ != cudaSuccess) fail("{} failed: {}", #call, cudaGetErrorString(e_)); \
  } while (0)
#endif
