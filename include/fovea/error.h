// fovea/error.h: the one exception type fovea's library code throws, and check macros.
// Library code never exits: it throws fovea::Error with a message a user can act on; only the CLI
// turns errors into exit codes.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

#if !defined(__CUDACC__)  // nvcc 13 cannot compile fmt 9's consteval checks: CUDA sources use fail_cat
#include <fmt/format.h>
#endif

namespace fovea {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Throw fovea::Error with the arguments streamed one after another (usable in CUDA sources).
template <class... Args>
[[noreturn]] void fail_cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  throw Error(s.str());
}

#if !defined(__CUDACC__)
// Throw fovea::Error with a fmt-formatted message.
template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}
#endif

// Warnings go through one sink so tests and the server can capture them (default: stderr).
using WarningSink = void (*)(const std::string&);
void set_warning_sink(WarningSink sink);
void warn(const std::string& message);

}  // namespace fovea

// FOVEA_CHECK(cond, message parts...): throw fovea::Error naming file and line when cond is false.
#define FOVEA_CHECK(cond, ...)                                                                                   \
  do {                                                                                                           \
    if (!(cond)) ::fovea::fail_cat(__VA_ARGS__, " (", __FILE__, ":", __LINE__, ": check '", #cond, "' failed)"); \
  } while (0)
