// Fuzzes the /v1/encode body parser (src/server/request.cpp): any bytes give an EncodeRequest or an
// ApiError with a 4xx status and a message, never a crash; every uuid it accepts can name a cache
// folder.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/ec-cache.h"
#include "server/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = fovea::server::parse_encode_request(body, 4, "synthetic:tiny");
    if (r.items.empty() || r.items.size() > 4) std::abort();
    for (const auto& it : r.items)
      if (!it.uuid.empty() && !fovea::ec_key_problem(it.uuid).empty()) std::abort();
  } catch (const fovea::server::ApiError& e) {
    if (e.status < 400 || e.status > 499 || e.message.empty()) std::abort();
  }
  return 0;
}
