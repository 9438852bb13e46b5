// Fuzzes BMP decoding through fovea's own BMP decoder (src/image/decode-bmp.cpp): any bytes give an
// image or a fovea::Error naming it, never a crash, a hang or an unbounded allocation. Seeds:
// fuzz/corpus/image-bmp/ (small valid files of each layout); a small pixel guard keeps every run fast.
#include "image-harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fovea::fuzz::decode_image(data, size);
}
