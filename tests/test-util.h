// Helpers shared by the CPU test suites: a scratch folder per test, and error-message assertions.
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
#include <vector>

#include <gtest/gtest.h>

#include "fovea/error.h"

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
// A duration in seconds for a command-line flag (--request-timeout), times kTimeScale: "0.5" or "2".
inline std::string scaled_seconds(double s) {
  std::ostringstream out;
  out << s * kTimeScale;
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

}  // namespace fovea::test

#define EXPECT_HAS(msg, sub) \
  EXPECT_NE(std::string(msg).find(sub), std::string::npos) << "message: " << (msg) << "\nlacks: " << (sub)
