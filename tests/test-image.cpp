// Image decoding and preprocessing (docs/encoder.md §Decoding to §Patchify): smart_resize's rounding, the patch layout,
// the antialiased bicubic resize, RGB conversion as Pillow's convert("RGB") gives it for every format and layout fovea
// reads, the pixel guard and the memory bound read from the header, and every bad input named in its error. Test images
// are written with the libraries fovea decodes with (tests/image-encode.h), or by hand where a layout needs it.
#include <malloc.h>
#include <sys/wait.h>

#include <gtest/gtest.h>
#include <webp/decode.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "fovea/bf16.h"
#include "fovea/image.h"
#include "fovea/safetensors.h"
#include "fovea/scales.h"

#include <nlohmann/json.hpp>
#include "image-encode.h"
#include "test-util.h"

using namespace fovea;
using namespace fovea::image;
using namespace fovea::test;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<uint8_t>;

Rgb8 gradient(int w, int h) {
  Rgb8 img{w, h, std::vector<uint8_t>(size_t(w) * h * 3), ""};
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = img.data.data() + (size_t(y) * w + x) * 3;
      p[0] = uint8_t(x * 255 / std::max(1, w - 1));
      p[1] = uint8_t(y * 255 / std::max(1, h - 1));
      p[2] = uint8_t((x + y) % 256);
    }
  return img;
}

// A gradient with noise: neither flat (which every codec keeps) nor pure noise.
Rgb8 textured(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  Rgb8 img = gradient(w, h);
  for (auto& v : img.data) v = uint8_t(std::clamp(int(v) + int(rng() % 41) - 20, 0, 255));
  return img;
}

Bytes noise(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes v(n);
  for (auto& x : v) x = uint8_t(rng());
  return v;
}

std::string as_string(const Bytes& b) { return std::string(b.begin(), b.end()); }
Bytes first(const Bytes& b, size_t n) { return Bytes(b.begin(), b.begin() + long(std::min(n, b.size()))); }

int max_diff(const Bytes& a, const Bytes& b) {
  EXPECT_EQ(a.size(), b.size());
  int worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(int(a[i]) - int(b[i])));
  return worst;
}

// Pillow's MULDIV255 and cmyk2rgb on the stored CMYK values of an Adobe ("CMYK;I") JPEG.
int pillow_cmyk_channel(int stored_c, int stored_k) {
  const int t = (255 - stored_c) * stored_k + 128;
  return stored_k - (((t >> 8) + t) >> 8);
}

}  // namespace

TEST(SmartResize, MatchesTransformersOnTheSpecTable) {
  // docs/encoder.md §smart_resize (shipped defaults: factor 32, min 65536, max 16777216): half-to-even rounding
  // matters.
  EXPECT_EQ(smart_resize(720, 1280, 32, 65536, 16777216), std::make_pair(704, 1280));  // 22.5 -> 22
  EXPECT_EQ(smart_resize(1080, 1920, 32, 65536, 16777216), std::make_pair(1088, 1920));
  EXPECT_EQ(smart_resize(1440, 2560, 32, 65536, 16777216), std::make_pair(1440, 2560));
  EXPECT_EQ(smart_resize(2160, 3840, 32, 65536, 16777216), std::make_pair(2176, 3840));  // 67.5 -> 68
  // The README budget (longest 1280*32*32, shortest 256*32*32): every input from 1080p lands on 832x1504.
  EXPECT_EQ(smart_resize(1080, 1920, 32, 262144, 1310720), std::make_pair(832, 1504));
  EXPECT_EQ(smart_resize(2160, 3840, 32, 262144, 1310720), std::make_pair(832, 1504));
  // Below min_pixels: scale up from the original size, ceil to the factor.
  const double beta = std::sqrt(65536.0 / (20 * 30));
  EXPECT_EQ(smart_resize(20, 30, 32, 65536, 16777216),
            std::make_pair(int(std::ceil(20 * beta / 32)) * 32, int(std::ceil(30 * beta / 32)) * 32));
  EXPECT_HAS(error_of([] { smart_resize(10, 2010, 32, 65536, 16777216); }), "over 200:1");
}

TEST(Patchify, RowsAndColumnsFollowTheSpecLayout) {
  const Rgb8 img = gradient(96, 64);  // grid 4 x 6
  const Patches p = patchify(img, {});
  ASSERT_EQ(p.grid, (qwen3vl::GridThw{1, 4, 6}));
  ASSERT_EQ(p.pixels.size(), size_t(24) * 1536);
  const int Bw = 3;
  for (int bh : {0, 1})
    for (int bw : {0, 2})
      for (int mh : {0, 1})
        for (int mw : {0, 1}) {
          const int r = ((bh * Bw + bw) * 2 + mh) * 2 + mw;  // docs/encoder.md §Merge-window order
          for (int ch : {0, 2})
            for (int t : {0, 1})
              for (int py : {0, 7, 15})
                for (int px : {0, 9, 15}) {
                  const int c = ch * 512 + t * 256 + py * 16 + px;
                  const int y = (2 * bh + mh) * 16 + py, x = (2 * bw + mw) * 16 + px;
                  const float want = (float(img.data[(size_t(y) * 96 + x) * 3 + ch]) - 127.5f) /
                                     127.5f;  // docs/encoder.md §Normalization
                  ASSERT_EQ(p.pixels[size_t(r) * 1536 + c], want) << r << "," << c;
                }
        }
  EXPECT_HAS(error_of([&] { patchify(gradient(90, 64), {}); }), "multiple of 32");
}

// The compact form: patchify_raw keeps the uint8 samples (an eighth of the bytes), and
// normalize_raw makes patchify's exact values from them, for non-default mean / std, T = 1 and 2,
// random pixels; a non-raw Patches is refused.
TEST(Patchify, RawPatchesNormalizeToPatchifyBitForBit) {
  std::mt19937 rng(fresh_seed());
  for (int T : {1, 2}) {
    Rgb8 img{160, 96, std::vector<uint8_t>(size_t(160) * 96 * 3), "random"};
    for (auto& v : img.data) v = uint8_t(rng() & 255);
    PreprocessConfig cfg;
    cfg.temporal = T;
    cfg.mean[0] = 0.48145466f, cfg.mean[1] = 0.4578275f, cfg.mean[2] = 0.40821073f;
    cfg.std[0] = 0.26862954f, cfg.std[1] = 0.26130258f, cfg.std[2] = 0.27577711f;
    const Patches want = patchify(img, cfg);
    Patches raw = patchify_raw(img, cfg);
    EXPECT_TRUE(raw.pixels.empty());
    ASSERT_EQ(raw.grid, want.grid);
    ASSERT_EQ(raw.raw.size() * T, want.pixels.size());
    normalize_raw(raw);
    ASSERT_EQ(raw.pixels.size(), want.pixels.size());
    EXPECT_EQ(std::memcmp(raw.pixels.data(), want.pixels.data(), want.pixels.size() * 4), 0) << "T = " << T;
    Patches via = preprocess(img, cfg, /*raw=*/true);  // resized first (up to min_pixels)
    normalize_raw(via);
    EXPECT_EQ(via.pixels, preprocess(img, cfg).pixels);
  }
  Patches not_raw = patchify(gradient(64, 64), {});
  EXPECT_HAS(error_of([&] { normalize_raw(not_raw); }), "not raw patches");
}

TEST(Resize, ConstantStaysConstantAndIdentityIsExact) {
  Rgb8 flat{50, 40, std::vector<uint8_t>(50 * 40 * 3, 173), ""};
  for (auto [h, w] : {std::pair{13, 17}, std::pair{96, 128}, std::pair{40, 50}}) {
    const Rgb8 r = resize_bicubic(flat, h, w);
    ASSERT_EQ(r.data.size(), size_t(h) * w * 3);
    for (uint8_t v : r.data) ASSERT_EQ(v, 173) << h << "x" << w;
  }
  const Rgb8 g = gradient(64, 48);
  EXPECT_EQ(resize_bicubic(g, 48, 64).data, g.data);
}

// Against a plain double-precision separable implementation of the same filter: the fixed-point
// passes (with their uint8 intermediate) stay within 1 level.
TEST(Resize, AgreesWithAFloatReference) {
  std::mt19937 rng(5);
  Rgb8 img{37, 29, std::vector<uint8_t>(37 * 29 * 3), ""};
  for (auto& v : img.data) v = uint8_t(rng() % 256);
  auto cubic = [](double x) {
    x = std::fabs(x);
    return x < 1 ? (1.5 * x - 2.5) * x * x + 1 : x < 2 ? ((-0.5 * x + 2.5) * x - 4) * x + 2 : 0.0;
  };
  auto pass = [&](const std::vector<double>& in, int in_n, int out_n, int other, bool horizontal) {
    std::vector<double> out(size_t(out_n) * other * 3);
    const double scale = double(in_n) / out_n, fs = std::max(scale, 1.0), support = 2 * fs;
    for (int o = 0; o < out_n; ++o) {
      const double center = (o + 0.5) * scale;
      const int lo = std::max(0, int(center - support + 0.5)), hi = std::min(in_n, int(center + support + 0.5));
      double sum = 0;
      for (int i = lo; i < hi; ++i) sum += cubic((i - center + 0.5) / fs);
      for (int k = 0; k < other; ++k)
        for (int c = 0; c < 3; ++c) {
          double acc = 0;
          for (int i = lo; i < hi; ++i) {
            const size_t src = horizontal ? (size_t(k) * in_n + i) * 3 + c : (size_t(i) * other + k) * 3 + c;
            acc += in[src] * cubic((i - center + 0.5) / fs) / sum;
          }
          out[horizontal ? (size_t(k) * out_n + o) * 3 + c : (size_t(o) * other + k) * 3 + c] =
              std::min(255.0, std::max(0.0, std::round(acc)));
        }
    }
    return out;
  };
  for (auto [oh, ow] : {std::pair{13, 11}, std::pair{64, 80}, std::pair{29, 9}}) {
    std::vector<double> in(img.data.begin(), img.data.end());
    const auto ref = pass(pass(in, 37, ow, 29, true), 29, oh, ow, false);
    const Rgb8 got = resize_bicubic(img, oh, ow);
    int worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::abs(int(got.data[i]) - int(ref[i])));
    EXPECT_LE(worst, 1) << oh << "x" << ow;
  }
}

TEST(Decode, FormatsAndRgbConversion) {
  TempDir dir;
  const Rgb8 g = textured(20, 12, 1);
  const std::vector<std::pair<const char*, Bytes>> lossless = {
      {"png", encode_png_rgb(20, 12, g.data)},
      {"bmp", encode_bmp_rgb(20, 12, g.data)},
      {"webp", encode_webp_lossless(20, 12, 3, g.data)},
  };
  for (const auto& [kind, bytes] : lossless) {
    const Rgb8 d = decode_memory(bytes, kind);
    EXPECT_EQ(d.width, 20) << kind;
    EXPECT_EQ(d.height, 12) << kind;
    EXPECT_EQ(d.data, g.data) << kind;  // lossless: exactly the pixels
    EXPECT_EQ(d.name, kind);
  }
  const Rgb8 j = decode_memory(encode_jpeg_rgb(20, 12, g.data, 95), "jpg");
  EXPECT_LT(max_diff(j.data, g.data), 40);  // lossy, but the same picture
  // Grey replicated to RGB; alpha dropped, as transformers' convert("RGB") does (tests/data/processor).
  const Rgb8 grey = decode_memory(encode_png(2, 1, PNG_COLOR_TYPE_GRAY, 8, {10, 200}), "grey");
  EXPECT_EQ(grey.data, (Bytes{10, 10, 10, 200, 200, 200}));
  const Rgb8 rgba =
      decode_memory(encode_png(3, 1, PNG_COLOR_TYPE_RGB_ALPHA, 8, {0, 0, 0, 0, 0, 0, 0, 255, 100, 50, 0, 128}), "rgba");
  EXPECT_EQ(rgba.data, (Bytes{0, 0, 0, 0, 0, 0, 100, 50, 0}));
  // From a file.
  const std::string path = dir.write("a.png", as_string(encode_png_rgb(20, 12, g.data)));
  EXPECT_EQ(decode_file(path).data, g.data);
  EXPECT_EQ(decode_file(path).name, path);
}

// Every PNG colour type and bit depth, against Pillow's mode for it and convert("RGB")
// (decode-png.cpp has the table): low-bit grey scaled, 16-bit grey clipped, 16-bit colour's high
// byte, palette through PLTE with black past it, alpha and tRNS dropped; Adam7 decodes the same.
TEST(Decode, PngEveryColourTypeAndDepthAsPillow) {
  auto rgb = [](const Bytes& png) { return decode_memory(png, "t.png").data; };
  auto grey3 = [](std::initializer_list<int> v) {
    Bytes out;
    for (int x : v) out.insert(out.end(), 3, uint8_t(x));
    return out;
  };
  EXPECT_EQ(rgb(encode_png(4, 1, PNG_COLOR_TYPE_GRAY, 1, {0, 1, 1, 0})), grey3({0, 255, 255, 0}));
  EXPECT_EQ(rgb(encode_png(4, 1, PNG_COLOR_TYPE_GRAY, 2, {0, 1, 2, 3})), grey3({0, 85, 170, 255}));
  EXPECT_EQ(rgb(encode_png(3, 1, PNG_COLOR_TYPE_GRAY, 4, {0, 1, 15})), grey3({0, 17, 255}));
  // 16-bit grey is Pillow's "I;16": convert("RGB") clips to 255 rather than taking the high byte.
  EXPECT_EQ(rgb(encode_png(4, 1, PNG_COLOR_TYPE_GRAY, 16, {0x00, 0x00, 0x00, 0xC8, 0x01, 0x00, 0xFF, 0xFF})),
            grey3({0, 200, 255, 255}));
  EXPECT_EQ(rgb(encode_png(2, 1, PNG_COLOR_TYPE_GRAY, 8, {7, 9}, false, {}, {0, 7})), grey3({7, 9}));  // tRNS ignored
  EXPECT_EQ(rgb(encode_png(2, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 8, {30, 0, 40, 255})), grey3({30, 40}));
  EXPECT_EQ(rgb(encode_png(2, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 16, {0x12, 0x34, 0, 0, 0xAB, 0xCD, 0xFF, 0xFF})),
            grey3({0x12, 0xAB}));
  EXPECT_EQ(rgb(encode_png(1, 1, PNG_COLOR_TYPE_RGB, 16, {0xAB, 0x01, 0xCD, 0x02, 0xEF, 0x03})),
            (Bytes{0xAB, 0xCD, 0xEF}));
  EXPECT_EQ(rgb(encode_png(1, 1, PNG_COLOR_TYPE_RGB_ALPHA, 16, {0x10, 0xFF, 0x20, 0xFF, 0x30, 0xFF, 0x00, 0x00})),
            (Bytes{0x10, 0x20, 0x30}));
  // Palette: 3 PLTE entries, tRNS on two of them; index 3 is past PLTE (black, as Pillow's palette).
  const Bytes plte = {200, 10, 20, 30, 40, 50, 60, 70, 80};
  EXPECT_EQ(rgb(encode_png(4, 1, PNG_COLOR_TYPE_PALETTE, 2, {0, 1, 2, 3}, false, plte, {0, 128})),
            (Bytes{200, 10, 20, 30, 40, 50, 60, 70, 80, 0, 0, 0}));
  EXPECT_EQ(rgb(encode_png(2, 1, PNG_COLOR_TYPE_PALETTE, 8, {2, 0}, false, plte)), (Bytes{60, 70, 80, 200, 10, 20}));
  // Adam7 gives the same pixels: 8-bit RGB (read straight into the image), 16-bit RGBA and palette
  // (read whole, then converted).
  const Rgb8 t = textured(37, 23, 2);
  EXPECT_EQ(rgb(encode_png(37, 23, PNG_COLOR_TYPE_RGB, 8, t.data, true)), t.data);
  Bytes rgba16;
  for (size_t i = 0; i < t.data.size(); i += 3)
    for (size_t c = 0; c < 4; ++c) rgba16.push_back(c < 3 ? t.data[i + c] : 0x80), rgba16.push_back(uint8_t(i + c));
  EXPECT_EQ(rgb(encode_png(37, 23, PNG_COLOR_TYPE_RGB_ALPHA, 16, rgba16, true)), t.data);
  EXPECT_EQ(rgb(encode_png(37, 23, PNG_COLOR_TYPE_RGB_ALPHA, 16, rgba16, false)), t.data);
  Bytes idx = noise(37 * 23, 3), plte256 = noise(256 * 3, 4), want;
  for (uint8_t i : idx) want.insert(want.end(), plte256.begin() + 3 * i, plte256.begin() + 3 * i + 3);
  EXPECT_EQ(rgb(encode_png(37, 23, PNG_COLOR_TYPE_PALETTE, 8, idx, true, plte256)), want);
}

// JPEG through libjpeg-turbo with Pillow's parameters. The pixel-exact check against Pillow is the
// processor golden test (tests/test-processor-golden.cpp); here: flat colours come back, progressive
// gives the same pixels as baseline (the same coefficients, reordered), grey is replicated, CMYK and
// YCCK follow Pillow's "CMYK;I" + cmyk2rgb, and two-component files are refused as Pillow refuses them.
TEST(Decode, JpegAsPillowDecodesIt) {
  const Bytes flat = [] {
    Bytes v;
    for (int i = 0; i < 16 * 16; ++i) v.insert(v.end(), {70, 130, 220});
    return v;
  }();
  EXPECT_LE(max_diff(decode_memory(encode_jpeg(16, 16, 3, flat, 100), "flat.jpg").data, flat), 1);
  const Rgb8 t = textured(67, 45, 5);
  const Rgb8 base = decode_memory(encode_jpeg(67, 45, 3, t.data, 85), "base.jpg");
  const Rgb8 prog = decode_memory(encode_jpeg(67, 45, 3, t.data, 85, true), "prog.jpg");
  EXPECT_EQ(base.data, prog.data);
  EXPECT_LT(max_diff(base.data, t.data), 60);
  Bytes grey_in(67 * 45);
  for (size_t i = 0; i < grey_in.size(); ++i) grey_in[i] = t.data[3 * i];
  const Rgb8 grey = decode_memory(encode_jpeg(67, 45, 1, grey_in, 90), "grey.jpg");
  Bytes grey_rgb;
  for (uint8_t v : grey_in) grey_rgb.insert(grey_rgb.end(), 3, v);
  for (size_t i = 0; i < grey.data.size(); i += 3)
    ASSERT_TRUE(grey.data[i] == grey.data[i + 1] && grey.data[i] == grey.data[i + 2]);
  EXPECT_LT(max_diff(grey.data, grey_rgb), 40);
  // Flat CMYK (stored values 30, 100, 200, 60): Pillow inverts them, then r = nk - nk * c' / 255.
  Bytes cmyk;
  for (int i = 0; i < 16 * 16; ++i) cmyk.insert(cmyk.end(), {30, 100, 200, 60});
  const Bytes want = {uint8_t(pillow_cmyk_channel(30, 60)), uint8_t(pillow_cmyk_channel(100, 60)),
                      uint8_t(pillow_cmyk_channel(200, 60))};
  EXPECT_EQ(want, (Bytes{7, 24, 47}));
  for (bool ycck : {false, true}) {
    const Rgb8 d = decode_memory(encode_jpeg(16, 16, 4, cmyk, 100, false, ycck), "cmyk.jpg");
    for (size_t i = 0; i < d.data.size(); i += 3)
      for (size_t c = 0; c < 3; ++c) ASSERT_LE(std::abs(int(d.data[i + c]) - int(want[c])), 1) << "ycck " << ycck;
  }
  EXPECT_HAS(error_of([&] { decode_memory(encode_jpeg(8, 8, 2, Bytes(128, 50), 90), "two.jpg"); }),
             "image 'two.jpg': a JPEG of 2 components is not supported");
}

// giflib, first frame, on the canvas as Pillow composes frame 0: the screen grown to the frame,
// filled with the transparent index (or index 0), the frame's pixels through its palette.
TEST(Decode, GifFirstFrameOnItsCanvasAsPillow) {
  const Bytes pal = {10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120};  // 4 colours
  GifSpec s;
  s.screen_w = 6, s.screen_h = 5, s.left = 2, s.top = 1, s.frame_w = 3, s.frame_h = 2;
  s.palette = pal;
  s.indices = {1, 2, 3, 3, 2, 1};
  auto canvas = [&](int fill) {
    Bytes v;
    for (int y = 0; y < 5; ++y)
      for (int x = 0; x < 6; ++x) {
        const bool in = x >= 2 && x < 5 && y >= 1 && y < 3;
        const int i = in ? s.indices[size_t((y - 1) * 3 + x - 2)] : fill;
        v.insert(v.end(), pal.begin() + 3 * i, pal.begin() + 3 * i + 3);
      }
    return v;
  };
  const Rgb8 plain = decode_memory(encode_gif(s), "a.gif");
  EXPECT_EQ(plain.width, 6);
  EXPECT_EQ(plain.height, 5);
  EXPECT_EQ(plain.data, canvas(0));  // no transparency: index 0 around the frame, not the background
  s.transparent = 2;
  EXPECT_EQ(decode_memory(encode_gif(s), "t.gif").data, canvas(2));  // transparent pixels keep their colour
  s.local_palette = true;
  EXPECT_EQ(decode_memory(encode_gif(s), "local.gif").data, canvas(2));
  s.second = {0, 0, 0, 0, 0, 0};  // a second frame changes nothing
  EXPECT_EQ(decode_memory(encode_gif(s), "two.gif").data, canvas(2));
  // A frame reaching past the logical screen grows the canvas (Pillow's size = max of both).
  GifSpec g;
  g.screen_w = 4, g.screen_h = 3, g.left = 2, g.top = 2, g.frame_w = 4, g.frame_h = 3;
  g.palette = pal;
  g.indices = Bytes(12, 3);
  const Rgb8 grown = decode_memory(encode_gif(g), "grown.gif");
  EXPECT_EQ(grown.width, 6);
  EXPECT_EQ(grown.height, 5);
  EXPECT_EQ(Bytes(grown.data.end() - 3, grown.data.end()), (Bytes{100, 110, 120}));
  EXPECT_EQ(Bytes(grown.data.begin(), grown.data.begin() + 3), (Bytes{10, 20, 30}));
  // Interlaced rows land where they belong.
  GifSpec i;
  i.screen_w = i.frame_w = 7, i.screen_h = i.frame_h = 19;
  i.palette = noise(256 * 3, 8);
  i.indices = noise(7 * 19, 9);
  const Rgb8 straight = decode_memory(encode_gif(i), "straight.gif");
  i.interlace = true;
  EXPECT_EQ(decode_memory(encode_gif(i), "interlaced.gif").data, straight.data);
  Bytes want;
  for (uint8_t v : i.indices) want.insert(want.end(), i.palette.begin() + 3 * v, i.palette.begin() + 3 * v + 3);
  EXPECT_EQ(straight.data, want);
}

// libwebp: lossless round trips exactly (RGB, and RGBA with its alpha dropped), lossy gives what
// libwebp's own WebPDecodeRGB gives, and an animation's first frame sits at its offset on a
// transparent-black canvas (WebPAnimDecoder's frame 1, which Pillow returns).
TEST(Decode, WebpLosslessLossyAndAnimatedAsPillow) {
  const Rgb8 t = textured(33, 17, 10);
  EXPECT_EQ(decode_memory(encode_webp_lossless(33, 17, 3, t.data), "l.webp").data, t.data);
  Bytes rgba;
  for (size_t i = 0; i < t.data.size(); i += 3)
    rgba.insert(rgba.end(), {t.data[i], t.data[i + 1], t.data[i + 2], uint8_t(1 + i % 255)});
  EXPECT_EQ(decode_memory(encode_webp_lossless(33, 17, 4, rgba), "la.webp").data, t.data);
  const Bytes lossy = encode_webp_lossy(33, 17, t.data, 90);
  const Rgb8 d = decode_memory(lossy, "lossy.webp");
  int w = 0, h = 0;
  uint8_t* ref = WebPDecodeRGB(lossy.data(), lossy.size(), &w, &h);
  ASSERT_TRUE(ref);
  EXPECT_EQ(d.data, Bytes(ref, ref + size_t(w) * size_t(h) * 3));
  WebPFree(ref);
  EXPECT_LT(max_diff(d.data, t.data), 60);
  // Animated: canvas 10x8, frame 1 is 4x4 at (2, 2), frame 2 covers everything and is ignored.
  const Rgb8 f1 = textured(4, 4, 11);
  Bytes f1a;
  for (size_t i = 0; i < f1.data.size(); i += 3)
    f1a.insert(f1a.end(), {f1.data[i], f1.data[i + 1], f1.data[i + 2], 200});
  const Bytes anim = make_animated_webp(10, 8,
                                        {{encode_webp_lossless(4, 4, 4, f1a), 2, 2, 4, 4},
                                         {encode_webp_lossless(10, 8, 3, textured(10, 8, 12).data), 0, 0, 10, 8}});
  const Rgb8 a = decode_memory(anim, "anim.webp");
  ASSERT_EQ(a.width, 10);
  ASSERT_EQ(a.height, 8);
  for (int y = 0; y < 8; ++y)
    for (int x = 0; x < 10; ++x)
      for (int c = 0; c < 3; ++c) {
        const bool in = x >= 2 && x < 6 && y >= 2 && y < 6;
        const uint8_t want = in ? f1.data[(size_t(y - 2) * 4 + size_t(x - 2)) * 3 + size_t(c)] : 0;
        ASSERT_EQ(a.data[(size_t(y) * 10 + size_t(x)) * 3 + size_t(c)], want) << x << "," << y;
      }
  // A frame reaching outside its canvas is refused.
  const Bytes outside = make_animated_webp(10, 8, {{encode_webp_lossless(4, 4, 4, f1a), 8, 2, 4, 4}});
  EXPECT_HAS(error_of([&] { decode_memory(outside, "outside.webp"); }), "image 'outside.webp': corrupt WebP");
}

// fovea's own BMP decoder, every layout it reads, against Pillow's BmpImagePlugin conventions
// (decode-bmp.cpp), and the layouts it refuses.
TEST(Decode, BmpLayoutsAsPillow) {
  auto rgb = [](const BmpSpec& s) { return decode_memory(make_bmp(s), "t.bmp").data; };
  const Rgb8 t = textured(5, 3, 13);
  Bytes want = t.data;
  auto rows = [&](int bytes_per_px, auto&& pixel) {
    std::vector<Bytes> r;
    for (int y = 0; y < 3; ++y) {
      Bytes row;
      for (int x = 0; x < 5; ++x) {
        const uint8_t* p = t.data.data() + (size_t(y) * 5 + size_t(x)) * 3;
        const Bytes b = pixel(p);
        EXPECT_EQ(int(b.size()), bytes_per_px);
        row.insert(row.end(), b.begin(), b.end());
      }
      r.push_back(row);
    }
    return r;
  };
  BmpSpec s;
  s.width = 5, s.height = 3;
  s.bits = 24, s.rows_top_first = rows(3, [](const uint8_t* p) { return Bytes{p[2], p[1], p[0]}; });
  EXPECT_EQ(rgb(s), want);  // bottom-up
  s.top_down = true;
  EXPECT_EQ(rgb(s), want);
  s.header = 12, s.top_down = false;
  EXPECT_EQ(rgb(s), want);  // OS/2 1.x header
  s.header = 40, s.bits = 32, s.rows_top_first = rows(4, [](const uint8_t* p) { return Bytes{p[2], p[1], p[0], 7}; });
  EXPECT_EQ(rgb(s), want);  // BGRX: the fourth byte ignored
  s.header = 124, s.compression = 3, s.masks = {0xFF, 0xFF00, 0xFF0000, 0xFF000000};
  s.rows_top_first = rows(4, [](const uint8_t* p) { return Bytes{p[0], p[1], p[2], 9}; });
  EXPECT_EQ(rgb(s), want);                            // RGBA bit fields, alpha dropped
  s.header = 40, s.masks = {0xFF0000, 0xFF00, 0xFF};  // 40-byte header: the masks follow it
  s.rows_top_first = rows(4, [](const uint8_t* p) { return Bytes{p[2], p[1], p[0], 0}; });
  EXPECT_EQ(rgb(s), want);
  // 16 bit: v * 255 / max per field (Pillow's BGR;15 and BGR;16).
  BmpSpec s16;
  s16.width = 3, s16.height = 1, s16.bits = 16;
  s16.rows_top_first = {{0xFF, 0x7F, 0x21, 0x04, 0x00, 0x7C}};  // 0x7FFF, 0x0421, 0x7C00 (5-5-5)
  EXPECT_EQ(rgb(s16), (Bytes{255, 255, 255, 8, 8, 8, 255, 0, 0}));
  s16.compression = 3, s16.masks = {0xF800, 0x7E0, 0x1F};
  s16.rows_top_first = {{0x00, 0xF8, 0xE0, 0x07, 0x20, 0x00}};  // 0xF800, 0x07E0, 0x0020 (5-6-5)
  EXPECT_EQ(rgb(s16), (Bytes{255, 0, 0, 0, 255, 0, 0, 4, 0}));
  // Palettes: 8 bit with 3 entries (index 5 is past them: black), 4 and 1 bit, most significant first.
  BmpSpec p;
  p.width = 4, p.height = 1, p.bits = 8, p.colours_used = 3;
  p.palette = {3, 2, 1, 0, 30, 20, 10, 0, 255, 254, 253, 0};
  p.rows_top_first = {{2, 0, 5, 1}};
  EXPECT_EQ(rgb(p), (Bytes{253, 254, 255, 1, 2, 3, 0, 0, 0, 10, 20, 30}));
  p.palette = {0, 0, 0, 0, 1, 1, 1, 0, 2, 2, 2, 0, 3, 3, 3, 0}, p.colours_used = 4;  // the grey ramp: Pillow's "L"
  p.rows_top_first = {{1, 200, 3, 0}};
  EXPECT_EQ(rgb(p), (Bytes{1, 1, 1, 200, 200, 200, 3, 3, 3, 0, 0, 0}));
  p.bits = 4, p.colours_used = 0, p.palette = noise(16 * 4, 14), p.rows_top_first = {{0x1F, 0x80}};
  auto entry = [&](int i) {
    return Bytes{p.palette[size_t(4 * i + 2)], p.palette[size_t(4 * i + 1)], p.palette[size_t(4 * i)]};
  };
  Bytes w4;
  for (int i : {1, 15, 8, 0}) {
    const Bytes e = entry(i);
    w4.insert(w4.end(), e.begin(), e.end());
  }
  EXPECT_EQ(rgb(p), w4);
  p.bits = 1, p.width = 10, p.palette = {0, 0, 255, 0, 0, 255, 0, 0}, p.rows_top_first = {{0xA5, 0x40}};
  Bytes w1;
  for (int bit : {1, 0, 1, 0, 0, 1, 0, 1, 0, 1})
    w1.insert(w1.end(), {uint8_t(bit ? 0 : 255), uint8_t(bit ? 255 : 0), 0});
  EXPECT_EQ(rgb(p), w1);
  // Refused, naming the reason.
  BmpSpec r = s;
  r.compression = 1, r.bits = 8, r.masks.clear(), r.palette = Bytes(1024, 0);
  EXPECT_HAS(error_of([&] { rgb(r); }), "RLE-compressed BMP is not supported");
  r = s, r.bits = 32, r.compression = 3, r.header = 124, r.masks = {0x3FF00000, 0xFFC00, 0x3FF, 0};
  EXPECT_HAS(error_of([&] { rgb(r); }), "bit fields 0x3ff00000");
  r = s, r.compression = 0, r.bits = 2, r.palette = Bytes(16, 0);
  EXPECT_HAS(error_of([&] { rgb(r); }), "2 bits per pixel is not supported");
  Bytes odd = make_bmp(s);
  odd[14] = 20;
  EXPECT_HAS(error_of([&] { decode_memory(odd, "odd.bmp"); }), "image 'odd.bmp': BMP header size 20 is not supported");
}

// A file cut short or damaged, in every format: an error naming the image and saying which.
TEST(Decode, TruncatedAndCorruptFilesAreNamed) {
  const Rgb8 t = textured(64, 48, 15);
  Bytes gif_idx(64 * 48);
  for (size_t i = 0; i < gif_idx.size(); ++i) gif_idx[i] = t.data[3 * i];
  GifSpec gs;
  gs.screen_w = gs.frame_w = 64, gs.screen_h = gs.frame_h = 48, gs.palette = noise(256 * 3, 16), gs.indices = gif_idx;
  const std::vector<std::tuple<std::string, Bytes, std::string>> files = {
      {"x.jpg", encode_jpeg_rgb(64, 48, t.data, 90), "JPEG"},
      {"x-progressive.jpg", encode_jpeg(64, 48, 3, t.data, 90, true), "JPEG"},
      {"x.png", encode_png_rgb(64, 48, t.data), "PNG"},
      {"x-interlaced.png", encode_png(64, 48, PNG_COLOR_TYPE_RGB, 8, t.data, true), "PNG"},
      {"x.gif", encode_gif(gs), "GIF"},
      {"x.webp", encode_webp_lossless(64, 48, 3, t.data), "WebP"},
      {"x-lossy.webp", encode_webp_lossy(64, 48, t.data, 80), "WebP"},
      {"x.bmp", encode_bmp_rgb(64, 48, t.data), "BMP"},
  };
  for (const auto& file : files) {
    // Plain references, not structured bindings: clang 14 cannot capture bindings in the lambdas.
    const std::string& name = std::get<0>(file);
    const auto& bytes = std::get<1>(file);
    const auto& format = std::get<2>(file);
    ASSERT_NO_THROW(decode_memory(bytes, name)) << name;
    for (size_t keep : {bytes.size() / 2, bytes.size() / 4}) {
      const std::string e = error_of([&] { decode_memory(first(bytes, keep), name); });
      EXPECT_HAS(e, "image '" + name + "': truncated " + format);
    }
    EXPECT_HAS(error_of([&] { decode_memory(first(bytes, 10), name); }), "image '" + name + "'");
  }
  // Damaged, not short: an EOI marker in the middle of a JPEG's scan; a flipped byte in a PNG's IDAT.
  Bytes jpg = std::get<1>(files[0]);
  jpg[jpg.size() / 2] = 0xFF, jpg[jpg.size() / 2 + 1] = 0xD9;
  EXPECT_HAS(error_of([&] { decode_memory(jpg, "damaged.jpg"); }),
             "image 'damaged.jpg': corrupt JPEG: Corrupt JPEG data");
  Bytes png = std::get<1>(files[2]);
  png[png.size() / 2] ^= 0x55;
  EXPECT_HAS(error_of([&] { decode_memory(png, "damaged.png"); }), "image 'damaged.png': corrupt PNG: IDAT: ");
  // Only the EOI marker missing: libjpeg reads ahead into where it should be, so this is truncated
  // too (Pillow: "image file is truncated").
  const Bytes& full = std::get<1>(files[0]);
  EXPECT_HAS(error_of([&] { decode_memory(first(full, full.size() - 2), "no-eoi.jpg"); }), "truncated JPEG");
}

// The input that overflowed Debian's stb_image 2.27 (a DHT of 2040 codes, a valid prefix code; stb's
// tables hold 256): libjpeg refuses the table.
TEST(Decode, StbHuffmanOverflowInputIsRefused) {
  const std::string path = std::string(FOVEA_SOURCE_DIR) + "/tests/fuzz-regressions/image-jpeg/stb-dht-2040-codes.jpg";
  ASSERT_TRUE(fs::exists(path));
  const std::string e = error_of([&] { decode_file(path); });
  EXPECT_HAS(e, "stb-dht-2040-codes.jpg': corrupt JPEG: Bogus Huffman table definition");
}

TEST(Decode, BadInputsNameTheFile) {
  TempDir dir;
  EXPECT_HAS(error_of([&] { decode_file(dir.file("missing.jpg")); }), "missing.jpg");
  EXPECT_HAS(error_of([&] { decode_file(dir.write("empty.png", "")); }), "empty file");
  EXPECT_HAS(error_of([&] { decode_file(dir.write("text.jpg", "hello, not an image")); }),
             "text.jpg': not a JPEG, PNG, WebP, BMP or GIF image");
  const Bytes png = encode_png_rgb(64, 64, gradient(64, 64).data);
  const std::string cut = dir.write("cut.png", as_string(first(png, png.size() / 2)));
  EXPECT_HAS(error_of([&] { decode_file(cut); }), "cut.png");
  PreprocessConfig small;
  small.max_image_pixels = 1000;  // a 64x64 header claims 4096 pixels: refused before decoding
  const std::string e = error_of([&] { decode_memory(png, "bomb.png", small); });
  EXPECT_HAS(e, "bomb.png");
  EXPECT_HAS(e, "exceeds the limit");
}

// The pixel guard's default comes from the resize budget, and it is applied to the header: these
// files have no pixel data at all, so any other path would fail with a different message.
TEST(Decode, PixelGuardRefusesHugeHeadersBeforeDecoding) {
  PreprocessConfig cfg;
  EXPECT_EQ(image_pixel_limit(cfg), int64_t(1) << 26);  // 4 x 4096^2: 67 MP
  cfg.max_pixels = 262144;
  EXPECT_EQ(image_pixel_limit(cfg), int64_t(1) << 26);  // a small budget keeps the floor
  cfg.max_pixels = int64_t(1) << 26;
  EXPECT_EQ(image_pixel_limit(cfg), int64_t(1) << 28);  // a large one raises the guard
  cfg.max_image_pixels = 1000;
  EXPECT_EQ(image_pixel_limit(cfg), 1000);
  // 8K frames and 48-MP photographs pass the default guard; 16384x16384 does not.
  EXPECT_LE(int64_t(7680) * 4320, image_pixel_limit({}));
  EXPECT_LE(int64_t(8064) * 6048, image_pixel_limit({}));

  // PNG: signature + IHDR 16384x16384 RGB (the 780 KB PNG, without its IDAT) + IEND.
  auto chunk = [](Bytes& v, const char* type, const Bytes& data) {
    for (int s = 24; s >= 0; s -= 8) v.push_back(uint8_t(data.size() >> s));
    const size_t start = v.size();
    v.insert(v.end(), type, type + 4);
    v.insert(v.end(), data.begin(), data.end());
    const uint32_t crc = uint32_t(crc32(0, v.data() + start, uInt(v.size() - start)));
    for (int s = 24; s >= 0; s -= 8) v.push_back(uint8_t(crc >> s));
  };
  Bytes png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  chunk(png, "IHDR", {0, 0, 0x40, 0, 0, 0, 0x40, 0, 8, 2, 0, 0, 0});
  chunk(png, "IEND", {});
  EXPECT_HAS(error_of([&] { decode_memory(png, "huge.png"); }),
             "image 'huge.png': 16384x16384 = 268435456 pixels exceeds the limit of 67108864 (--max-image-pixels)");
  EXPECT_HAS(error_of([&] { probe(png, "huge.png"); }), "exceeds the limit of 67108864");
  // Under a guard that lets it through, libpng starts and finds no pixel data.
  PreprocessConfig open;
  open.max_image_pixels = int64_t(1) << 30;
  EXPECT_HAS(error_of([&] { decode_memory(png, "huge.png", open); }), "image 'huge.png': corrupt PNG");
  // JPEG: a small file's SOF0 patched to 10000x10000.
  Bytes jpg = encode_jpeg_rgb(16, 16, Bytes(16 * 16 * 3, 90), 90);
  for (size_t i = 2; i + 8 < jpg.size(); ++i)
    if (jpg[i] == 0xFF && jpg[i + 1] == 0xC0) {
      jpg[i + 5] = 0x27, jpg[i + 6] = 0x10, jpg[i + 7] = 0x27, jpg[i + 8] = 0x10;
      break;
    }
  EXPECT_HAS(error_of([&] { decode_memory(jpg, "huge.jpg"); }), "10000x10000 = 100000000 pixels exceeds the limit");
  // GIF: a 65535x65535 logical screen around a 1x1 frame.
  GifSpec g;
  g.screen_w = g.screen_h = 65535, g.frame_w = g.frame_h = 1, g.palette = Bytes(6, 0), g.indices = {0};
  EXPECT_HAS(error_of([&] { decode_memory(encode_gif(g), "huge.gif"); }),
             "65535x65535 = 4294836225 pixels exceeds the limit");
  // WebP: a VP8L header rewritten to 16384x16384.
  Bytes webp = encode_webp_lossless(4, 4, 3, Bytes(48, 1));
  ASSERT_EQ(webp[20], 0x2F);
  const uint32_t bits = (16383u) | (16383u << 14) | (uint32_t(webp[24] >> 5) << 29);
  for (int i = 0; i < 4; ++i) webp[size_t(21 + i)] = uint8_t(bits >> (8 * i));
  EXPECT_HAS(error_of([&] { decode_memory(webp, "huge.webp"); }), "16384x16384 = 268435456 pixels exceeds the limit");
  // BMP: a header of 20000x20000 and no pixels.
  BmpSpec b;
  b.width = 20000, b.height = 1, b.bits = 24, b.rows_top_first = {Bytes(60000, 0)};
  Bytes bmp = make_bmp(b);
  bmp[22] = 0x20, bmp[23] = 0x4E;  // height 20000
  EXPECT_HAS(error_of([&] { decode_memory(bmp, "huge.bmp"); }), "20000x20000 = 400000000 pixels exceeds the limit");
  EXPECT_HAS(error_of([&] { decode_memory(bmp, "huge.bmp", open); }), "truncated BMP");
}

// The peak RSS that decoding and preprocessing one file takes, measured in a fresh process (this
// test binary again, running only DecodeMeasure.DISABLED_PeakOfOneFile): glibc's mmap threshold
// fixed at 1 MiB, so every large buffer is mapped and unmapped with its vector and the peak RSS is
// the peak of live buffers (in a long-lived process, or a fork of one, freed heap chunks are reused
// and stay resident); one decode first, so the measured one excludes the decoders' code pages and
// static tables faulted in on first use; then the free heap returned and the peak reset to the RSS
// (clear_refs 5, Linux 4.0+) before the measured decode.
TEST(DecodeMeasure, DISABLED_PeakOfOneFile) {
  const char* file = std::getenv("FOVEA_PEAK_FILE");
  const char* out = std::getenv("FOVEA_PEAK_OUT");
  const char* budget = std::getenv("FOVEA_PEAK_MAX_PIXELS");
  ASSERT_TRUE(file && out && budget) << "run by Decode.ProbeAndPeakBytesBoundWhatDecodingTakes";
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  auto status_kb = [](const char* key) {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key));
    return 0LL;
  };
  PreprocessConfig cfg;
  cfg.max_pixels = std::atoll(budget);
  const std::string bytes = slurp(file);
  const std::span<const uint8_t> b(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  (void)preprocess(decode_memory(b, file, cfg), cfg);
  malloc_trim(0);
  ASSERT_TRUE(std::ofstream("/proc/self/clear_refs") << "5");
  const long long before = status_kb("VmRSS:");
  { const Patches p = preprocess(decode_memory(b, file, cfg), cfg); }
  std::ofstream(out) << (status_kb("VmHWM:") - before) * 1024;
}

// probe reads what decode_memory returns; decode_peak_bytes bounds what decoding and preprocessing
// take (DecodeMeasure above): never below it, and not grossly above it. The sanitizer build checks
// probe and the bound's floor only (kSanitized: its RSS is ASan's allocator, not fovea's buffers).
TEST(Decode, ProbeAndPeakBytesBoundWhatDecodingTakes) {
  TempDir dir;
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const Rgb8 t = textured(1600, 1200, 17);
  Bytes rgba16;
  for (size_t i = 0; i < t.data.size(); i += 3)
    for (size_t c = 0; c < 4; ++c) rgba16.push_back(c < 3 ? t.data[i + c] : 0xFF), rgba16.push_back(0);
  GifSpec gs;
  gs.screen_w = gs.frame_w = 1600, gs.screen_h = gs.frame_h = 1200, gs.palette = noise(256 * 3, 18);
  gs.indices.resize(1600 * 1200);
  for (size_t i = 0; i < gs.indices.size(); ++i) gs.indices[i] = t.data[3 * i];
  const Rgb8 small = textured(800, 600, 19);
  const std::vector<std::tuple<std::string, Bytes, ImageFormat, int, int>> files = {
      {"baseline.jpg", encode_jpeg_rgb(1600, 1200, t.data, 90), ImageFormat::JPEG, 1600, 1200},
      {"progressive.jpg", encode_jpeg(1600, 1200, 3, t.data, 90, true), ImageFormat::JPEG, 1600, 1200},
      {"rgba16-interlaced.png", encode_png(1600, 1200, PNG_COLOR_TYPE_RGB_ALPHA, 16, rgba16, true), ImageFormat::PNG,
       1600, 1200},
      {"rgb.png", encode_png_rgb(1600, 1200, t.data), ImageFormat::PNG, 1600, 1200},
      {"frame.gif", encode_gif(gs), ImageFormat::GIF, 1600, 1200},
      {"lossless.webp", encode_webp_lossless(800, 600, 3, small.data), ImageFormat::WEBP, 800, 600},
      {"lossy.webp", encode_webp_lossy(1600, 1200, t.data, 80), ImageFormat::WEBP, 1600, 1200},
      {"rgb.bmp", encode_bmp_rgb(1600, 1200, t.data), ImageFormat::BMP, 1600, 1200},
  };
  // Three budgets: 65536 pixels (the patches are small: the decoders' own buffers decide), 1 MP
  // (1600x1200 -> 1152x864: every phase matters) and the shipped 16.7 MP (the float patches decide).
  std::printf("  %-24s %9s %10s %12s %12s\n", "file", "size", "budget", "bound", "measured");
  for (const int64_t budget : {int64_t(65536), int64_t(1) << 20, int64_t(16777216)}) {
    PreprocessConfig cfg;
    cfg.max_pixels = budget;
    for (const auto& [name, bytes, format, w, h] : files) {
      SCOPED_TRACE(name);
      const ImageInfo info = probe(bytes, name, cfg);
      EXPECT_EQ(info.format, format);
      EXPECT_EQ(info.width, w);
      EXPECT_EQ(info.height, h);
      EXPECT_EQ(info.name, name);
      const int64_t bound = decode_peak_bytes(info, cfg);
      const auto [oh, ow] = smart_resize(h, w, 32, cfg.min_pixels, cfg.max_pixels);
      EXPECT_GE(bound, 3 * int64_t(w) * h + int64_t(oh) * ow * 3 * 2 * 4);  // at least the image and the patches
      if (kSanitized) continue;
      const std::string path = dir.write(name, as_string(bytes)), result = dir.file(name + ".peak");
      const std::string cmd =
          "FOVEA_PEAK_FILE='" + path + "' FOVEA_PEAK_OUT='" + result +
          "' FOVEA_PEAK_MAX_PIXELS=" + std::to_string(budget) + " '" + self +
          "' --gtest_also_run_disabled_tests --gtest_filter=DecodeMeasure.DISABLED_PeakOfOneFile >/dev/null";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
      const long long used = std::atoll(slurp(result).c_str());
      std::printf("  %-24s %4dx%-4d %10lld %12lld %12lld\n", name.c_str(), w, h, (long long)budget, (long long)bound,
                  used);
      EXPECT_GT(used, 0);
      EXPECT_LE(used, bound);
      EXPECT_LE(bound, used + used / 2 + (int64_t(16) << 20));
    }
  }
}

// Command-line budgets over the model's preprocessing: applied, and an inverted budget is refused
// naming the flags (bench mm-processor and bench calibration used to accept one silently).
TEST(PreprocessConfig, OverridesApplyAndInvertedBudgetsAreRefused) {
  const PreprocessConfig d = load_preprocess_config("synthetic:tiny");
  EXPECT_EQ(d.min_pixels, 65536);
  EXPECT_EQ(d.max_pixels, 16777216);
  EXPECT_EQ(d.max_image_pixels, 0);  // auto
  EXPECT_EQ(image_pixel_limit(d), int64_t(1) << 26);
  const PreprocessConfig o = load_preprocess_config("synthetic:tiny", {4096, 262144, 1000});
  EXPECT_EQ(o.min_pixels, 4096);
  EXPECT_EQ(o.max_pixels, 262144);
  EXPECT_EQ(o.max_image_pixels, 1000);
  EXPECT_EQ(image_pixel_limit(o), 1000);
  EXPECT_HAS(error_of([] {
               load_preprocess_config("synthetic:tiny", {0, 40000});
             }),
             "--max-pixels 40000 is below --min-pixels 65536");
  EXPECT_HAS(error_of([] { load_preprocess_config("synthetic:tiny", {0, 0, -1}); }), "--max-image-pixels");
}

TEST(ListImages, TakesEveryDecodedExtension) {
  TempDir dir;
  for (const char* f : {"a.JPG", "b.jpeg", "c.png", "d.webp", "e.bmp", "f.GIF", "g.txt", "h.tiff"}) dir.write(f, "x");
  std::vector<std::string> names;
  for (const auto& p : list_images(dir.path.string(), "--dataset-path"))
    names.push_back(fs::path(p).filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{"a.JPG", "b.jpeg", "c.png", "d.webp", "e.bmp", "f.GIF"}));
}

TEST(Preprocess, HdPhotoSizedInputGivesTheTransformersGrid) {
  const Patches p = preprocess(gradient(1280, 720), {});
  EXPECT_EQ(p.grid, (qwen3vl::GridThw{1, 44, 80}));  // 704 x 1280 (docs/encoder.md §smart_resize)
  ASSERT_EQ(p.pixels.size(), size_t(3520) * 1536);
  for (float v : p.pixels) ASSERT_TRUE(v >= -1.f && v <= 1.f);
}

// fovea encode on the CPU: good images are encoded together, a bad one is reported by name and
// makes the exit code non-zero; the written tokens equal the library forward on the same pixels:
// by default as BF16, its fp32 rounded to nearest even; with --output-dtype f32 as they are. A bad
// --output-dtype is an error naming the flag.
TEST(EncodeCli, EncodesTheGoodImagesAndReportsTheBadOne) {
  TempDir dir;
  const auto a = encode_png_rgb(300, 200, gradient(300, 200).data);
  const auto b = encode_bmp_rgb(64, 640, gradient(64, 640).data);
  const std::string pa = dir.write("a.png", std::string(a.begin(), a.end()));
  const std::string pb = dir.write("b.bmp", std::string(b.begin(), b.end()));
  const std::string bad = dir.write("bad.jpg", "not an image");
  const std::string out = dir.file("out.safetensors"), err = dir.file("err.txt");
  const std::string cmd = std::string("'") + FOVEA_BIN + "' encode synthetic:tiny '" + pa + "' '" + bad + "' '" + pb +
                          "' --device cpu -o '" + out + "' >/dev/null 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  EXPECT_NE(status, 0);
  std::ifstream ef(err);
  const std::string errors((std::istreambuf_iterator<char>(ef)), std::istreambuf_iterator<char>());
  EXPECT_HAS(errors, "bad.jpg");
  EXPECT_HAS(errors, "1 of 3");
  const Checkpoint ck = Checkpoint::open(out);
  const auto grid0 = ck.find("image.0.grid_thw")->to_float();
  EXPECT_EQ(grid0, (std::vector<float>{1, 14, 20}));  // 300x200 -> 320x224 (min_pixels)
  ASSERT_TRUE(ck.find("image.1.embeddings"));
  EXPECT_EQ(ck.find("image.1.embeddings")->shape[0], int64_t(1) * 52 * 6 / 4);  // 64x640 -> 96x832
  EXPECT_TRUE(ck.find("image.0.deepstack.1"));
  // Same numbers as the library, image by image in one packed forward.
  const qwen3vl::Model m = qwen3vl::load_model("synthetic:tiny");
  const Patches p0 = preprocess(decode_file(pa), {}), p1 = preprocess(decode_file(pb), {});
  std::vector<float> px = p0.pixels;
  px.insert(px.end(), p1.pixels.begin(), p1.pixels.end());
  qwen3vl::ForwardOptions o;
  o.attention = cpu::RefMode::BF16;
  const auto r = qwen3vl::forward_cpu(m, px, {p0.grid, p1.grid}, o);
  const size_t n0 = 70 * 48, n1 = 78 * 48;  // image 0's values, image 1's
  ASSERT_EQ(r.merged.size(), n0 + n1);
  // The tensor's values against ref[first, first + n): its bf16 bits against ref rounded, or exactly.
  const auto same = [](const Checkpoint& c, const std::string& name, DType dtype, const std::vector<float>& ref,
                       size_t first, size_t n) {
    const TensorInfo* t = c.find(name);
    if (!t || t->dtype != dtype || size_t(t->numel()) != n) return false;
    if (dtype == DType::F32)
      return t->to_float() == std::vector<float>(ref.begin() + long(first), ref.begin() + long(first + n));
    for (size_t i = 0; i < n; ++i)
      if (uint16_t(t->data[2 * i] | t->data[2 * i + 1] << 8) != bf16_from_float(ref[first + i])) return false;
    return true;
  };
  EXPECT_EQ(ck.find("image.0.grid_thw")->dtype, DType::F32);
  EXPECT_TRUE(same(ck, "image.0.embeddings", DType::BF16, r.merged, 0, n0));
  EXPECT_TRUE(same(ck, "image.1.embeddings", DType::BF16, r.merged, n0, n1));
  EXPECT_TRUE(same(ck, "image.1.deepstack.1", DType::BF16, r.deepstack[1], n0, n1));

  const std::string out32 = dir.file("out32.safetensors");
  ASSERT_EQ(std::system((std::string("'") + FOVEA_BIN + "' encode synthetic:tiny '" + pa + "' '" + pb +
                         "' --device cpu --output-dtype f32 -o '" + out32 + "' >/dev/null")
                            .c_str()),
            0);
  const Checkpoint ck32 = Checkpoint::open(out32);
  EXPECT_EQ(ck32.find("image.1.grid_thw")->to_float(), (std::vector<float>{1, 52, 6}));
  EXPECT_EQ(ck32.find("image.1.grid_thw")->dtype, DType::F32);
  EXPECT_TRUE(same(ck32, "image.0.embeddings", DType::F32, r.merged, 0, n0));
  EXPECT_TRUE(same(ck32, "image.1.embeddings", DType::F32, r.merged, n0, n1));
  EXPECT_TRUE(same(ck32, "image.1.deepstack.1", DType::F32, r.deepstack[1], n0, n1));

  const int bad_dtype = std::system((std::string("'") + FOVEA_BIN + "' encode synthetic:tiny '" + pa +
                                     "' --device cpu --output-dtype fp16 -o '" + dir.file("never.safetensors") +
                                     "' >/dev/null 2>'" + err + "'")
                                        .c_str());
  EXPECT_TRUE(WIFEXITED(bad_dtype) && WEXITSTATUS(bad_dtype) == 1) << bad_dtype;
  std::ifstream ef2(err);
  EXPECT_HAS(std::string((std::istreambuf_iterator<char>(ef2)), std::istreambuf_iterator<char>()),
             "fovea: error: encode: --output-dtype: 'fp16' is not one of bf16, f32");
  EXPECT_FALSE(fs::exists(dir.file("never.safetensors")));
}

// Issue #5's bad inputs, all in one encode call beside two good images: each failure is reported
// naming the file and the problem, the good images are still encoded, and the exit code is 1. A tiny
// image is not an error: transformers 5.17's smart_resize upscales it to min_pixels, and so does fovea.
TEST(EncodeCli, EveryBadInputIsNamedAndTheRestEncoded) {
  TempDir dir;
  const auto good = encode_png_rgb(96, 64, gradient(96, 64).data);
  const auto jpg = encode_jpeg_rgb(64, 64, gradient(64, 64).data, 95);
  const auto tiny = encode_png_rgb(3, 2, gradient(3, 2).data);
  const auto wide = encode_png_rgb(402, 2, gradient(402, 2).data);     // 201:1
  const auto big = encode_png_rgb(300, 300, gradient(300, 300).data);  // over --max-image-pixels
  struct Case {
    std::string path, expect;
  };
  const std::vector<Case> bad = {
      {dir.write("zero.png", ""), "empty file"},
      {dir.write("text.gif", "just some text"), "not a JPEG, PNG, WebP, BMP or GIF"},
      {dir.write("cut.jpg", std::string(jpg.begin(), jpg.begin() + long(jpg.size() / 3))), "cut.jpg"},
      {dir.write("wide.png", std::string(wide.begin(), wide.end())), "over 200:1"},
      {dir.write("big.png", std::string(big.begin(), big.end())), "exceeds the limit of 50000"},
      {dir.file("missing.bmp"), "missing.bmp"},
      {[&] {
         fs::create_directories(dir.file("folder.png"));
         return dir.file("folder.png");
       }(),
       "folder.png"},
  };
  const std::string a = dir.write("a.png", std::string(good.begin(), good.end()));
  const std::string t = dir.write("tiny.png", std::string(tiny.begin(), tiny.end()));
  std::string cmd =
      std::string("'") + FOVEA_BIN + "' encode synthetic:tiny --device cpu --max-image-pixels 50000 '" + a + "'";
  for (const auto& c : bad) cmd += " '" + c.path + "'";
  const std::string out = dir.file("out.safetensors"), err = dir.file("err.txt");
  cmd += " '" + t + "' -o '" + out + "' >/dev/null 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  std::ifstream ef(err);
  const std::string errors((std::istreambuf_iterator<char>(ef)), std::istreambuf_iterator<char>());
  for (const auto& c : bad) {
    const size_t line = errors.find(fs::path(c.path).filename().string());
    ASSERT_NE(line, std::string::npos) << c.path << " not named in:\n" << errors;
    EXPECT_HAS(errors.substr(line, errors.find('\n', line) - line), c.expect);
  }
  EXPECT_HAS(errors, "7 of 9");
  const Checkpoint ck = Checkpoint::open(out);
  EXPECT_EQ(ck.find("image.0.grid_thw")->to_float(), (std::vector<float>{1, 14, 20}));  // 96x64 -> 320x224 (min_pixels)
  EXPECT_EQ(ck.find("image.1.grid_thw")->to_float(), (std::vector<float>{1, 14, 20}));  // 3x2 -> 320x224
  EXPECT_FALSE(ck.find("image.2.grid_thw"));
}

// bench calibration on the CPU: calibrates on two images, holds two out. Against BF16 (the default):
// static and dynamic FP8 stay close, and the scale file is written. On the model with outlier
// channels against the fp32 forward: per scheme and margin, robust FP8 far better than per-tensor,
// auto static the same as robust static (every layer is flagged), the drift per field reported.
TEST(EncodeCli, CalibrationHoldsOnOtherImages) {
  TempDir dir;
  std::mt19937 rng(3);
  for (int i = 0; i < 4; ++i) {
    Rgb8 g = gradient(160 + 32 * i, 128);
    for (auto& v : g.data) v = uint8_t(std::clamp(int(v) + int(rng() % 31) - 15, 0, 255));
    const auto png = encode_png_rgb(g.width, g.height, g.data);
    dir.write("img" + std::to_string(i) + ".png", std::string(png.begin(), png.end()));
  }
  fs::create_directories(dir.path / "out");
  const std::string scales = (dir.path / "out" / "scales.json").string(), json = (dir.path / "out" / "r.json").string();
  const std::string base = std::string("'") + FOVEA_BIN + "' bench calibration --dataset-path '" + dir.path.string() +
                           "' --calibration-images 2 --device cpu --scale-file '" + scales + "' --output-json '" +
                           json + "' ";
  auto read_json = [&] {
    std::ifstream f(json);
    return nlohmann::json::parse(f);
  };
  ASSERT_EQ(std::system((base + "--model synthetic:tiny >/dev/null").c_str()), 0);
  const ScaleFile file15 = read_scale_file(scales);
  EXPECT_EQ(file15.layers.size(), 3u);
  const auto doc = read_json();
  ASSERT_EQ(doc["rows"].size(), 2u);
  for (const auto& r : doc["rows"]) {
    EXPECT_LT(r["tensor dynamic"].get<double>(), 0.1) << r.dump();
    EXPECT_LT(r["tensor static x1.5"].get<double>(), 0.1) << r.dump();
    EXPECT_GT(r["tensor static x1.5"].get<double>(), 0.0) << r.dump();
  }
  EXPECT_EQ(doc["drift"]["tensor"]["q"]["count"], 3);
  // A per-field margin scales that field alone, as calibrating with it would.
  ASSERT_EQ(std::system((base + "--model synthetic:tiny --margins 1.5:q=3 >/dev/null").c_str()), 0);
  const ScaleFile plain = read_scale_file(scales);
  for (const auto& [l, s] : plain.layers) {
    const QkvScales& at15 = file15.layers.at(l);
    EXPECT_FLOAT_EQ(s.q, at15.q / 1.5f * 3.0f) << "layer " << l;
    EXPECT_EQ(s.k, at15.k);
    EXPECT_EQ(s.v, at15.v);
  }

  ASSERT_EQ(
      std::system(
          (base +
           "--model synthetic:tiny-outliers --fp8-scheme robust,tensor,auto --margins 1.5,1,1.5:fovea_v_channel=1:q=2 "
           "--reference fp32 >/dev/null")
              .c_str()),
      0);
  const ScaleFile file = read_scale_file(scales);  // the first scheme's, with the first margin
  ASSERT_EQ(file.fine.size(), 3u);
  for (const auto& [l, f] : file.fine) EXPECT_GE(f.robust_gain, kAutoRobustGain) << "layer " << l;
  const auto out = read_json();
  EXPECT_EQ(out["reference"], "fp32");
  for (const auto& r : out["rows"]) {
    const double bf16 = r["bf16"].get<double>();
    EXPECT_GT(bf16, 0.0);
    // (margin 1 clips what the held-out images reach beyond the calibration's amax: no bound here)
    for (const char* m : {"robust dynamic", "robust static x1.5"})
      EXPECT_LT(r[m].get<double>(), r["tensor dynamic"].get<double>() / 2) << m << ": " << r.dump();
    EXPECT_EQ(r["auto static x1.5"], r["robust static x1.5"]) << r.dump();
    EXPECT_EQ(r["auto dynamic"], r["tensor dynamic"]) << "dynamic auto is per-tensor";
  }
  const auto& drift = out["drift"]["robust"];
  EXPECT_EQ(drift["fovea_q_head"]["count"], 12);  // 3 layers x 4 heads
  EXPECT_EQ(drift["fovea_v_channel"]["count"], 192);
  EXPECT_GT(drift["fovea_v_channel"]["worst"].get<double>(), 0.0);
  ASSERT_EQ(out["summary"].size(), 13u);  // bf16 + 3 schemes x (dynamic + 3 margins)
  // The file the third margin runs from: 1.5 everywhere but V's channels (1) and q (2).
  for (const auto& r : out["rows"]) EXPECT_GT(r["robust static x1.5 fovea_v_channel=1 q=2"].get<double>(), 0.0);
  for (const auto& s : out["summary"])
    if (s["mode"].get<std::string>().find(" static ") != std::string::npos)
      EXPECT_TRUE(s.contains("static_over_dynamic_mean")) << s.dump();

  // Bad values are refused naming the flag.
  for (const char* bad : {"--reference fp16", "--margins 0", "--margins 1.5:fovea_k_mean=1", "--margins 1.5:v=x",
                          "--margins 1.5x", "--fp8-scheme sometimes"})
    EXPECT_NE(std::system((base + "--model synthetic:tiny " + bad + " >/dev/null 2>&1").c_str()), 0) << bad;
}
