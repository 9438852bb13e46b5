// Fuzzes WebP decoding through libwebp + libwebpdemux (src/image/decode-webp.cpp): any bytes give an
// image or a fovea::Error naming it, never a crash, a hang or an unbounded allocation. Seeds:
// fuzz/corpus/image-webp/ (small valid files of each layout); a small pixel guard keeps every run fast.
#include "image-harness.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fovea::fuzz::decode_image(data, size);
}
