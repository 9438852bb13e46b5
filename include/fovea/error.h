// fovea/error.h: the one exception type fovea's library code throws, and check macros.
// Library code never exits: it throws fovea::Error with a message a user can act on; only the CLI
// turns errors into exit codes.
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace fovea {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Throw fovea::Error with a fmt-formatted message.
template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

// Warnings go through one sink so tests and the server can capture them (default: stderr).
using WarningSink = void (*)(const std::string&);
void set_warning_sink(WarningSink sink);
void warn(const std::string& message);

}  // namespace fovea

// FOVEA_CHECK(cond, "fmt", args...): throw fovea::Error naming file and line when cond is false.
#define FOVEA_CHECK(cond, ...)                                                              \
  do {                                                                                      \
    if (!(cond))                                                                            \
      ::fovea::fail("{} ({}:{}: check '{}' failed)", fmt::format(__VA_ARGS__), __FILE__, \
                    __LINE__, #cond);                                                       \
  } while (0)
