// Fuzzes the POST /v1/chat/completions body parser (src/server/request.cpp, parse_chat_request): any
// bytes give an EncodeRequest or an ApiError with a 4xx status and a message, never a crash; every
// uuid it accepts can name a cache folder, every item is an image or a clip with its uuid, URL
// prefix and remote URL slot (a remote item carries no payload), and no reply would carry embeddings.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/ec-cache.h"
#include "server/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = fovea::server::parse_chat_request(body, 4, "synthetic:tiny");
    if (r.payloads.empty() || r.payloads.size() > 4 || r.return_embeddings != 0) std::abort();
    if (r.uuids.size() != r.payloads.size() || r.url_prefixes.size() != r.payloads.size() ||
        r.remote_urls.size() != r.payloads.size())
      std::abort();
    for (size_t i = 0; i < r.payloads.size(); ++i) {
      if (r.kinds[i] != fovea::server::ItemKind::IMAGE && r.kinds[i] != fovea::server::ItemKind::VIDEO) std::abort();
      if (!r.remote_urls[i].empty() && !r.payloads[i].empty()) std::abort();
      if (!r.uuids[i].empty() && !fovea::ec_key_problem(r.uuids[i]).empty()) std::abort();
    }
  } catch (const fovea::server::ApiError& e) {
    if (e.status < 400 || e.status > 499 || e.message.empty()) std::abort();
  }
  return 0;
}
