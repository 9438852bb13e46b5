// What the machine offers, in a build without CUDA: no GPUs.
#include "fovea/error.h"
#include "fovea/system.h"

namespace fovea {

SystemInfo query_system() {
  SystemInfo s;
  s.gpu_error = "built without CUDA";
  return s;
}

void use_gpu(int index) { fail("GPU {}: this build of fovea has no CUDA", index); }

}  // namespace fovea
