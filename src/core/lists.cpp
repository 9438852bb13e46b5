#include "fovea/lists.h"

#include <charconv>

#include "fovea/error.h"

namespace fovea {

std::vector<std::string> split_list(std::string_view list, char sep) {
  std::vector<std::string> out;
  if (list.empty()) return out;
  for (size_t at = 0;;) {
    const size_t end = list.find(sep, at);
    out.emplace_back(list.substr(at, end == std::string_view::npos ? std::string_view::npos : end - at));
    if (end == std::string_view::npos) return out;
    at = end + 1;
  }
}

std::optional<int> parse_int(std::string_view s) {
  if (s.empty()) return std::nullopt;
  int v = 0;
  const char* end = s.data() + s.size();
  const auto [stop, ec] = std::from_chars(s.data(), end, v);
  if (ec != std::errc() || stop != end) return std::nullopt;
  return v;
}

std::vector<int> parse_int_list(std::string_view list, std::string_view what, int min, char sep) {
  std::vector<int> out;
  for (const std::string& item : split_list(list, sep)) {
    const std::optional<int> v = parse_int(item);
    if (!v || *v < min) fail("{}: '{}' is not an integer >= {}", what, item, min);
    out.push_back(*v);
  }
  if (out.empty()) fail("{}: empty list", what);
  return out;
}

}  // namespace fovea
