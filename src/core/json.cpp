// Bounded JSON parsing: nlohmann's SAX parser (an iterative state machine) drives a handler that
// checks every limit as the text is scanned and builds the DOM with an explicit stack of open
// containers, so neither the scan nor the build recurses and nothing past a limit is ever built.
#include "fovea/json.h"

#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "fovea/error.h"

namespace fovea {

using json = nlohmann::json;

// ---- quoting client text ---------------------------------------------------------------------------

namespace {

// Length of the valid UTF-8 sequence at s[i] (1-4), or 0 if the bytes there are not one
// (overlong forms, surrogates and code points above U+10FFFF included).
size_t utf8_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return uint8_t(s[i + k]); };
  const uint8_t c = b(0);
  if (c < 0x80) return 1;
  size_t n = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(1) < lo || b(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return n;
}

// Appends at most `budget` characters of `text`, escaped; returns how many characters were used
// and whether all of `text` fit.
std::pair<size_t, bool> append_escaped(std::string& out, std::string_view text, size_t budget) {
  size_t used = 0, i = 0;
  while (i < text.size()) {
    if (used == budget) return {used, false};
    const unsigned char c = uint8_t(text[i]);
    size_t n = utf8_length(text, i);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (n == 0 || c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02x}", c);
      n = 1;
    } else {
      out.append(text.substr(i, n));
    }
    i += n == 0 ? 1 : n;
    ++used;
  }
  return {used, true};
}

}  // namespace

std::string escape_for_error(std::string_view text, size_t max_chars) {
  std::string out;
  if (!append_escaped(out, text, max_chars).second) out += "...";
  return out;
}

std::string quote_for_error(std::string_view text, size_t max_chars) {
  std::string out = "\"";
  if (!append_escaped(out, text, max_chars).second) out += "...";
  out += '"';
  return out;
}

std::string quote_for_error(const json& value, size_t max_chars) {
  // Compact JSON text, written iteratively: a stack of the containers open, each with its next
  // element. Stops as soon as max_chars characters are out, so a deep or huge value costs
  // O(max_chars) however large it is.
  struct Frame {
    const json* v;
    json::const_iterator it;
    bool first = true;
  };
  std::string out;
  size_t used = 0;  // characters written (an escape counts once)
  bool cut = false;
  auto put = [&](std::string_view s, bool escape) {
    if (cut) return;
    if (escape) {
      const auto [n, all] = append_escaped(out, s, max_chars - used);
      used += n;
      cut = !all;
      return;
    }
    for (char c : s) {
      if (used == max_chars) {
        cut = true;
        return;
      }
      out += c;
      ++used;
    }
  };
  auto scalar = [&](const json& v) {
    if (v.is_string()) {
      put("\"", false);
      put(v.get_ref<const std::string&>(), true);
      put("\"", false);
    } else if (v.is_binary()) {
      put("<binary>", false);
    } else {
      put(v.dump(), false);  // null, bool, number: short
    }
  };
  std::vector<Frame> stack;
  auto open = [&](const json& v) {
    if (v.is_object() || v.is_array()) {
      put(v.is_object() ? "{" : "[", false);
      stack.push_back({&v, v.cbegin()});
    } else {
      scalar(v);
    }
  };
  open(value);
  while (!stack.empty() && !cut) {
    Frame& f = stack.back();
    if (f.it == f.v->cend()) {
      put(f.v->is_object() ? "}" : "]", false);
      stack.pop_back();
      continue;
    }
    if (!f.first) put(",", false);
    f.first = false;
    const json::const_iterator it = f.it++;
    if (f.v->is_object()) {
      put("\"", false);
      put(it.key(), true);
      put("\":", false);
    }
    open(*it);  // may invalidate f
  }
  if (cut) out += "...";
  return out;
}

// ---- the bounded parser ----------------------------------------------------------------------------

namespace {

// A char iterator over the text that records how far nlohmann's lexer has read, so errors found in
// the handler (which nlohmann gives no position) can still name a line and column.
class TrackingIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackingIterator(const char* p, const char* base, size_t* read) : p_(p), base_(base), read_(read) {}
  reference operator*() const { return *p_; }
  TrackingIterator& operator++() {
    ++p_;
    *read_ = size_t(p_ - base_);
    return *this;
  }
  TrackingIterator operator++(int) {
    TrackingIterator old = *this;
    ++*this;
    return old;
  }
  bool operator==(const TrackingIterator& o) const { return p_ == o.p_; }
  bool operator!=(const TrackingIterator& o) const { return p_ != o.p_; }

 private:
  const char* p_;
  const char* base_;
  size_t* read_;
};

template <class J>
class BoundedHandler {
 public:
  BoundedHandler(const JsonLimits& limits, const size_t* read) : limits_(limits), read_(read) {}

  J root;
  std::string error;    // set when the parse was stopped; the message without "<what>"
  bool syntax = false;  // the error is nlohmann's (the text is not valid JSON)
  size_t error_at = 0;  // byte offset the error refers to

  bool null() { return value(J(nullptr)); }
  bool boolean(bool b) { return value(J(b)); }
  bool number_integer(typename J::number_integer_t v) { return value(J(v)); }
  bool number_unsigned(typename J::number_unsigned_t v) { return value(J(v)); }
  bool number_float(typename J::number_float_t v, const std::string&) { return value(J(v)); }
  bool string(std::string& s) {
    if (!check_string(s, "a string")) return false;
    return value(J(std::move(s)));
  }
  bool binary(typename J::binary_t&) { return stop("binary values are not JSON"); }

  bool start_object(size_t) { return open(J::object()); }
  bool start_array(size_t) { return open(J::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    Frame& f = stack_.back();
    if (++f.count > limits_.max_object_keys)
      return stop(fmt::format("an object has more than {} keys (the limit)", limits_.max_object_keys));
    if (!check_string(k, "a key")) return false;
    const auto& obj = f.container->template get_ref<const typename J::object_t&>();
    if (obj.find(k) != obj.end()) {
      const std::string where = stack_.size() < 2
                                    ? std::string("the top-level object")
                                    : "'" + escape_for_error(stack_[stack_.size() - 2].label(false)) + "'";
      return stop(fmt::format("key '{}' appears twice in {}", escape_for_error(k), where), false);
    }
    f.key = std::move(k);
    return true;
  }

  bool parse_error(size_t position, const std::string& last_token, const nlohmann::detail::exception& e) {
    syntax = true;
    error_at = position;
    if (e.id == 406) {  // out_of_range: a number beyond double, e.g. 1e999
      error = fmt::format("number overflow at {}{}: {} does not fit a double", line_col(position), at_path(),
                          quote_for_error(last_token, 40));
      return false;
    }
    // nlohmann's text: "[J.exception.parse_error.101] parse error at line 1, column 5: syntax
    // error while parsing value - invalid literal; last read: '...'". The last token can be a whole
    // client string, so only the explanation is kept, cut.
    std::string what = e.what();
    if (const auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    if (const auto p = what.find(": "); p != std::string::npos && what.rfind("parse error", 0) == 0)
      what = what.substr(p + 2);
    error = fmt::format("parse error at {}: {}", line_col(position), escape_for_error(what, 160));
    return false;
  }

  void set_text(std::string_view text) { text_ = text; }
  std::string line_col(size_t byte) const {
    size_t line = 1, col = 1;
    // The position is one past the last byte read: report that byte.
    const size_t end = byte == 0 ? 0 : std::min(byte - 1, text_.size());
    for (size_t i = 0; i < end; ++i) {
      if (text_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return fmt::format("line {}, column {}, byte {}", line, col, end);
  }

 private:
  struct Frame {
    J* container;
    std::string key;   // objects: the key whose value comes next
    size_t count = 0;  // keys (objects) or elements (arrays) so far
    // This container's part of a path: the current key, or the index of the current element
    // (placed already, unless this is the innermost container and the element is being read).
    std::string label(bool innermost) const {
      if (container->is_object()) return key;
      return "[" + std::to_string(innermost || count == 0 ? count : count - 1) + "]";
    }
  };
  const JsonLimits& limits_;
  const size_t* read_;
  std::string_view text_;
  std::vector<Frame> stack_;
  size_t elements_ = 0;

  // "/a/b/[3]": the location in the document, each part cut, the middle of a deep path elided.
  std::string path() const {
    std::string p;
    const size_t n = stack_.size();
    for (size_t i = 0; i < n; ++i) {
      if (n > 8 && i == 3) {
        p += fmt::format("/...({} more)", n - 7);
        i = n - 5;
        continue;
      }
      p += "/" + escape_for_error(stack_[i].label(i + 1 == n), 32);
    }
    return p;
  }
  std::string at_path() const { return stack_.empty() ? std::string() : " (at " + path() + ")"; }

  bool stop(const std::string& message, bool with_path = true) {
    error_at = *read_;
    error = fmt::format("{} ({}{})", message, line_col(error_at),
                        with_path && !stack_.empty() ? ", at " + path() : std::string());
    return false;
  }

  bool check_string(const std::string& s, const char* kind) {
    if (s.size() > limits_.max_string_bytes)
      return stop(
          fmt::format("{} of {} bytes is longer than the limit of {} bytes", kind, s.size(), limits_.max_string_bytes));
    return true;
  }

  // Counts a value and checks the element limit; returns where a new value goes (nullptr: the root).
  bool count_value() {
    if (++elements_ > limits_.max_elements)
      return stop(fmt::format("more than {} values in the document (the limit)", limits_.max_elements));
    return true;
  }

  J* place(J&& v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    Frame& f = stack_.back();
    if (f.container->is_object()) {
      auto& obj = f.container->template get_ref<typename J::object_t&>();
      return &obj.emplace(f.key, std::move(v)).first->second;  // a copy: path() still names it
    }
    auto& arr = f.container->template get_ref<typename J::array_t&>();
    ++f.count;
    arr.push_back(std::move(v));
    return &arr.back();
  }

  bool value(J&& v) {
    if (!count_value()) return false;
    place(std::move(v));
    return true;
  }

  bool open(J&& empty) {
    if (!count_value()) return false;
    if (stack_.size() + 1 > size_t(limits_.max_depth))
      return stop(fmt::format("nesting deeper than {} levels (the limit)", limits_.max_depth));
    // Pointers stay valid: a map node never moves, and an array's buffer only grows (moving its
    // elements) once the element open inside it has been closed and popped.
    J* c = place(std::move(empty));
    stack_.push_back({c, {}, 0});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }
};

}  // namespace

namespace {

template <class J>
J parse_bounded(std::string_view text, const JsonLimits& limits, const std::string& what) {
  if (text.size() > limits.max_bytes)
    fail("{}: {} bytes, longer than the limit of {} bytes", what, text.size(), limits.max_bytes);
  size_t read = 0;
  BoundedHandler<J> h(limits, &read);
  h.set_text(text);
  const char* b = text.data();
  const bool ok = J::sax_parse(TrackingIterator(b, b, &read), TrackingIterator(b + text.size(), b, &read), &h);
  if (!ok) {
    if (h.error.empty()) fail("{}: parse stopped", what);  // not reached: every stop sets a message
    if (h.syntax) fail("{} is not valid JSON: {}", what, h.error);
    fail("{}: {}", what, h.error);
  }
  return std::move(h.root);
}

}  // namespace

json parse_json_bounded(std::string_view text, const JsonLimits& limits, const std::string& what) {
  return parse_bounded<json>(text, limits, what);
}

nlohmann::ordered_json parse_json_bounded_ordered(std::string_view text, const JsonLimits& limits,
                                                  const std::string& what) {
  return parse_bounded<nlohmann::ordered_json>(text, limits, what);
}

}  // namespace fovea
