// fovea/lists.h: the items of a separated list in a flag's value ("HD,4K", "0,1", "128,256").
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fovea {

// The items between separators, in order: "" has none, "a" one, "a,,b" and "a," have empty items
// (the caller rejects them as it rejects any other item it does not know).
std::vector<std::string> split_list(std::string_view list, char sep = ',');

// A whole decimal int: optional '-', digits, nothing else (no spaces, no '+'), within int's range.
std::optional<int> parse_int(std::string_view s);

// A non-empty list of ints each at least `min`, or fovea::Error "<what>: '<item>' is not an integer
// >= <min>" (or "<what>: empty list"); `what` names the flag.
std::vector<int> parse_int_list(std::string_view list, std::string_view what, int min, char sep = ',');

}  // namespace fovea
