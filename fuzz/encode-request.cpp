// Fuzzes the /v1/encode body parser (src/server/request.cpp): any bytes give an EncodeRequest or an
// ApiError with a 4xx status and a message, never a crash.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "server/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = fovea::server::parse_encode_request(body, 4, "synthetic:tiny");
    if (r.payloads.empty() || r.payloads.size() > 4) std::abort();
  } catch (const fovea::server::ApiError& e) {
    if (e.status < 400 || e.status > 499 || e.message.empty()) std::abort();
  }
  return 0;
}
