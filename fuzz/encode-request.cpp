// Fuzzes the /v1/encode body parser (src/server/request.cpp): any bytes give an EncodeRequest or an
// ApiError with a 4xx status and a message, never a crash; every uuid it accepts can name a cache
// folder, and each image has its uuid and URL prefix.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/ec-cache.h"
#include "server/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = fovea::server::parse_encode_request(body, 4, "synthetic:tiny");
    if (r.payloads.empty() || r.payloads.size() > 4) std::abort();
    if (r.uuids.size() != r.payloads.size() || r.url_prefixes.size() != r.payloads.size()) std::abort();
    for (const auto& u : r.uuids)
      if (!u.empty() && !fovea::ec_key_problem(u).empty()) std::abort();
  } catch (const fovea::server::ApiError& e) {
    if (e.status < 400 || e.status > 499 || e.message.empty()) std::abort();
  }
  return 0;
}
