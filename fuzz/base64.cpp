// Fuzzes fovea serve's base64 decoder (src/core/base64.cpp): any text decodes or throws
// fovea::Error, and what decodes re-encodes to text that decodes to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "fovea/error.h"
#include "fovea/base64.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const std::vector<uint8_t> bytes = fovea::base64_decode(text, "fuzz");
    if (bytes.size() > size / 4 * 3 + 3) std::abort();
    const std::string again = fovea::base64_encode(bytes.data(), bytes.size());
    if (fovea::base64_decode(again, "fuzz") != bytes) std::abort();
  } catch (const fovea::Error&) {}
  return 0;
}
