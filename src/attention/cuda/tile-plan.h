// How many consumer warpgroups (64 query rows each) the flash kernel's CTAs get for one batch: plain
// C++ (no CUDA), so the CPU tests check the choice.
//
// With one CTA per SM, a batch takes as long as the SM that finishes last. 192-row tiles (3
// warpgroups, FP8 at head_dim <= 80) do more work per SM-second than 128-row ones, but make fewer,
// longer CTAs: a single 1024-token image is 6 x 16 = 96 CTAs of 192 rows on 132 SMs, or 128 of 128.
// The plan simulates both launches (CTAs in launch order, each to the SM that frees first) and takes
// the shorter. Setting FOVEA_FLASH_WARPGROUPS=2 or 3 in the environment forces one (for A/B runs).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <queue>
#include <vector>

namespace fovea::cuda {

// Measured per-row throughput of 3 consumer warpgroups over 2 (H200, FP8 hd 72, S 32640, where both
// fill the machine: 622 against 539 TFLOP/s with 21 and 31 waves, 2026-12-02; docs/kernels.md).
constexpr double kThreeWarpgroupRowRate = 1.17;
constexpr double kCtaOverheadBlocks = 1.0;  // prologue, Q load and epilogue, in KV-block units

// Predicted time of a launch whose CTAs (for each of `heads` heads, the segments' tiles) have
// `rows` query rows each: segment lengths `lens`, 128-key blocks.
inline double predicted_flash_time(const std::vector<int>& lens, int heads, int rows, int sms) {
  const double rate = rows == 192 ? kThreeWarpgroupRowRate : 1.0;
  std::vector<double> costs;  // one head's CTAs, longest segments first (the launch order)
  std::vector<int> sorted = lens;
  std::sort(sorted.begin(), sorted.end(), std::greater<int>());
  for (int len : sorted) {
    const double blocks = double((len + 127) / 128) + kCtaOverheadBlocks;
    for (int m = 0; m * rows < len; ++m) costs.push_back(blocks * rows / rate);
  }
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int s = 0; s < sms; ++s) free_at.push(0.0);
  double end = 0;
  for (int h = 0; h < heads; ++h)
    for (double c : costs) {
      const double t = free_at.top() + c;
      free_at.pop();
      free_at.push(t);
      end = std::max(end, t);
    }
  return end;
}

// 2 or 3 (max_consumers 3 means 192-row tiles are built for this dtype and head_dim).
inline int choose_consumer_warpgroups(const std::vector<int>& lens, int heads, int max_consumers, int sms) {
  if (max_consumers < 3) return 2;
  if (const char* forced = std::getenv("FOVEA_FLASH_WARPGROUPS")) {
    if (forced[0] == '2' && !forced[1]) return 2;
    if (forced[0] == '3' && !forced[1]) return 3;
  }
  return predicted_flash_time(lens, heads, 192, sms) < predicted_flash_time(lens, heads, 128, sms) ? 3 : 2;
}

}  // namespace fovea::cuda
