// Runtime head_dim -> compile-time kernel instantiation, over the one list in fovea/attention.h.
#pragma once
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "fovea/attention.h"
#include "fovea/error.h"

namespace fovea::cuda {

[[noreturn]] inline void fail_head_dim(int head_dim) {
  std::string built;
  for (int d : kFlashHeadDims) built += (built.empty() ? "" : ", ") + std::to_string(d);
  fail_cat("FOVEA attention: head_dim ", head_dim, " is not supported (built for ", built, ")");
}

// Calls f(std::integral_constant<int, D>{}) for the D of kFlashHeadDims equal to head_dim; throws
// fovea::Error naming head_dim and the list when there is none.
template <size_t I = 0, class F>
auto dispatch_head_dim(int head_dim, F&& f) {
  constexpr int D = kFlashHeadDims[I];
  if (head_dim == D) return f(std::integral_constant<int, D>{});
  if constexpr (I + 1 < std::size(kFlashHeadDims))
    return dispatch_head_dim<I + 1>(head_dim, std::forward<F>(f));
  else
    fail_head_dim(head_dim);
}

}  // namespace fovea::cuda
