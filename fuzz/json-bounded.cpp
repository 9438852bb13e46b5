// Fuzzes fovea::parse_json_bounded (src/core/json.cpp) against nlohmann's own parser: any bytes give
// a value equal to nlohmann::json::parse's, or a fovea::Error; text nlohmann rejects is rejected,
// and quote_for_error stays bounded. Never a crash, a hang or unbounded memory.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fovea/error.h"
#include "fovea/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fovea::JsonLimits limits;  // small limits, so the fuzzer reaches every one of them
  limits.max_bytes = 1 << 16;
  limits.max_depth = 12;
  limits.max_elements = 2048;
  limits.max_object_keys = 64;
  limits.max_string_bytes = 512;
  const std::string q = fovea::quote_for_error(text, 32);
  if (q.size() > 2 + 32 * 4 + 3) std::abort();  // at most 4 output bytes (\xNN) per character
  try {
    const nlohmann::json mine = fovea::parse_json_bounded(text, limits, "fuzz");
    const nlohmann::json theirs = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (theirs.is_discarded() || mine != theirs) std::abort();
    if (fovea::quote_for_error(mine, 48).size() > 48 * 4 + 3) std::abort();
  } catch (const fovea::Error& e) {
    const std::string m = e.what();
    if (m.rfind("fuzz", 0) != 0 || m.size() > 2000) std::abort();  // prefixed, and client text cut
    if (m.find(" is not valid JSON: ") != std::string::npos &&
        !nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false).is_discarded())
      std::abort();  // a syntax error nlohmann does not see
  }
  return 0;
}
