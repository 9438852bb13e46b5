// Warning sink shared by the library (stderr unless a caller installs its own).
#include "fovea/error.h"

#include <atomic>
#include <cstdio>

namespace fovea {
namespace {
void stderr_sink(const std::string& message) { std::fprintf(stderr, "fovea: warning: %s\n", message.c_str()); }
std::atomic<WarningSink> g_sink{stderr_sink};
}  // namespace

void set_warning_sink(WarningSink sink) { g_sink.store(sink ? sink : stderr_sink); }
void warn(const std::string& message) { g_sink.load()(message); }

}  // namespace fovea
