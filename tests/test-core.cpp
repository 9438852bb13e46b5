// The core room's small helpers: separated lists in flag values (fovea/lists.h) and elapsed time
// (fovea/clock.h).
#include <climits>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fovea/clock.h"
#include "fovea/lists.h"
#include "test-util.h"

using namespace fovea;
using namespace fovea::test;

namespace {

using Items = std::vector<std::string>;

TEST(SplitList, KeepsEveryItemEmptyOnesIncluded) {
  EXPECT_EQ(split_list(""), Items{});
  EXPECT_EQ(split_list("HD"), Items{"HD"});
  EXPECT_EQ(split_list("HD,FullHD,4K"), (Items{"HD", "FullHD", "4K"}));
  EXPECT_EQ(split_list("a,,b"), (Items{"a", "", "b"}));
  EXPECT_EQ(split_list("a,"), (Items{"a", ""}));
  EXPECT_EQ(split_list(","), (Items{"", ""}));
  EXPECT_EQ(split_list(" a , b"), (Items{" a ", " b"}));  // spaces are the caller's to refuse
  EXPECT_EQ(split_list("a:b,c", ':'), (Items{"a", "b,c"}));
}

TEST(ParseInt, WholeDecimalIntsOnly) {
  EXPECT_EQ(parse_int("0"), 0);
  EXPECT_EQ(parse_int("42"), 42);
  EXPECT_EQ(parse_int("-7"), -7);
  EXPECT_EQ(parse_int(std::to_string(INT_MAX)), INT_MAX);
  EXPECT_EQ(parse_int(std::to_string(INT_MIN)), INT_MIN);
  for (const char* bad : {"", "+1", " 1", "1 ", "1x", "x", "0x10", "1.5", "-", "2147483648", "-2147483649"})
    EXPECT_FALSE(parse_int(bad).has_value()) << "'" << bad << "'";
}

TEST(ParseIntList, ValuesAtLeastMinOrAnErrorNamingTheFlagAndItem) {
  EXPECT_EQ(parse_int_list("1024", "--seqlens", 1), std::vector<int>{1024});
  EXPECT_EQ(parse_int_list("1,7,64", "--seqlens", 1), (std::vector<int>{1, 7, 64}));
  EXPECT_EQ(parse_int_list("0,3", "--devices", 0), (std::vector<int>{0, 3}));
  EXPECT_EQ(parse_int_list("4;5", "--x", 1, ';'), (std::vector<int>{4, 5}));
  EXPECT_EQ(error_of([] { parse_int_list("8,0", "--seqlens", 1); }), "--seqlens: '0' is not an integer >= 1");
  EXPECT_EQ(error_of([] { parse_int_list("8,,8", "--seqlens", 1); }), "--seqlens: '' is not an integer >= 1");
  EXPECT_EQ(error_of([] { parse_int_list("3,x", "--seqlens", 1); }), "--seqlens: 'x' is not an integer >= 1");
  EXPECT_EQ(error_of([] { parse_int_list("-1", "--devices", 0); }), "--devices: '-1' is not an integer >= 0");
  EXPECT_EQ(error_of([] { parse_int_list("", "--devices", 0); }), "--devices: empty list");
}

TEST(Clock, DifferencesInMillisecondsAndSeconds) {
  const Clock::time_point a = Clock::now();
  const Clock::time_point b = a + std::chrono::milliseconds(1500);
  EXPECT_DOUBLE_EQ(ms_between(a, b), 1500.0);
  EXPECT_DOUBLE_EQ(seconds_between(a, b), 1.5);
  EXPECT_DOUBLE_EQ(ms_between(b, a), -1500.0);
  EXPECT_DOUBLE_EQ(seconds_between(b, a), -1.5);
  EXPECT_EQ(from_seconds(1.5), std::chrono::milliseconds(1500));
  EXPECT_EQ(from_seconds(0.25e-3), std::chrono::microseconds(250));
  EXPECT_DOUBLE_EQ(seconds_between(a, a + from_seconds(2.75)), 2.75);
  const Clock::time_point t = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double ms = ms_since(t), s = seconds_since(t);
  EXPECT_GE(ms, 20.0);
  EXPECT_GE(s, 0.020);
  EXPECT_GE(s * 1000, ms);  // read after ms_since
  EXPECT_LT(ms, 20000.0 * kTimeScale);
}

}  // namespace
