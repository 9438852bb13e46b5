// The body of POST /v1/encode (see request.h).
#include "server/request.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "fovea/ec-cache.h"
#include "fovea/error.h"
#include "fovea/json.h"
#include "fovea/base64.h"

namespace fovea::server {

using json = nlohmann::json;

void reject(int status, std::string code, std::string message) {
  throw ApiError{status, std::move(code), std::move(message)};
}

namespace {

// The images' base64 (megabytes each) would cost the JSON parser most of its time (~12 ns a byte);
// finding a string's end costs two memchr. So every string of at least kLift bytes without an
// escape is lifted out before the parse: in a copy of the body it becomes the placeholder
// "\u0000<k>" (NUL, then its index), and the parsed value maps back to lifted[k]. No client string
// can be taken for a placeholder: a body with the escape \u0000 anywhere is parsed whole instead.
constexpr size_t kLift = 4096;
struct Lifted {
  std::string skeleton;                 // the body with the placeholders; empty: nothing lifted
  std::vector<std::string_view> parts;  // views into the body
};

Lifted lift_long_strings(std::string_view body) {
  Lifted out;
  size_t copied = 0, i = 0;
  const char* b = body.data();
  const auto find = [&](char c, size_t from, size_t to) -> size_t {
    const void* p = std::memchr(b + from, c, to - from);
    return p ? size_t(static_cast<const char*>(p) - b) : std::string_view::npos;
  };
  while ((i = find('"', i, body.size())) != std::string_view::npos) {
    // The closing quote: the first one not escaped. `end` is the next quote after j; it is searched
    // for again only once an escape has stepped past it, so each byte is scanned a bounded number of
    // times whatever the escapes (searching anew after every backslash made "\n\n\n..." quadratic).
    size_t j = i + 1, end = find('"', j, body.size());
    bool escaped = false;
    for (;;) {
      if (end == std::string_view::npos) return {};  // unterminated: the parser says so
      const size_t bs = find('\\', j, end);
      if (bs == std::string_view::npos) break;
      escaped = true;
      if (body.substr(bs, 6) == "\\u0000") return {};
      j = bs + 2;
      if (j > body.size()) return {};
      if (j > end) end = find('"', j, body.size());  // that quote was escaped
    }
    if (!escaped && end - i - 1 >= kLift) {
      out.skeleton.append(body.substr(copied, i - copied));
      out.skeleton += "\"\\u0000" + std::to_string(out.parts.size()) + "\"";
      out.parts.push_back(body.substr(i + 1, end - i - 1));
      copied = end + 1;
    }
    i = end + 1;
  }
  if (out.parts.empty()) return {};
  out.skeleton.append(body.substr(copied));
  return out;
}

// The lifted string a parsed value stands for, or null if it is not a placeholder.
const std::string_view* lifted_part(const std::string& v, const Lifted& l) {
  if (v.size() < 2 || v[0] != '\0') return nullptr;
  size_t k = 0;
  for (size_t c = 1; c < v.size(); ++c) {
    if (v[c] < '0' || v[c] > '9' || c > 9) return nullptr;
    k = k * 10 + size_t(v[c] - '0');
  }
  return k < l.parts.size() ? &l.parts[k] : nullptr;
}

// The error code of a malformed item: invalid_video for what is said to be a video, else invalid_image.
const char* item_code(ItemKind kind) { return kind == ItemKind::VIDEO ? "invalid_video" : "invalid_image"; }

// Whether the item is a URL to read (file://, http://, https://: media-url.h, which refuses other
// schemes by name) rather than carried in the body: a scheme, then ':' (never in base64).
bool is_remote(std::string_view s) {
  const size_t colon = s.find(':');
  if (colon == 0 || colon == std::string_view::npos || colon > 16 || !std::isalpha(static_cast<unsigned char>(s[0])))
    return false;
  return std::all_of(s.begin(), s.begin() + colon, [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '+' || ch == '-' || ch == '.';
  });
}

// An item's URL string as its base64 text; `prefix` gets what was cut (a data URL's head), and a
// data URL's media type (image/..., video/...) sets `kind` where the request did not. A URL to read
// goes to `remote` whole, and the base64 text is "".
std::string item_payload(json& url_value, const std::string& where, const Lifted& lifted, std::string& prefix,
                         std::string& remote, ItemKind& kind) {
  json* url = &url_value;
  if (!url->is_string())
    reject(400, item_code(kind),
           fmt::format("{}: expected a data URL or base64 string, got {}", where, url->type_name()));
  std::string s = std::move(url->get_ref<std::string&>());
  if (const std::string_view* part = lifted_part(s, lifted)) s.assign(*part);
  if (s.starts_with("data:")) {
    const size_t comma = s.find(',');
    if (comma == std::string::npos) reject(400, item_code(kind), where + ": data URL without ','");
    const std::string_view head = std::string_view(s).substr(0, comma);
    if (!head.ends_with(";base64"))
      reject(400, item_code(kind),
             where + ": only base64 data URLs are accepted (data:image/png;base64,..., data:video/mp4;base64,...)");
    const ItemKind said = head.starts_with("data:video/")   ? ItemKind::VIDEO
                          : head.starts_with("data:image/") ? ItemKind::IMAGE
                                                            : ItemKind::ANY;
    if (kind == ItemKind::ANY) kind = said;
    prefix = s.substr(0, comma + 1);
    s.erase(0, comma + 1);
    return s;
  }
  if (is_remote(s)) {
    remote = std::move(s);
    return "";
  }
  if (s.empty()) reject(400, item_code(kind), where + ": empty string");
  return s;
}

// One item of "images" or "videos" into r: its base64 text (moved out of the document), its kind,
// its uuid and its URL's prefix. `kind` is what its array says ("videos": VIDEO); a content part's
// type says it too ({"type": "image_url", "image_url": ...} or {"type": "video_url", "video_url": ...}).
// The body (its long strings lifted out) parsed with the bounded reader: nesting at most 8 deep, at
// most max_elements values and max_keys keys an object.
json parse_body(std::string_view body, const Lifted& lifted, size_t max_elements, size_t max_keys) {
  JsonLimits lim;
  lim.max_bytes = body.size();
  lim.max_depth = 8;
  lim.max_elements = max_elements;
  lim.max_object_keys = max_keys;
  lim.max_string_bytes = body.size();
  try {
    return parse_json_bounded(lifted.parts.empty() ? body : std::string_view(lifted.skeleton), lim, "the request body");
  } catch (const Error& e) {
    reject(400, "invalid_json", e.what());
  }
}

void add_item(EncodeRequest& r, json& item, const std::string& where, ItemKind kind, const Lifted& lifted) {
  json* url = &item;
  std::string uuid;
  if (item.is_object()) {
    const auto type = item.find("type");
    const auto id = item.find("uuid");
    const std::string t = type != item.end() && type->is_string() ? type->get<std::string>() : "";
    const auto part = t == "image_url" || t == "video_url" ? item.find(t) : item.end();
    if (part == item.end() || item.size() != size_t(id != item.end() ? 3 : 2))
      reject(400, item_code(t == "video_url" ? ItemKind::VIDEO : kind),
             where +
                 ": an object must be a content part {\"type\": \"image_url\", \"image_url\": {\"url\": ...}} or "
                 "{\"type\": \"video_url\", \"video_url\": {\"url\": ...}}, with a \"uuid\" or without");
    const ItemKind said = t == "video_url" ? ItemKind::VIDEO : ItemKind::IMAGE;
    if (kind != ItemKind::ANY && said != kind)
      reject(400, "invalid_video", fmt::format("{}: an {} part in \"videos\"", where, t));
    kind = said;
    url = part->is_object() && part->contains("url") ? &part->at("url") : &*part;
    if (id != item.end()) {
      if (!id->is_string())
        reject(400, "invalid_uuid", fmt::format("{}: \"uuid\" must be a string, not {}", where, id->type_name()));
      uuid = id->get<std::string>();
      if (const std::string_view* long_one = lifted_part(uuid, lifted)) uuid.assign(*long_one);
      if (const std::string why = ec_key_problem(uuid); !why.empty())
        reject(400, "invalid_uuid",
               fmt::format("{}: uuid {} cannot name an encoder cache entry: {}", where, quote_for_error(uuid), why));
    }
  }
  RequestItem& it = r.items.emplace_back();
  it.uuid = std::move(uuid);
  it.payload = item_payload(*url, where, lifted, it.url_prefix, it.remote_url, kind);
  it.kind = kind;
  it.name = where;
}

}  // namespace

EncodeRequest parse_encode_request(std::string_view body, size_t max_images, const std::string& model) {
  // A valid request nests 4 deep ({"images": [{"image_url": {"url": ...}}]}) and holds a few values
  // per image; anything far beyond that is refused before it is built.
  const Lifted lifted = lift_long_strings(body);
  json doc = parse_body(body, lifted, 64 + 8 * max_images, 16);
  if (!doc.is_object())
    reject(400, "invalid_request", "the body must be a JSON object with an \"images\" or \"videos\" array");
  EncodeRequest r;
  for (auto& [key, value] : doc.items()) {
    if (key == "images" || key == "videos") continue;
    if (key == "encoding") {
      if (value != "base64" && value != "float")
        reject(400, "invalid_request",
               fmt::format("\"encoding\" must be \"base64\" or \"float\", not {}", quote_for_error(value)));
      r.as_base64 = value == "base64";
    } else if (key == "return_deepstack") {
      if (!value.is_boolean()) reject(400, "invalid_request", "\"return_deepstack\" must be true or false");
      r.deepstack = value.get<bool>();
    } else if (key == "return_embeddings") {
      if (!value.is_boolean()) reject(400, "invalid_request", "\"return_embeddings\" must be true or false");
      r.return_embeddings = value.get<bool>() ? 1 : 0;
    } else if (key == "model") {
      if (value != model)
        reject(404, "model_not_found",
               fmt::format("model {} is not served here; this server serves \"{}\"", quote_for_error(value), model));
    } else {
      reject(400, "invalid_request",
             fmt::format(
                 "unknown field {} (accepted: images, videos, encoding, return_deepstack, return_embeddings, model)",
                 quote_for_error(std::string_view(key))));
    }
  }
  size_t items = 0;
  for (const char* key : {"images", "videos"}) {
    const auto a = doc.find(key);
    if (a == doc.end()) continue;
    if (!a->is_array())
      reject(400, "invalid_request",
             fmt::format("\"{}\" must be an array of data URLs, base64 strings or content parts", key));
    items += a->size();
  }
  if (items == 0)
    reject(400, "invalid_request",
           "the body needs a non-empty \"images\" or \"videos\" array of data URLs, base64 strings or image_url / "
           "video_url content parts");
  if (items > max_images)
    reject(400, "too_many_images",
           fmt::format("{} images and videos in one request; the limit is {} (--max-images-per-request)", items,
                       max_images));
  for (const char* key : {"images", "videos"}) {
    const auto a = doc.find(key);
    if (a == doc.end()) continue;
    const ItemKind kind = std::string_view(key) == "videos" ? ItemKind::VIDEO : ItemKind::ANY;
    for (size_t i = 0; i < a->size(); ++i) add_item(r, (*a)[i], fmt::format("{}[{}]", key, i), kind, lifted);
  }
  return r;
}

namespace {

// A body's top-level fields fovea cannot honour, and why: refused by name.
const char* refused_field(std::string_view key) {
  if (key == "ec_transfer_params")
    return "push-based encoder-cache connectors (Mooncake's consumer_zmq) are not supported: fovea writes the shared "
           "folder that vLLM's ECExampleConnector reads";
  return nullptr;
}

// The fields vLLM's EPD proxy forwards beside the messages (PR #56786): the kwargs must be objects
// (or null), priority an integer, session_id a string (or null). Whether the kwargs can be honoured
// is apply_mm_kwargs' to say.
void check_forwarded(const std::string& key, const json& value) {
  const bool kwargs = key == "mm_processor_kwargs" || key == "media_io_kwargs";
  if (kwargs && !value.is_null() && !value.is_object())
    reject(400, "invalid_request", fmt::format("\"{}\" must be an object (or null), not {}", key, value.type_name()));
  if (key == "priority" && !value.is_null() && !value.is_number_integer())
    reject(400, "invalid_request", fmt::format("\"priority\" must be an integer, not {}", value.type_name()));
  if (key == "session_id" && !value.is_null() && !value.is_string())
    reject(400, "invalid_request", fmt::format("\"session_id\" must be a string, not {}", value.type_name()));
}

// The request's kwargs in the order it gives their keys (vLLM hashes them in that order), parsed again
// from the same text when they say anything: the first parse keeps keys sorted.
MmKwargs ordered_kwargs(const json& doc, std::string_view body, const Lifted& lifted, size_t max_elements) {
  MmKwargs k;
  const auto present = [&](const char* key) {
    const auto v = doc.find(key);
    return v != doc.end() && v->is_object() && !v->empty();
  };
  if (!present("mm_processor_kwargs") && !present("media_io_kwargs")) return k;
  JsonLimits lim;
  lim.max_bytes = body.size();
  lim.max_depth = 8;
  lim.max_elements = max_elements;
  lim.max_object_keys = 64;
  lim.max_string_bytes = body.size();
  nlohmann::ordered_json again;
  try {
    again = parse_json_bounded_ordered(lifted.parts.empty() ? body : std::string_view(lifted.skeleton), lim,
                                       "the request body");
  } catch (const Error& e) {  // not reached: the same text passed the same limits
    reject(400, "invalid_json", e.what());
  }
  if (present("mm_processor_kwargs")) k.processor = std::move(again["mm_processor_kwargs"]);
  if (present("media_io_kwargs")) k.media_io = std::move(again["media_io_kwargs"]);
  return k;
}

// One message's content parts into r: image_url and video_url parts become items, text parts are
// skipped, anything else is refused naming it.
void add_message_parts(EncodeRequest& r, json& content, const std::string& where, const Lifted& lifted) {
  if (content.is_string() || content.is_null()) return;  // text only
  if (!content.is_array()) reject(400, "invalid_request", where + " must be a string or an array of content parts");
  for (size_t k = 0; k < content.size(); ++k) {
    json& part = content[k];
    const std::string at = fmt::format("{}[{}]", where, k);
    const auto type = part.is_object() ? part.find("type") : part.end();
    const std::string t = part.is_object() && type != part.end() && type->is_string() ? type->get<std::string>() : "";
    if (t == "text") continue;
    if (t != "image_url" && t != "video_url")
      reject(
          400, "invalid_request",
          fmt::format("{}: a content part of type {} (accepted: text, image_url, video_url)", at, quote_for_error(t)));
    add_item(r, part, at, t == "video_url" ? ItemKind::VIDEO : ItemKind::IMAGE, lifted);
  }
}

}  // namespace

EncodeRequest parse_chat_request(std::string_view body, size_t max_images, const std::string& model) {
  // Messages nest two levels deeper than /v1/encode's items (6: messages, a message, its content, a
  // part, its image_url, the url), and carry text and a client's other fields.
  const Lifted lifted = lift_long_strings(body);
  json doc = parse_body(body, lifted, 256 + 8 * max_images, 64);
  if (!doc.is_object()) reject(400, "invalid_request", "the body must be a JSON object with a \"messages\" array");
  for (auto& [key, value] : doc.items()) {
    if (const char* why = refused_field(key)) reject(400, "unsupported_field", fmt::format("\"{}\": {}", key, why));
    check_forwarded(key, value);
    if (key == "stream" && value != false)
      reject(400, "unsupported_field",
             "\"stream\": an encode instance answers once, when the files are written; send "
             "\"stream\": false (vLLM's EPD proxy does)");
    if (key == "model" && !value.is_null() && value != model)
      reject(404, "model_not_found",
             fmt::format("model {} is not served here; this server serves \"{}\"", quote_for_error(value), model));
  }
  const auto messages = doc.find("messages");
  if (messages == doc.end() || !messages->is_array() || messages->empty())
    reject(400, "invalid_request", "the body needs a non-empty \"messages\" array");
  EncodeRequest r;
  r.return_embeddings = 0;
  r.kwargs = ordered_kwargs(doc, body, lifted, 256 + 8 * max_images);
  for (size_t m = 0; m < messages->size(); ++m) {
    json& msg = (*messages)[m];
    const std::string where = fmt::format("messages[{}]", m);
    if (!msg.is_object()) reject(400, "invalid_request", where + " must be an object {\"role\", \"content\"}");
    const auto content = msg.find("content");
    if (content != msg.end()) add_message_parts(r, *content, where + ".content", lifted);
    if (r.items.size() > max_images)
      reject(400, "too_many_images",
             fmt::format("more than {} images in one request (--max-images-per-request)", max_images));
  }
  if (r.items.empty())
    reject(400, "invalid_request", "the messages hold no image_url or video_url part: nothing to encode");
  return r;
}

const char* invalid_item_code(InputKind k) { return k == InputKind::VIDEO ? "invalid_video" : "invalid_image"; }

std::vector<InputKind> settle_kinds(const EncodeRequest& r) {
  std::vector<InputKind> kinds(r.items.size());
  for (size_t i = 0; i < kinds.size(); ++i) {
    const RequestItem& it = r.items[i];
    const std::string& b64 = it.payload;
    std::vector<uint8_t> head;
    if (!it.remote_url.empty()) {  // read already
      const std::vector<uint8_t>& bytes = it.fetched;
      head.assign(bytes.begin(), bytes.begin() + std::min<size_t>(bytes.size(), 384));
    } else {
      try {  // 512 characters are 384 bytes, past every magic number input_kind reads
        head = base64_decode(std::string_view(b64).substr(0, std::min<size_t>(b64.size(), 512) & ~size_t(3)), it.name);
      } catch (const Error&) {  // whitespace inside, or bad base64: decoding the item will say which
        kinds[i] = it.kind == ItemKind::VIDEO ? InputKind::VIDEO : InputKind::IMAGE;
        continue;
      }
    }
    kinds[i] = input_kind(head);
    if (it.kind == ItemKind::VIDEO && kinds[i] != InputKind::VIDEO)
      reject(
          400, "invalid_video",
          fmt::format("{}: a video_url item that is not a clip fovea reads (MP4/MOV, WebM/MKV, AVI, MPEG-TS, FLV, Ogg)",
                      it.name));
    if (it.kind == ItemKind::IMAGE && kinds[i] == InputKind::VIDEO)
      reject(400, "invalid_image",
             fmt::format("{}: an image_url item holding a video clip; send it as a video_url part", it.name));
  }
  return kinds;
}

}  // namespace fovea::server
