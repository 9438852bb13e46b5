// What the machine offers, in a build without CUDA: no GPUs.
#include "fovea/system.h"

namespace fovea {

SystemInfo query_system() {
  SystemInfo s;
  s.gpu_error = "built without CUDA";
  return s;
}

}  // namespace fovea
