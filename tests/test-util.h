// Helpers shared by the test suites (CPU and GPU): fresh seeds, a scratch folder per test,
// error-message assertions, and the models several suites run.
#pragma once
#include <errno.h>  // program_invocation_short_name (GNU)

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fovea/error.h"
#include "fovea/model.h"

#ifndef FOVEA_TEST_TIME_SCALE
#define FOVEA_TEST_TIME_SCALE 1
#endif
#ifndef FOVEA_TEST_SANITIZED
#define FOVEA_TEST_SANITIZED 0
#endif

namespace fovea::test {

// The factor on every timing window of a test (a deadline provoked on purpose, a bound on polling):
// 1, and 8 in sanitizer builds (FOVEA_SANITIZE, set by CMake), whose code runs 7-16x slower.
constexpr int kTimeScale = FOVEA_TEST_TIME_SCALE;
// True in the ASan + UBSan build, whose allocator adds redzones and holds freed blocks in quarantine:
// there a process's peak RSS says nothing about the program's own buffers.
constexpr bool kSanitized = FOVEA_TEST_SANITIZED;
// How much a busy machine stretches wall time: the 1-minute load average over the CPUs, at least 1
// (CI machines are shared; the suite must pass beside a parallel build). Read at each call.
inline double busy_factor() {
  double load = 0;
  std::ifstream f("/proc/loadavg");
  if (!(f >> load)) return 1.0;
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  return std::max(1.0, load / cpus);
}
// A duration in seconds for a command-line flag (--request-timeout), times kTimeScale and, outside the
// sanitizer build, the busy factor: a test whose deadline must fall between two amounts of work (a
// request decoded before it, its forwards outlasting it) keeps their ratio however busy the machine is
// when it starts. The sanitizer build keeps its fixed factor: there the forwards' margin over the
// deadline is narrow (about 1.2x) and its own parallel jobs raise the load without slowing a forward
// as much.
inline std::string scaled_seconds(double s) {
  std::ostringstream out;
  out << s * kTimeScale * (kSanitized ? 1.0 : busy_factor());
  return out.str();
}

// Fresh random inputs every run: a seed from std::random_device, printed so a failure can be replayed.
inline uint64_t fresh_seed() {
  const uint64_t s = std::random_device{}();
  std::printf("[seed %llu]\n", (unsigned long long)s);
  return s;
}

// A scratch folder for one test (unique per test binary and test), removed afterwards.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
    path = std::filesystem::path(FOVEA_TEST_TMP) /
           (std::string(program_invocation_short_name) + "." + t->test_suite_name() + "." + t->name());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return file(name);
  }
  std::vector<std::string> list() const {  // every entry, hidden ones (temp files) included
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

// A whole file's bytes ("" if it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The message of the fovea::Error that f throws; a test failure if it throws nothing or something else.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-fovea exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

// Warnings captured through fovea::set_warning_sink into g_warnings while one is alive.
inline std::vector<std::string> g_warnings;
struct CaptureWarnings {
  CaptureWarnings() {
    g_warnings.clear();
    set_warning_sink([](const std::string& w) { g_warnings.push_back(w); });
  }
  ~CaptureWarnings() { set_warning_sink(nullptr); }
  CaptureWarnings(const CaptureWarnings&) = delete;
  CaptureWarnings& operator=(const CaptureWarnings&) = delete;
};

// The 8B architecture's shapes (hd 72, intermediate 4304, 4096-wide mergers) cut to two blocks, both
// deepstack taps, synthetic weights: the preset synthetic:qwen3-vl-8b-2blocks.
inline qwen3vl::Model two_block_8b() { return qwen3vl::load_model("synthetic:qwen3-vl-8b-2blocks"); }

// `m` with outlier channels put into every block's qkv (docs/fp8.md §Outlier channels): per head, Q
// and K channel `qk_channel` offset by 30 and V channel 5 scaled by 30 (weights and bias). A Q/K
// channel on the slowest RoPE frequency (hd/4 - 1 rotates with the row, hd/2 - 1 with the column)
// keeps its offset nearly unchanged through rotation.
inline qwen3vl::Model with_outlier_channels(qwen3vl::Model m, int qk_channel) {
  const int H = m.config.heads, hd = m.config.head_dim(), D = m.config.hidden;
  for (qwen3vl::Block& b : m.weights.blocks)
    for (int h = 0; h < H; ++h) {
      const int qk = h * hd + qk_channel, v = 2 * D + h * hd + 5;
      b.qkv.b[size_t(qk)] += 30.f;      // Q
      b.qkv.b[size_t(D + qk)] += 30.f;  // K
      for (int i = 0; i < b.qkv.in; ++i) b.qkv.w[size_t(v) * b.qkv.in + i] *= 30.f;
      b.qkv.b[size_t(v)] *= 30.f;
    }
  return m;
}

}  // namespace fovea::test

#define EXPECT_HAS(msg, sub) \
  EXPECT_NE(std::string(msg).find(sub), std::string::npos) << "message: " << (msg) << "\nlacks: " << (sub)
