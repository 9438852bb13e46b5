// fovea/image.h: image files to the encoder's pixel rows, as transformers' Qwen3-VL image processor
// (torchvision backend) does it (docs/encoder.md §Decoding to §Patchify): decode (JPEG: libjpeg-turbo, PNG: libpng, GIF
// first frame: giflib, WebP first frame: libwebp, BMP: fovea's own; src/image/decode*.cpp), RGB conversion,
// smart_resize, antialiased bicubic resize on uint8, rescale + normalize, patchify in merge-window
// order. Every bad input is a fovea::Error naming the file.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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
  int64_t min_pixels = 65536,
          max_pixels = 16777216;  // hub preprocessor_config.json (docs/encoder.md §Preprocessing config)
  float mean[3] = {0.5f, 0.5f, 0.5f};
  float std[3] = {0.5f, 0.5f, 0.5f};
  // Decompression-bomb guard: an image whose header claims more pixels is refused before any pixel
  // is decoded. 0: auto, image_pixel_limit() below.
  int64_t max_image_pixels = 0;
};

// Command-line overrides of a model's preprocessing (0: keep the model's value).
struct PreprocessOverrides {
  int64_t min_pixels = 0, max_pixels = 0;  // --min-pixels, --max-pixels
  int64_t max_image_pixels = 0;            // --max-image-pixels (0: auto, image_pixel_limit())
};

// The preprocessing of a model: its folder's preprocessor_config.json, or the shipped Qwen3-VL
// defaults when the model is synthetic:<preset> or the file is absent; then the overrides. A budget
// whose max is below its min is an error naming the flags. The result is checked against the
// model's own config (check_against_model) whenever that config can be read (a folder's
// config.json or a synthetic preset), so every command that serves or encodes checks it.
PreprocessConfig load_preprocess_config(const std::string& model, const PreprocessOverrides& overrides = {});

// preprocessor_config.json's text (`where` names the file in messages), parsed with the config
// limits (qwen3vl::config_json_limits()) and every field checked: patch_size 1..64, merge_size
// 1..8, temporal_patch_size 1..4, min_pixels/max_pixels (or size.shortest_edge/longest_edge)
// integers in 1..kMaxPixelBudget with min <= max, image_mean 3 finite numbers in [-1e6, 1e6],
// image_std 3 finite numbers in [1e-6, 1e6] (a 0 would turn every pixel into inf/NaN).
constexpr int64_t kMaxPixelBudget = int64_t(1) << 28;  // 16384 x 16384
PreprocessConfig parse_preprocess_config(std::string_view text, const std::string& where);

// A file of a model's folder (its path) when the model is a folder that has it; nullopt otherwise
// (synthetic:<preset>, or the file absent).
std::optional<std::string> model_folder_file(const std::string& model, const char* name);
// The model's vision config when it can be read without its weights: a folder's config.json, or a
// synthetic preset; nullopt when neither (load_model then says why).
std::optional<qwen3vl::VisionConfig> readable_model_config(const std::string& model);

// Preprocessing that this model can take: patch_size, merge_size and temporal_patch_size equal the
// model's (patch 14 against a model of 16 would fail every request), and the model takes RGB
// (in_channels 3). Throws fovea::Error naming both values and where each came from.
void check_against_model(const PreprocessConfig& p, const std::string& p_where, const qwen3vl::VisionConfig& model);

// The image files (.jpg .jpeg .png .webp .bmp .gif, any case) of a folder, sorted; throws if the folder
// does not exist or has none. `what` names the flag in the error.
std::vector<std::string> list_images(const std::string& folder, const std::string& what);

// ---- decoding (src/image/decode*.cpp) --------------------------------------------------------------
//
// Memory is bounded before a pixel is decoded: probe() reads the header and refuses an image over
// the pixel guard; decode_peak_bytes() says what decoding and preprocessing it will hold at peak, so
// a server can reserve that much first (fovea serve: probe -> decode_peak_bytes -> reserve ->
// decode_memory -> preprocess -> release). decode_memory() runs probe() itself.

enum class ImageFormat { JPEG, PNG, GIF, WEBP, BMP };
const char* format_name(ImageFormat f);  // "JPEG", "PNG", "GIF", "WebP", "BMP"

// The encoded input's size limit: 512 MiB, twice an uncompressed RGBA BMP at the auto pixel guard
// (67 MP x 4 bytes); fovea serve's --max-body-bytes binds long before.
constexpr size_t kMaxEncodedImageBytes = size_t(512) << 20;

// The pixel guard in force: cfg.max_image_pixels, or when that is 0 (auto, the default),
// 4 x max(cfg.max_pixels, 4096^2). The resize budget sets it: at the shipped budget (16.7 MP) the
// guard is 67 MP, which takes 8K frames (7680x4320 = 33 MP) and 48-MP phone photographs (8064x6048)
// and refuses a 16384x16384 header (268 MP; a 780 KB PNG of that size would otherwise peak at
// 1.6 GB). Decoding costs memory per input pixel whatever the budget, so a smaller --max-pixels
// (the demo's 262144) keeps the 67-MP floor, and a larger budget raises the guard with it.
int64_t image_pixel_limit(const PreprocessConfig& cfg);

// What probe() reads from a header.
struct ImageInfo {
  std::string name;  // for error messages
  ImageFormat format = ImageFormat::PNG;
  int width = 0, height = 0;  // the decoded image's (a GIF's or animated WebP's canvas)
  int64_t decoder_bytes = 0;  // the decoder's own buffers at peak, beside the RGB image (an estimate)
};

// Reads only the header (a GIF's up to its first image descriptor): format, size and the decoder's
// buffers. Throws fovea::Error "image '<name>': ..." for an unknown format, a bad header, an empty
// size, more than kMaxEncodedImageBytes, or more pixels than image_pixel_limit(cfg) ("exceeds the
// limit ... (--max-image-pixels)").
ImageInfo probe(std::span<const uint8_t> bytes, const std::string& name, const PreprocessConfig& cfg = {});

// An upper bound of the bytes that decoding this image and preprocessing it with `cfg` hold at
// peak: the decoder's buffers, the RGB image, the resize intermediates and the float patches (not
// the encoded bytes, which the caller holds). Measured (src/image/decode.cpp says how).
int64_t decode_peak_bytes(const ImageInfo& info, const PreprocessConfig& cfg);

// Decodes an image file (or bytes) to RGB as transformers' processor sees it (PIL's convert("RGB")):
// grey is replicated, palette expanded, alpha dropped (not composited), a GIF's transparent pixels
// take their palette colour; the first frame of a GIF or animated WebP, on its canvas as Pillow
// composes it. Errors name the image: "image 'x.jpg': not a JPEG, PNG, WebP, BMP or GIF image",
// "image 'x.jpg': corrupt JPEG: <libjpeg's message>", "... truncated PNG: ...". A truncated file
// is an error (as in Pillow, by default).
Rgb8 decode_file(const std::string& path, const PreprocessConfig& cfg = {});
Rgb8 decode_memory(std::span<const uint8_t> bytes, const std::string& name, const PreprocessConfig& cfg = {});

// docs/encoder.md §smart_resize (Python's round-half-to-even included). Throws for aspect ratios above 200.
std::pair<int, int> smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels);
// What preprocess() makes of an image of height x width under `cfg`: the size smart_resize gives it
// (factor patch * merge, the config's budget), and its patches' grid {1, h / patch, w / patch}, known
// from a header alone.
std::pair<int, int> resized_size(int height, int width, const PreprocessConfig& cfg);
qwen3vl::GridThw resized_grid(int height, int width, const PreprocessConfig& cfg);

// Antialiased bicubic resize of a uint8 image to (out_h, out_w): separable (horizontal pass, then
// vertical), Keys cubic with a = -0.5, support 2 x scale when shrinking, int16 fixed-point weights and
// a uint8-rounded intermediate, as torch's uint8 path (under torchvision's resize) computes it.
Rgb8 resize_bicubic(const Rgb8& in, int out_h, int out_w);

struct Patches {
  std::vector<float>
      pixels;  // [t*h*w, 3*temporal*patch*patch], merge-window row order (docs/encoder.md §Merge-window order)
  qwen3vl::GridThw grid;
  // The compact form patchify_raw() gives instead of `pixels`: the uint8 samples [t*h*w, 3*patch*patch]
  // (columns c, py, px of the one frame), same row order; rescale, normalize and the temporal
  // copies are left to whoever uploads them (the GPU encoder does them on the device, normalize_raw()
  // on the host), with the same float32 arithmetic as patchify.
  std::vector<uint8_t> raw;
  struct Normalization {  // raw only: what patchify would have applied
    float mean[3] = {}, std[3] = {};
    int temporal = 0;
  } norm;
};

// Rescale (1/255), normalize, duplicate the frame temporally, patchify. The image must already be
// a multiple of patch * merge on each side.
Patches patchify(const Rgb8& img, const PreprocessConfig& cfg);

// The same rows as patchify, as uint8 samples in Patches::raw (an eighth of the bytes).
Patches patchify_raw(const Rgb8& img, const PreprocessConfig& cfg);
// patchify's values from patchify_raw's: `pixels` filled bit for bit as patchify would, `raw` kept.
void normalize_raw(Patches& p);

// smart_resize -> resize -> patchify (raw = true: patchify_raw); errors name img.name when it is set.
Patches preprocess(const Rgb8& img, const PreprocessConfig& cfg, bool raw = false);

}  // namespace fovea::image
