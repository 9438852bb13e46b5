// The body of POST /v1/encode, from untrusted bytes to what the server works on. Parsed with the
// bounded JSON reader (fovea/json.h): nesting, element and key counts are limited before a value
// is built, so a hostile body costs time linear in its length and little memory beyond it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fovea/pipeline.h"

namespace fovea::server {

// A request's failure, as the reply it becomes: {"error": {"message", "type", "code"}}.
struct ApiError {
  int status = 500;
  std::string code, message;
};
[[noreturn]] void reject(int status, std::string code, std::string message);

// What an item is: said by its array ("videos"), its content part's type (video_url / image_url) or
// its data URL's media type (data:video/..., data:image/...); ANY when nothing says (bare base64):
// its bytes decide.
enum class ItemKind { ANY, IMAGE, VIDEO };

// One item of a request: an image or a clip, carried in the body or read from its URL.
struct RequestItem {
  std::string payload;  // its base64 text (a data URL's prefix removed); "" for a remote item
  ItemKind kind = ItemKind::ANY;
  std::string name;  // for messages: "images[2]", "videos[0]"
  // Its "uuid" ("" when it has none: the encoder cache then keys it by the sha256 of its URL string
  // as sent, as vLLM's EPD proxy does), and its data URL's prefix through the ',' ("" for bare
  // base64), so that string can be hashed after the prefix is cut.
  std::string uuid, url_prefix;
  // Its file:// or http(s):// URL, read before it is decoded (media-url.h); "" for an item carried in
  // the body. Its payload is then "" and its key the sha256 of this string.
  std::string remote_url;
  std::vector<uint8_t> fetched;  // a remote item's bytes, once the handler read them
};

struct EncodeRequest {
  std::vector<RequestItem> items;  // numbered as the parsers below say
  // "encoding": "base64" (the default: bf16 bytes in JSON, BF16 tensors in a safetensors reply) or
  // "float" (fp32: float lists in JSON, F32 tensors in safetensors). One field for both replies rather
  // than a separate "dtype": the JSON reply already pairs "float" with "dtype": "float32", and a body
  // then means the same values whichever Accept header asks for it.
  bool as_base64 = true;
  bool deepstack = false;      // "return_deepstack"
  int return_embeddings = -1;  // "return_embeddings": 1 or 0; -1 when absent (then: not with the encoder cache)
  // A chat request's "mm_processor_kwargs" and "media_io_kwargs", as sent (key order kept): what they
  // ask of the preprocessing is checked and applied by fovea::apply_mm_kwargs, and vLLM's key for each
  // item derived from them (fovea::vllm_mm_hash).
  MmKwargs kwargs;
};

// {"images": [...], "videos"?: [...], "encoding"?, "return_deepstack"?, "return_embeddings"?, "model"?}.
// Items are data URLs (data:image/png;base64,..., data:video/mp4;base64,...) or plain base64, bare or
// in an OpenAI content part {"type": "image_url", "image_url": {"url": ...}, "uuid"?} (or
// "image_url": "..."), or {"type": "video_url", "video_url": ...}; "images" may hold videos too (by
// part type, media type or bytes), "videos" only videos. Items are numbered images first, then
// videos. A uuid must be one safe folder name (fovea/ec-cache.h). Throws ApiError: 400 invalid_json /
// invalid_request / invalid_uuid / too_many_images, 404 model_not_found.
EncodeRequest parse_encode_request(std::string_view body, size_t max_images, const std::string& model);

// POST /v1/chat/completions as vLLM's EPD proxy sends it to an encode instance (and a client's own
// chat request of that shape): {"model"?, "messages": [{"role", "content": [parts]}], "stream"?: false,
// ...}. image_url parts are the items (with their "uuid", as /v1/encode takes them), in document
// order, named "messages[m].content[k]"; so are video_url parts; text parts are skipped; other OpenAI
// fields are ignored. "mm_processor_kwargs" and "media_io_kwargs" (objects or null) are kept in
// EncodeRequest::kwargs, in their keys' order; "priority" (an integer) and "session_id" (a string),
// which vLLM's proxy forwards too, are checked and ignored. Refused with 400 naming the field and
// why: "stream": true, ec_transfer_params (push connectors), other part types, those fields of
// another type.
EncodeRequest parse_chat_request(std::string_view body, size_t max_images, const std::string& model);

// Each item's kind: its first bytes decide (fovea::input_kind); an item the request called an image
// or a video must be one (400 invalid_image / invalid_video naming the item otherwise). Bad base64 is
// left to the item's decode, which says where.
std::vector<InputKind> settle_kinds(const EncodeRequest& r);
// The error code of an item of that kind that cannot be read: invalid_image or invalid_video.
const char* invalid_item_code(InputKind k);

}  // namespace fovea::server
