// fovea/image.h: image files to the encoder's pixel rows, as transformers' Qwen3-VL image processor
// (torchvision backend) does it (spec §2): decode (stb: JPEG, PNG, BMP, GIF first frame), RGB
// conversion, smart_resize, antialiased bicubic resize on uint8, rescale + normalize, patchify in
// merge-window order. Every bad input is a fovea::Error naming the file.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fovea/model.h"

namespace fovea::image {

struct Rgb8 {
  int width = 0, height = 0;
  std::vector<uint8_t> data;  // height x width x 3, row-major
  std::string name;           // the file (or request part) it came from, for error messages
};

struct PreprocessConfig {
  int patch = 16, merge = 2, temporal = 2;
  int64_t min_pixels = 65536, max_pixels = 16777216;  // hub preprocessor_config.json (spec §2.1)
  float mean[3] = {0.5f, 0.5f, 0.5f};
  float std[3] = {0.5f, 0.5f, 0.5f};
  int64_t max_image_pixels = int64_t(1) << 28;  // decompression-bomb guard: header pixels above this are refused
};

// Command-line overrides of a model's preprocessing (0: keep the model's value).
struct PreprocessOverrides {
  int64_t min_pixels = 0, max_pixels = 0;      // --min-pixels, --max-pixels
  int64_t max_image_pixels = int64_t(1) << 28;  // --max-image-pixels
};

// The preprocessing of a model: its folder's preprocessor_config.json, or the shipped Qwen3-VL
// defaults when the model is synthetic:<preset> or the file is absent; then the overrides. A budget
// whose max is below its min is an error naming the flags.
PreprocessConfig load_preprocess_config(const std::string& model, const PreprocessOverrides& overrides = {});

// The image files (.jpg .jpeg .png .bmp .gif, any case) of a folder, sorted; throws if the folder
// does not exist or has none. `what` names the flag in the error.
std::vector<std::string> list_images(const std::string& folder, const std::string& what);

// Decodes an image file (or bytes) to RGB as transformers' processor sees it (PIL's convert("RGB")):
// grey is replicated, palette expanded, alpha dropped (not composited), a GIF's transparent pixels
// take their palette colour. `name` is used in error messages.
Rgb8 decode_file(const std::string& path, const PreprocessConfig& cfg = {});
Rgb8 decode_memory(const std::vector<uint8_t>& bytes, const std::string& name, const PreprocessConfig& cfg = {});

// Spec §2.2 (Python's round-half-to-even included). Throws for aspect ratios above 200.
std::pair<int, int> smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels);

// Antialiased bicubic resize of a uint8 image to (out_h, out_w): separable (horizontal pass, then
// vertical), Keys cubic with a = -0.5, support 2 x scale when shrinking, int16 fixed-point weights and
// a uint8-rounded intermediate, as torch's uint8 path (under torchvision's resize) computes it.
Rgb8 resize_bicubic(const Rgb8& in, int out_h, int out_w);

struct Patches {
  std::vector<float> pixels;  // [t*h*w, 3*temporal*patch*patch], merge-window row order (spec §2.5)
  qwen3vl::GridThw grid;
};

// Rescale (1/255), normalize, duplicate the frame temporally, patchify. The image must already be
// a multiple of patch * merge on each side.
Patches patchify(const Rgb8& img, const PreprocessConfig& cfg);

// smart_resize -> resize -> patchify; errors name img.name when it is set.
Patches preprocess(const Rgb8& img, const PreprocessConfig& cfg);

}  // namespace fovea::image
