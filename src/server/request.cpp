// The body of POST /v1/encode (see request.h).
#include "server/request.h"

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/json.h"

namespace fovea::server {

using json = nlohmann::json;

void reject(int status, std::string code, std::string message) {
  throw ApiError{status, std::move(code), std::move(message)};
}

namespace {

// images[i] as its base64 text, moved out of the document.
std::string image_payload(json& item, size_t i) {
  const std::string where = fmt::format("images[{}]", i);
  json* url = &item;
  if (item.is_object()) {
    const auto type = item.find("type");
    const auto part = item.find("image_url");
    if (type == item.end() || *type != "image_url" || part == item.end() || item.size() != 2)
      reject(400, "invalid_image",
             where + ": an object must be a content part {\"type\": \"image_url\", \"image_url\": {\"url\": ...}}");
    url = part->is_object() && part->contains("url") ? &part->at("url") : &*part;
  }
  if (!url->is_string())
    reject(400, "invalid_image", fmt::format("{}: expected a data URL or base64 string, got {}", where, url->type_name()));
  std::string s = std::move(url->get_ref<std::string&>());
  if (s.starts_with("data:")) {
    const size_t comma = s.find(',');
    if (comma == std::string::npos) reject(400, "invalid_image", where + ": data URL without ','");
    if (!std::string_view(s).substr(0, comma).ends_with(";base64"))
      reject(400, "invalid_image", where + ": only base64 data URLs are accepted (data:image/png;base64,...)");
    s.erase(0, comma + 1);
    return s;
  }
  if (s.starts_with("http://") || s.starts_with("https://"))
    reject(400, "invalid_image", where + ": image URLs are not fetched; send the image inline as a data URL or base64");
  if (s.empty()) reject(400, "invalid_image", where + ": empty string");
  return s;
}

}  // namespace

EncodeRequest parse_encode_request(std::string_view body, size_t max_images, const std::string& model) {
  // A valid request nests 4 deep ({"images": [{"image_url": {"url": ...}}]}) and holds a few values
  // per image; anything far beyond that is refused before it is built.
  JsonLimits lim;
  lim.max_bytes = body.size();
  lim.max_depth = 8;
  lim.max_elements = 64 + 8 * max_images;
  lim.max_object_keys = 16;
  lim.max_string_bytes = body.size();
  json doc;
  try {
    doc = parse_json_bounded(body, lim, "the request body");
  } catch (const Error& e) {
    reject(400, "invalid_json", e.what());
  }
  if (!doc.is_object()) reject(400, "invalid_request", "the body must be a JSON object with an \"images\" array");
  EncodeRequest r;
  for (auto& [key, value] : doc.items()) {
    if (key == "images") continue;
    if (key == "encoding") {
      if (value != "base64" && value != "float")
        reject(400, "invalid_request",
               fmt::format("\"encoding\" must be \"base64\" or \"float\", not {}", quote_for_error(value)));
      r.as_base64 = value == "base64";
    } else if (key == "return_deepstack") {
      if (!value.is_boolean()) reject(400, "invalid_request", "\"return_deepstack\" must be true or false");
      r.deepstack = value.get<bool>();
    } else if (key == "model") {
      if (value != model)
        reject(404, "model_not_found",
               fmt::format("model {} is not served here; this server serves \"{}\"", quote_for_error(value), model));
    } else {
      reject(400, "invalid_request",
             fmt::format("unknown field {} (accepted: images, encoding, return_deepstack, model)",
                         quote_for_error(std::string_view(key))));
    }
  }
  const auto images = doc.find("images");
  if (images == doc.end() || !images->is_array() || images->empty())
    reject(400, "invalid_request",
           "\"images\" must be a non-empty array of data URLs, base64 strings or image_url content parts");
  if (images->size() > max_images)
    reject(400, "too_many_images",
           fmt::format("{} images in one request; the limit is {} (--max-images-per-request)", images->size(), max_images));
  for (size_t i = 0; i < images->size(); ++i) r.payloads.push_back(image_payload((*images)[i], i));
  return r;
}

}  // namespace fovea::server
