// Fuzzes the POST /v1/chat/completions body parser (src/server/request.cpp, parse_chat_request): any
// bytes give an EncodeRequest or an ApiError with a 4xx status and a message, never a crash; every
// uuid it accepts can name a cache folder, every item is an image or a clip (a remote item carries
// no payload), and no reply would carry embeddings.
// The kwargs it keeps are then applied to a server's preprocessing (apply_mm_kwargs: accepted within
// its limits, or refused with a message) and hashed into vLLM's key (vllm_mm_hash: 64 hex digits, or
// the uuid itself when they say nothing).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "server/request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = fovea::server::parse_chat_request(body, 4, "synthetic:tiny");
    if (r.items.empty() || r.items.size() > 4 || r.return_embeddings != 0) std::abort();
    for (const auto& it : r.items) {
      if (it.kind != fovea::server::ItemKind::IMAGE && it.kind != fovea::server::ItemKind::VIDEO) std::abort();
      if (!it.remote_url.empty() && !it.payload.empty()) std::abort();
      if (!it.uuid.empty() && !fovea::ec_key_problem(it.uuid).empty()) std::abort();
    }
    static const fovea::InputConfig server = fovea::load_input_config("synthetic:tiny");
    try {
      const fovea::InputConfig in = fovea::apply_mm_kwargs(server, r.kwargs);
      if (in.image.max_pixels > server.image.max_pixels || in.image.min_pixels > in.image.max_pixels ||
          in.video.max_pixels > server.video.max_pixels || in.video.max_frames > server.video.max_frames ||
          !(in.video.fps > 0))
        std::abort();
      for (const auto kind : {fovea::InputKind::IMAGE, fovea::InputKind::VIDEO}) {
        const std::string key = fovea::vllm_mm_hash("synthetic:tiny", kind, "u", r.kwargs);
        if (key != "u" && (key.size() != 64 || !fovea::ec_key_problem(key).empty())) std::abort();
      }
    } catch (const fovea::Error& e) {
      if (std::string_view(e.what()).empty()) std::abort();
    }
  } catch (const fovea::server::ApiError& e) {
    if (e.status < 400 || e.status > 499 || e.message.empty()) std::abort();
  }
  return 0;
}
