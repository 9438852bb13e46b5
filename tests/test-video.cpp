// Video clips: sampling, smart_resize over frames, timestamps and patchify against transformers'
// rules, decoding of the committed clips (tests/data/video: H.264/MP4, VP9/WebM, BT.709-tagged
// H.264) against the ffmpeg command line's own decode, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/io.h"
#include "fovea/pipeline.h"
#include "fovea/video.h"
#include "test-util.h"

using namespace fovea;
using namespace fovea::video;
using namespace fovea::test;

namespace {

std::string clip_path(const std::string& name) { return std::string(FOVEA_SOURCE_DIR) + "/tests/data/video/" + name; }
std::string clip_bytes(const std::string& name) { return read_file(clip_path(name), "clip", size_t(1) << 24); }
std::span<const uint8_t> span_of(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

// The checkpoint's video budget (Qwen3-VL-8B-Instruct's video_preprocessor_config.json).
VideoConfig checkpoint_config() {
  VideoConfig c;
  c.min_pixels = 4096;
  c.max_pixels = 25165824;
  return c;
}

image::Rgb8 solid(int w, int h, uint8_t v) {
  image::Rgb8 f;
  f.width = w;
  f.height = h;
  f.data.assign(size_t(w) * h * 3, v);
  return f;
}

}  // namespace

TEST(VideoSampling, LinspaceRoundsHalfToEvenAsNumpy) {
  EXPECT_EQ(linspace_indices(36, 6), (std::vector<int64_t>{0, 7, 14, 21, 28, 35}));
  EXPECT_EQ(linspace_indices(4, 3), (std::vector<int64_t>{0, 2, 3}));   // 1.5 -> 2
  EXPECT_EQ(linspace_indices(6, 3), (std::vector<int64_t>{0, 2, 5}));   // 2.5 -> 2
  EXPECT_EQ(linspace_indices(10, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(linspace_indices(3, 5), (std::vector<int64_t>{0, 0, 1, 2, 2}));  // 0.5 -> 0, 1.5 -> 2
  EXPECT_THROW(linspace_indices(0, 3), Error);
}

TEST(VideoSampling, FramesFollowFpsAndClamp) {
  const VideoConfig c;  // fps 2, 4..768 frames
  EXPECT_EQ(sample_indices(36, 12, c).size(), 6u);     // 3 s at 2 fps
  EXPECT_EQ(sample_indices(25, 10, c).size(), 5u);     // odd: padded later, not here
  EXPECT_EQ(sample_indices(30, 30, c).size(), 4u);     // 1 s: min_frames
  EXPECT_EQ(sample_indices(3, 30, c).size(), 3u);      // fewer frames than min_frames: all of them
  EXPECT_EQ(sample_indices(3600 * 30, 30, c).size(), 768u);  // an hour: max_frames
  EXPECT_EQ(sample_indices(100, 0, c).size(), 8u);     // no rate: 24 fps assumed, int(100 / 24 * 2)
  VideoConfig n = c;
  n.num_frames = 7;
  EXPECT_EQ(sample_indices(1000, 30, n).size(), 7u);
  VideoConfig all = c;
  all.sample_frames = false;
  EXPECT_EQ(sample_indices(11, 30, all), linspace_indices(11, 11));
}

TEST(VideoResize, BudgetCountsFramesAndRoundsHalfToEven) {
  const VideoConfig ck = checkpoint_config();
  EXPECT_EQ(smart_resize_video(16, 720, 1280, ck), (std::pair{704, 1280}));  // 22.5 -> 22
  // Over budget: 120 frames of FullHD.
  const auto [h, w] = smart_resize_video(120, 1080, 1920, ck);
  EXPECT_LE(int64_t(120) * h * w, ck.max_pixels);
  EXPECT_EQ(h % 32, 0);
  EXPECT_EQ(w % 32, 0);
  EXPECT_GT(int64_t(120) * (h + 32) * (w + 32), ck.max_pixels);
  // Under the class default's min (131072): scaled up.
  const auto [h2, w2] = smart_resize_video(6, 120, 160, VideoConfig{});
  EXPECT_GE(int64_t(6) * h2 * w2, 131072);
  EXPECT_NE(error_of([&] { smart_resize_video(1, 480, 640, ck); }).find("temporal_patch_size"), std::string::npos);
  EXPECT_NE(error_of([&] { smart_resize_video(4, 32, 32 * 201, ck); }).find("aspect ratio"), std::string::npos);
  const auto [h3, w3] = smart_resize_video(4, 16, 40, ck);  // below 32 on a side: scaled up first
  EXPECT_GE(h3, 32);
  EXPECT_GE(w3, 64);
}

TEST(VideoTimestamps, MeanOfEachTemporalPatchsFrames) {
  const auto ts = patch_timestamps({0, 15}, 30, 2);
  ASSERT_EQ(ts.size(), 1u);
  EXPECT_DOUBLE_EQ(ts[0], 0.25);
  const auto odd = patch_timestamps({0, 10, 20}, 10, 2);  // the last index repeated
  ASSERT_EQ(odd.size(), 2u);
  EXPECT_DOUBLE_EQ(odd[0], 0.5);
  EXPECT_DOUBLE_EQ(odd[1], 2.0);
}

TEST(VideoPatchify, TemporalPairsAndTheLastFrameRepeated) {
  const VideoConfig c;
  std::vector<image::Rgb8> frames = {solid(64, 32, 0), solid(64, 32, 255), solid(64, 32, 51)};
  frames[1].data[0] = 7;  // frame 1, pixel (0,0), red
  const image::Patches p = patchify_frames(frames, c);
  ASSERT_EQ(p.grid, (qwen3vl::GridThw{2, 2, 4}));
  const size_t row = 3 * 2 * 16 * 16, plane = 2 * 4;
  ASSERT_EQ(p.pixels.size(), 2 * plane * row);
  const auto norm = [](uint8_t v) { return (float(v) - 127.5f) / 127.5f; };
  // Row 0 of temporal patch 0: columns (c, t, py, px); t = 0 is frame 0, t = 1 frame 1.
  EXPECT_EQ(p.pixels[0], norm(0));
  EXPECT_EQ(p.pixels[256], norm(7));
  EXPECT_EQ(p.pixels[257], norm(255));
  // Temporal patch 1: frame 2, then frame 2 again (the padding).
  const float* r = p.pixels.data() + plane * row;
  for (size_t k = 0; k < row; ++k) ASSERT_EQ(r[k], norm(51)) << k;
  EXPECT_THROW(patchify_frames({solid(48, 32, 0)}, c), Error);  // not a multiple of 32
}

TEST(VideoConfigFile, CheckpointFieldsAndBadValues) {
  const VideoConfig c = parse_video_config(
      R"({"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
          "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 1.5, "max_frames": 100})",
      "v.json");
  EXPECT_EQ(c.min_pixels, 4096);
  EXPECT_EQ(c.max_pixels, 25165824);
  EXPECT_EQ(c.fps, 1.5);
  EXPECT_EQ(c.max_frames, 100);
  EXPECT_EQ(parse_video_config("{}", "v.json").max_pixels, 768 * 32 * 32);  // the class default
  EXPECT_NE(error_of([] { parse_video_config(R"({"fps": 0})", "v.json"); }).find("fps"), std::string::npos);
  EXPECT_NE(error_of([] { parse_video_config(R"({"min_frames": 9, "max_frames": 4})", "v.json"); }).find("max_frames"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_video_config(R"({"do_sample_frames": "yes"})", "v.json"); }).find("do_sample_frames"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_video_config("[1]", "v.json"); }).find("v.json"), std::string::npos);
}

TEST(VideoMagic, ContainersAreRecognizedImagesAreNot) {
  for (const char* f : {"h264.mp4", "vp9.webm", "bt709.mp4"}) EXPECT_TRUE(looks_like_video(span_of(clip_bytes(f)))) << f;
  const std::string png = "\x89PNG\r\n\x1a\n0000000000";
  EXPECT_FALSE(looks_like_video(span_of(png)));
  EXPECT_FALSE(looks_like_video({}));
}

#if FOVEA_HAVE_VIDEO

TEST(VideoDecode, ProbeCountsFramesAndRate) {
  const ClipInfo a = probe_clip(span_of(clip_bytes("h264.mp4")), "h264.mp4");
  EXPECT_EQ(a.frames, 36);
  EXPECT_DOUBLE_EQ(a.fps, 12);
  EXPECT_EQ(a.width, 160);
  EXPECT_EQ(a.height, 120);
  EXPECT_EQ(a.codec, "h264");
  const ClipInfo b = probe_clip(span_of(clip_bytes("vp9.webm")), "vp9.webm");
  EXPECT_EQ(b.frames, 25);
  EXPECT_DOUBLE_EQ(b.fps, 10);
  EXPECT_EQ(b.codec, "vp9");
  EXPECT_NE(b.container.find("webm"), std::string::npos);
}

TEST(VideoDecode, ClipsBecomePatchesWithGridsAndTimestamps) {
  for (const char* f : {"h264.mp4", "vp9.webm", "bt709.mp4"}) {
    SCOPED_TRACE(f);
    const VideoConfig c;
    const Clip clip = decode_clip(span_of(clip_bytes(f)), f, c);
    const std::vector<int64_t> want = sample_indices(clip.info.frames, clip.info.fps, c);
    EXPECT_EQ(clip.indices, want);
    const auto [h, w] = smart_resize_video(int64_t(want.size()), clip.info.height, clip.info.width, c);
    const int t = int((want.size() + 1) / 2);
    EXPECT_EQ(clip.patches.grid, (qwen3vl::GridThw{t, h / 16, w / 16}));
    EXPECT_EQ(clip.patches.pixels.size(), size_t(t) * (h / 16) * (w / 16) * 1536);
    EXPECT_EQ(clip.timestamps, patch_timestamps(want, clip.info.fps, 2));
    for (float v : clip.patches.pixels) ASSERT_TRUE(v >= -1.0f && v <= 1.0f);
  }
}

// fovea's decode of a frame against the ffmpeg command line's (its own swscale settings, so a few
// levels apart at chroma edges): the same frame, the same colour matrix.
TEST(VideoDecode, FramesMatchTheFfmpegCommandLine) {
  TempDir dir;
  for (const auto& [f, frame] : {std::pair{"h264.mp4", 14}, {"vp9.webm", 20}, {"bt709.mp4", 7}}) {
    SCOPED_TRACE(f);
    const std::string raw = dir.file("frame.rgb");
    const std::string cmd = fmt::format("ffmpeg -v error -y -i '{}' -vf \"select=eq(n\\,{})\" -frames:v 1 -f rawvideo "
                                        "-pix_fmt rgb24 '{}'", clip_path(f), frame, raw);
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "the ffmpeg command line (Debian package ffmpeg) is needed: " << cmd;
    const std::string theirs = slurp(raw);
    const std::vector<image::Rgb8> ours = decode_frames(span_of(clip_bytes(f)), f, {frame});
    ASSERT_EQ(ours.size(), 1u);
    ASSERT_EQ(theirs.size(), ours[0].data.size());
    double sum = 0;
    int worst = 0;
    for (size_t i = 0; i < theirs.size(); ++i) {
      const int d = std::abs(int(uint8_t(theirs[i])) - int(ours[0].data[i]));
      sum += d;
      worst = std::max(worst, d);
    }
    const double mean = sum / double(theirs.size());
    std::printf("%s frame %d: mean |diff| %.3f, max %d\n", f, frame, mean, worst);
    EXPECT_LT(mean, 1.5);  // a wrong matrix (BT.601 for BT.709) or range costs 5-20 levels on average
  }
}

TEST(VideoDecode, BadInputIsAnErrorNamingTheClip) {
  const std::string good = clip_bytes("h264.mp4");
  EXPECT_NE(error_of([] { probe_clip(span_of(std::string("hello, not a video at all")), "x.mp4"); }).find("video 'x.mp4'"),
            std::string::npos);
  EXPECT_NE(error_of([] { probe_clip({}, "empty.mp4"); }).find("empty"), std::string::npos);
  // Truncated: the header survives, frames are missing or the index points past the end.
  const std::string cut = good.substr(0, good.size() / 2);
  EXPECT_NE(error_of([&] { decode_clip(span_of(cut), "cut.mp4", VideoConfig{}); }).find("video 'cut.mp4'"), std::string::npos);
  VideoLimits small;
  small.max_frame_pixels = 100 * 100;
  EXPECT_NE(error_of([&] { probe_clip(span_of(good), "big.mp4", small); }).find("exceed"), std::string::npos);
  VideoLimits short_clips;
  short_clips.max_seconds = 1;
  EXPECT_NE(error_of([&] { probe_clip(span_of(good), "long.mp4", short_clips); }).find("--max-video-seconds"),
            std::string::npos);
  VideoLimits no_time;
  no_time.deadline_seconds = 0;
  EXPECT_NE(error_of([&] { decode_clip(span_of(good), "slow.mp4", VideoConfig{}, no_time); }).find("video 'slow.mp4'"),
            std::string::npos);
  VideoLimits tiny_memory;
  tiny_memory.max_bytes_in_flight = 1000;
  EXPECT_NE(error_of([&] { decode_clip(span_of(good), "mem.mp4", VideoConfig{}, tiny_memory); }).find("limit"),
            std::string::npos);
}

// Random corruption of a real clip: every outcome is a clip or an Error, never a crash (the
// sanitizer build runs this too).
TEST(VideoDecode, CorruptedClipsFailCleanly) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (const char* f : {"h264.mp4", "vp9.webm"}) {
    const std::string good = clip_bytes(f);
    for (int k = 0; k < 12; ++k) {
      std::string bad = good;
      for (int i = 0; i < 20; ++i) bad[rng() % bad.size()] = char(rng());
      try {
        const Clip c = decode_clip(span_of(bad), f, VideoConfig{});
        EXPECT_FALSE(c.patches.pixels.empty());
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
      }
    }
  }
}

#endif

#if FOVEA_HAVE_VIDEO
// A clip packed with an image into one varlen forward gives the clip's tokens as it gives them
// alone, and the clip's temporal patches are segments of their own: tokens = t * h * w / 4.
TEST(VideoEncode, ClipPackedWithAnImageMatchesTheClipAlone) {
  const qwen3vl::Model model = qwen3vl::load_model("synthetic:tiny");
  const VideoConfig vc = load_video_config("synthetic:tiny");
  const Clip clip = decode_clip(span_of(clip_bytes("vp9.webm")), "vp9.webm", vc);
  image::Rgb8 img = solid(96, 64, 90);
  for (size_t i = 0; i < img.data.size(); ++i) img.data[i] = uint8_t(i * 37 % 251);
  const image::Patches still = image::preprocess(img, image::load_preprocess_config("synthetic:tiny"));
  EngineOptions o;
  o.device = "cpu";
  EncoderRunner runner(model, resolve_engine(o, query_system()));
  Batch both, alone;
  both.add(image::Patches(still));
  both.add(image::Patches(clip.patches));
  alone.add(image::Patches(clip.patches));
  const std::vector<ImageTensors> packed = split_images(runner.run(both), both.grids, model.config);
  const EncoderOutputs one = runner.run(alone);
  const auto& g = clip.patches.grid;
  ASSERT_EQ(packed[1].merged.size(), size_t(g[0]) * g[1] * g[2] / 4 * model.config.out_hidden);
  ASSERT_EQ(one.merged.size(), packed[1].merged.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < one.merged.size(); ++i) {
    ASSERT_TRUE(std::isfinite(packed[1].merged[i]));
    num += std::pow(double(packed[1].merged[i]) - one.merged[i], 2);
    den += std::pow(double(one.merged[i]), 2);
  }
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  EXPECT_GT(den, 0);
}
#endif
