// Preprocessing conformance with transformers' Qwen3-VL image processor (issue #5): fovea decodes and
// preprocesses each image of a golden set made by tools/make-processor-golden.py and must give the
// same grid_thw and the same pixel values, within a tolerance in uint8 levels (one level = 1/127.5
// after normalization).
//
// The golden sets: tests/data/processor (synthetic images of odd sizes and modes, committed; CI) and
// data/processor-photos (mate-backgrounds photographs, never committed; made on a machine with
// transformers, run with the `photos` label). FOVEA_PROCESSOR_GOLDEN=DIR points the photo test at
// another folder; FOVEA_ROOT at another checkout (where the case files' paths are relative to).
//
// Tolerance: none. Every level must be equal, for every format, measured as such:
// - lossless formats (PNG, BMP, GIF; RGB, L, LA, RGBA, P with and without transparency): the decoded
//   pixels agree and the resize reproduces torch's uint8 integer arithmetic operation for operation
//   (2026-11-29: max 0 on all 10 synthetic cases and 2 RGBA photographs).
// - JPEG: decoded with libjpeg-turbo, Pillow's decoder family, with Pillow's parameters (ISLOW IDCT,
//   fancy upsampling), so the pixels agree too. Measured 2026-12-01 (Debian's libjpeg-turbo 2.1.5
//   against Pillow 12.3.0's bundled 3.1.4.1, transformers 5.17): max 0 levels on the 3 synthetic
//   JPEGs (baseline, progressive, greyscale) and on the photographs (4 JPEGs downscaled to 200704
//   pixels, and Elephants 3840x2160 at the shipped budget, 50M values). With stb_image, before:
//   max 11, mean 0.19 levels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "fovea/image.h"
#include "fovea/io.h"
#include "fovea/safetensors.h"

using namespace fovea;
namespace fs = std::filesystem;

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

struct Diff {
  int max = 0;
  double mean = 0;
  size_t values = 0;
};

// Runs every case of DIR/cases.json against DIR/golden.safetensors and checks the tolerances.
void check_golden_set(const std::string& dir) {
  const std::string root = env_or("FOVEA_ROOT", FOVEA_SOURCE_DIR);
  const auto doc = nlohmann::json::parse(read_file(dir + "/cases.json", "golden cases"));
  const Checkpoint golden = Checkpoint::open(dir + "/golden.safetensors");
  std::printf("golden set %s (%s, transformers %s)\n", dir.c_str(), doc["processor"].get<std::string>().c_str(),
              doc["transformers"].get<std::string>().c_str());
  ASSERT_FALSE(doc["cases"].empty());
  for (const auto& c : doc["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    image::PreprocessConfig cfg;
    cfg.min_pixels = c["min_pixels"];
    cfg.max_pixels = c["max_pixels"];
    const image::Rgb8 img = image::decode_file((fs::path(root) / c["file"].get<std::string>()).string(), cfg);
    const image::Patches got = image::preprocess(img, cfg);
    const TensorInfo* g = golden.find(name + ".grid_thw");
    const TensorInfo* px = golden.find(name + ".pixels");
    ASSERT_TRUE(g && px) << "golden file lacks " << name;
    const auto grid = g->to_float();
    ASSERT_EQ(grid.size(), 3u);
    EXPECT_EQ(got.grid[0], int(grid[0]));
    EXPECT_EQ(got.grid[1], int(grid[1]));
    EXPECT_EQ(got.grid[2], int(grid[2]));
    const auto want = px->to_float();  // uint8 levels
    ASSERT_EQ(got.pixels.size(), want.size());
    Diff d;
    double sum = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got.pixels[i])) << "row " << i / 1536;
      const double level = double(got.pixels[i]) * 127.5 + 127.5;
      const double err = std::fabs(level - want[i]);
      ASSERT_LT(std::fabs(level - std::round(level)), 1e-3) << "fovea's value is not a uint8 level at " << i;
      // An equal level must give the transformers float value bit for bit: (u - 127.5) / 127.5 in fp32.
      if (err == 0) {
        ASSERT_EQ(got.pixels[i], (float(want[i]) - 127.5f) / 127.5f) << i;
      }
      d.max = std::max(d.max, int(std::lround(err)));
      sum += err;
    }
    d.values = want.size();
    d.mean = sum / double(want.size());
    std::printf("  %-36s %-5s grid (%d, %d, %d)  max |diff| %3d levels  mean %.4f levels  (%zu values)\n", name.c_str(),
                c["mode"].get<std::string>().c_str(), got.grid[0], got.grid[1], got.grid[2], d.max, d.mean, d.values);
    EXPECT_EQ(d.max, 0) << (c["lossless"].get<bool>() ? "lossless image" : "JPEG") << ": levels must be identical";
  }
}

}  // namespace

TEST(ProcessorGolden, SyntheticImages) {
  check_golden_set(env_or("FOVEA_ROOT", FOVEA_SOURCE_DIR) + "/tests/data/processor");
}

TEST(ProcessorGolden, Photos) {
  const std::string dir = env_or("FOVEA_PROCESSOR_GOLDEN", std::string(FOVEA_SOURCE_DIR) + "/data/processor-photos");
  ASSERT_TRUE(fs::exists(dir + "/cases.json"))
      << dir
      << " has no golden set: run tools/fetch-photos.sh, then tools/make-processor-golden.py --photos data/photos "
      << "where transformers is installed";
  check_golden_set(dir);
  if (fs::exists(dir + "/full/cases.json")) check_golden_set(dir + "/full");
}
