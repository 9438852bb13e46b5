// fovea/json.h: JSON from untrusted bytes (HTTP request bodies, config.json, preprocessor_config.json,
// scale files, safetensors headers). The limits are checked while the text is scanned (nlohmann's
// SAX interface), before any value is built, so a hostile document costs time linear in its length
// and memory bounded by the limits; nesting depth never turns into recursion (the DOM is built with
// an explicit stack, and is never deeper than max_depth).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fovea {

struct JsonLimits {
  size_t max_bytes = size_t(1) << 20;         // length of the text
  int max_depth = 32;                         // nesting of arrays/objects (the top level is depth 1)
  size_t max_elements = size_t(1) << 16;      // values of any kind, in total (keys not counted)
  size_t max_object_keys = 1024;              // keys per object
  size_t max_string_bytes = size_t(1) << 20;  // bytes per string (keys included)
};

// Parses `text` into a DOM (nlohmann::json: object keys sorted in a std::map, so lookups are
// logarithmic). Throws fovea::Error:
//   "<what> is not valid JSON: parse error at line L, column C, byte B: <nlohmann's explanation>"
//   "<what> is not valid JSON: number overflow at line L, column C, byte B (at /a/b): ..." (1e999)
//   "<what>: key 'k' appears twice in 'parent' (line L, column C, byte B)"
//   "<what>: <limit> ... (line L, column C, byte B, at /a/b)"  (each message names the limit)
//   "<what>: N bytes, longer than the limit of M bytes"
// (B is the 0-based offset of the byte the error was found at; /a/b the path of keys and [index]es.)
// Client text in a message (keys, tokens, the location path) is quoted only truncated.
nlohmann::json parse_json_bounded(std::string_view text, const JsonLimits& limits, const std::string& what);
// The same, object keys kept in the order the text gives them (nlohmann::ordered_json: lookups are
// linear), for values whose order means something: vLLM hashes request kwargs in their order.
nlohmann::ordered_json parse_json_bounded_ordered(std::string_view text, const JsonLimits& limits,
                                                  const std::string& what);

// Client or file text for an error message: at most max_chars characters of it (then "..."), with
// quotes, backslashes, control characters and invalid UTF-8 escaped (\n, \xNN), no quotes added.
std::string escape_for_error(std::string_view text, size_t max_chars = 64);
// The same inside double quotes.
std::string quote_for_error(std::string_view text, size_t max_chars = 64);
// (std::string and char* would otherwise be ambiguous between text and a JSON string value.)
inline std::string quote_for_error(const std::string& text, size_t max_chars = 64) {
  return quote_for_error(std::string_view(text), max_chars);
}
inline std::string quote_for_error(const char* text, size_t max_chars = 64) {
  return quote_for_error(std::string_view(text), max_chars);
}
// A JSON value for an error message: its compact JSON text (strings in their JSON quotes, no more
// added), cut after max_chars characters with "..." and escaped the same way. Never recursive on
// deep values: the value is rendered iteratively and only up to max_chars.
std::string quote_for_error(const nlohmann::json& value, size_t max_chars = 64);

}  // namespace fovea
