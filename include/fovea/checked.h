// fovea/checked.h: size arithmetic on numbers that come from files or clients (shapes, image sizes,
// token counts), checked: an overflow is a fovea::Error naming what was being computed, never
// signed-overflow UB or a wrapped size that then allocates or indexes wrongly.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fovea/error.h"

namespace fovea {

namespace detail {
[[noreturn]] inline void overflow(const char* what, auto a, const char* op, auto b, size_t bits, bool is_signed) {
  fail_cat(what, ": ", +a, op, +b, " overflows a ", bits, "-bit ", is_signed ? "signed" : "unsigned", " integer");
}
}  // namespace detail

// a * b, or fovea::Error "<what>: a x b overflows <type>".
template <class T>
T checked_mul(T a, T b, const char* what) {
  static_assert(std::is_integral_v<T>, "checked_mul is for integers");
  T r;
  if (__builtin_mul_overflow(a, b, &r)) detail::overflow(what, a, " x ", b, sizeof(T) * 8, std::is_signed_v<T>);
  return r;
}

// a + b, or fovea::Error "<what>: a + b overflows <type>".
template <class T>
T checked_add(T a, T b, const char* what) {
  static_assert(std::is_integral_v<T>, "checked_add is for integers");
  T r;
  if (__builtin_add_overflow(a, b, &r)) detail::overflow(what, a, " + ", b, sizeof(T) * 8, std::is_signed_v<T>);
  return r;
}

// The product of a shape's dimensions (1 for a scalar); every dimension must be >= 0.
inline int64_t checked_numel(const std::vector<int64_t>& shape, const char* what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) fail_cat(what, ": negative dimension ", d);
    n = checked_mul<int64_t>(n, d, what);
  }
  return n;
}

}  // namespace fovea
