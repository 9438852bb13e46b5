// The body of POST /v1/encode, from untrusted bytes to what the server works on. Parsed with the
// bounded JSON reader (fovea/json.h): nesting, element and key counts are limited before a value
// is built, so a hostile body costs time linear in its length and little memory beyond it.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace fovea::server {

// A request's failure, as the reply it becomes: {"error": {"message", "type", "code"}}.
struct ApiError {
  int status = 500;
  std::string code, message;
};
[[noreturn]] void reject(int status, std::string code, std::string message);

struct EncodeRequest {
  std::vector<std::string> payloads;  // each image's base64 text (a data URL's prefix removed)
  // "encoding": "base64" (the default: bf16 bytes in JSON, BF16 tensors in a safetensors reply) or
  // "float" (fp32: float lists in JSON, F32 tensors in safetensors). One field for both replies rather
  // than a separate "dtype": the JSON reply already pairs "float" with "dtype": "float32", and a body
  // then means the same values whichever Accept header asks for it.
  bool as_base64 = true;
  bool deepstack = false;             // "return_deepstack"
};

// {"images": [...], "encoding"?, "return_deepstack"?, "model"?}. Images are data URLs
// (data:image/png;base64,...) or plain base64, bare or in an OpenAI content part
// {"type": "image_url", "image_url": {"url": ...}} (or "image_url": "..."). Throws ApiError: 400
// invalid_json / invalid_request / invalid_image / too_many_images, 404 model_not_found.
EncodeRequest parse_encode_request(std::string_view body, size_t max_images, const std::string& model);

}  // namespace fovea::server
