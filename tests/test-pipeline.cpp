// Tests of the pipeline every command and the server share (fovea/pipeline.h): inputs prepared
// from their bytes with errors kept per input, packing into forwards, splitting, the per-input
// tensors, and the CPU encoder run on a packed batch against the same inputs run one by one.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fovea/bf16.h"
#include "fovea/error.h"
#include "fovea/pipeline.h"
#include "fovea/threads.h"
#include "image-encode.h"
#include "test-util.h"

using namespace fovea;
using namespace fovea::test;

namespace {

image::Rgb8 noise_image(int w, int h, unsigned seed) {
  std::mt19937 r(seed);
  image::Rgb8 img{w, h, std::vector<uint8_t>(size_t(w) * h * 3), "noise-" + std::to_string(seed)};
  for (auto& v : img.data) v = uint8_t(r() & 255);
  return img;
}

// Sizes that resize to different grids under synthetic:tiny's preprocessing (one per image).
const std::vector<std::pair<int, int>> kSizes = {{320, 240}, {97, 411}, {256, 256}, {640, 64}, {333, 222}};

}  // namespace

// prepare_inputs: images and a clip from their bytes, errors kept per input (an unreadable input,
// a corrupt image, an empty one), hooks called once each with each input's plan before it decodes;
// the patches are exactly image::preprocess's (raw) and video::decode_clip's.
TEST(Pipeline, PrepareInputsKeepsEachInputsErrorAndMatchesPreprocess) {
  const InputConfig cfg = load_input_config("synthetic:tiny");
  std::vector<std::vector<uint8_t>> files;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const image::Rgb8 img = noise_image(kSizes[i].first, kSizes[i].second, unsigned(i));
    files.push_back(test::encode_png_rgb(img.width, img.height, img.data));
  }
  files[3].resize(files[3].size() / 2);  // truncated: its decode fails
  const std::string clip_file = slurp(std::string(FOVEA_SOURCE_DIR) + "/tests/data/video/h264.mp4");
  files.emplace_back(clip_file.begin(), clip_file.end());
  const size_t n = files.size(), clip = n - 1;
  std::vector<std::string> names;
  for (size_t i = 0; i < n; ++i) names.push_back("input-" + std::to_string(i));
  std::vector<std::atomic<int>> planned(n), done(n);
  std::vector<InputPlan> plans(n);
  PrepareHooks hooks;
  hooks.planned = [&](size_t i, const InputPlan& p) {
    plans[i] = p;
    planned[i]++;
  };
  hooks.done = [&](size_t i, const PreparedInput&) { done[i]++; };
  const std::vector<PreparedInput> p = prepare_inputs(
      names,
      [&](size_t i) {
        if (i == 1) fail("input one cannot be read");
        return files[i];
      },
      cfg, hooks);
  ASSERT_EQ(p.size(), n);
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(done[i].load(), 1);                  // exactly once, failed or not
    EXPECT_EQ(planned[i].load(), i == 1 ? 0 : 1);  // before decoding: never for the unreadable one
    if (i == 1 || i == 3) {
      EXPECT_TRUE(p[i].error);
      EXPECT_TRUE(p[i].patches.raw.empty() && p[i].patches.pixels.empty());
      continue;
    }
    ASSERT_FALSE(p[i].error) << p[i].error_message();
    EXPECT_EQ(p[i].error_message(), "");
    EXPECT_EQ(p[i].kind, i == clip ? InputKind::VIDEO : InputKind::IMAGE);
    EXPECT_EQ(plans[i].kind, p[i].kind);
    EXPECT_EQ(plans[i].grid, p[i].patches.grid);  // what the header alone said
    EXPECT_GT(plans[i].peak_bytes, 0);
    EXPECT_GE(p[i].decode_ms, 0);
    EXPECT_GE(p[i].preprocess_ms, 0);
    if (i == clip) {
      const video::Clip ref = video::decode_clip(files[i], names[i], cfg.video, cfg.limits, cfg.image);
      EXPECT_EQ(p[i].patches.pixels, ref.patches.pixels);  // clips: fp32
      ASSERT_TRUE(p[i].clip && plans[i].clip);
      EXPECT_EQ(p[i].clip->frame_indices, ref.indices);
      EXPECT_EQ(plans[i].clip->timestamps, ref.timestamps);
      EXPECT_EQ(p[i].clip->fps, ref.info.fps);
      continue;
    }
    const image::Patches ref =
        image::preprocess(noise_image(kSizes[i].first, kSizes[i].second, unsigned(i)), cfg.image, true);
    EXPECT_EQ(p[i].patches.grid, ref.grid);
    EXPECT_EQ(p[i].patches.raw, ref.raw);  // images: raw uint8, normalized by the encoder
    EXPECT_EQ(probe_input(files[i], names[i], cfg).tokens,
              visual_tokens(qwen3vl::load_model("synthetic:tiny").config, ref.grid));
  }
  EXPECT_EQ(p[1].error_message(), "input one cannot be read");
  EXPECT_HAS(p[3].error_message(), "input-3");
  // A hook that throws fails its input alone.
  hooks.planned = [](size_t i, const InputPlan&) {
    if (i == 0) fail("no room for input zero");
  };
  const std::vector<PreparedInput> q = prepare_inputs(
      {"a", "b"}, [&](size_t i) { return files[i == 0 ? 0 : 2]; }, cfg, hooks);
  EXPECT_EQ(q[0].error_message(), "no room for input zero");
  EXPECT_FALSE(q[1].error);
  // The kind is the bytes', whatever the name.
  EXPECT_EQ(input_kind(files[0]), InputKind::IMAGE);
  EXPECT_EQ(input_kind(files[clip]), InputKind::VIDEO);
  EXPECT_STREQ(input_kind_name(InputKind::VIDEO), "video");
}

#if FOVEA_HAVE_VIDEO
// Every clip's error names the clip, the plan's too (sampling and smart_resize say nothing of the
// clip themselves): a clip of one frame (fewer than the temporal patch) and one of 4000x16 (an aspect
// ratio over 200:1), through prepare_inputs and probe_input.
TEST(Pipeline, EveryClipErrorNamesItsClip) {
  TempDir dir;
  const auto make = [&](const std::string& name, const std::string& size, const std::string& args) {
    const std::string path = dir.file(name);
    const std::string cmd = "ffmpeg -v error -y -f lavfi -i testsrc2=size=" + size + ":rate=10:duration=1 " + args +
                            " -c:v libx264 -pix_fmt yuv420p -preset ultrafast '" + path + "'";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << "the ffmpeg command line (Debian package ffmpeg) is needed: " << cmd;
    const std::string s = slurp(path);
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  const std::vector<std::vector<uint8_t>> files = {make("one-frame.mp4", "64x48", "-frames:v 1"),
                                                   make("thin.mp4", "4000x16", "-frames:v 2")};
  ASSERT_FALSE(files[0].empty());
  ASSERT_FALSE(files[1].empty());
  InputConfig cfg = load_input_config("synthetic:tiny");
  cfg.limits.max_frame_pixels = int64_t(1) << 26;  // past the pixel check: the plan refuses it
  const std::vector<std::string> names = {"one-frame.mp4", "thin.mp4"};
  const std::vector<PreparedInput> p = prepare_inputs(
      names, [&](size_t i) { return files[i]; }, cfg);
  ASSERT_EQ(p.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(p[i].kind, InputKind::VIDEO);
    ASSERT_TRUE(p[i].error);
    EXPECT_EQ(p[i].error_message().rfind("video '" + names[i] + "': ", 0), 0u) << p[i].error_message();
    const std::string probed = error_of([&] { probe_input(files[i], names[i], cfg); });
    EXPECT_EQ(probed.rfind("video '" + names[i] + "': ", 0), 0u) << probed;
  }
  EXPECT_HAS(p[0].error_message(), "temporal_patch_size");
  EXPECT_HAS(p[1].error_message(), "aspect ratio");
}
#endif

// file_input_kind opens without blocking: a FIFO (a blocking open waits for a writer forever) and a
// device are refused at once. On a build that blocks, a writer comes after 3 s, so the test fails
// instead of hanging.
TEST(Pipeline, FileInputKindRefusesFifosAndDevicesAtOnce) {
  TempDir dir;
  const std::string fifo = dir.file("clip.mp4");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::atomic<bool> returned{false};
  std::thread writer([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!returned && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (returned) return;
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // a blocked reader is there: this opens
    if (fd >= 0) ::close(fd);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { file_input_kind(fifo); });
  returned = true;
  writer.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0 * kTimeScale);
  EXPECT_HAS(msg, "'" + fifo + "': is not a regular file (a FIFO)");
  EXPECT_HAS(error_of([] { file_input_kind("/dev/zero"); }), "'/dev/zero': is not a regular file (a device)");
  EXPECT_HAS(error_of([&] { read_input(fifo, load_input_config("synthetic:tiny")); }), "is not a regular file");
}

// Forwards of at most N tokens, in order, never splitting an input; one larger than N runs alone.
TEST(Pipeline, PackForwardsKeepsOrderAndTheLimit) {
  const std::vector<int64_t> tokens = {3, 4, 2, 9, 1, 1, 5};
  using Ranges = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(pack_forwards(tokens, 7), (Ranges{{0, 2}, {2, 3}, {3, 4}, {4, 7}}));
  EXPECT_EQ(pack_forwards(tokens, 100), (Ranges{{0, 7}}));
  EXPECT_EQ(pack_forwards(tokens, 1), (Ranges{{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}}));
  EXPECT_TRUE(pack_forwards({}, 7).empty());
  ForwardPacker f(5);
  EXPECT_TRUE(f.take(9));  // alone: an empty forward takes anything
  EXPECT_FALSE(f.take(1));
  EXPECT_EQ(f.tokens(), 9);
  EXPECT_EQ(f.inputs(), 1u);
}

TEST(Pipeline, BatchPacksAndSplitInputsCutsBackEveryRow) {
  qwen3vl::VisionConfig c;
  c.out_hidden = 3;
  const std::vector<qwen3vl::GridThw> grids = {{1, 2, 4}, {2, 2, 2}, {1, 4, 6}};  // 2, 2, 6 tokens
  Batch b;
  std::vector<float> expect;
  for (size_t i = 0; i < grids.size(); ++i) {
    image::Patches p;
    p.pixels.assign(size_t(grids[i][0] * grids[i][1] * grids[i][2]) * 5, float(i + 1));
    p.grid = grids[i];
    expect.insert(expect.end(), p.pixels.begin(), p.pixels.end());
    b.add(std::move(p));
    EXPECT_TRUE(p.pixels.empty());  // moved, no second copy
  }
  EXPECT_EQ(b.pixels, expect);
  EXPECT_EQ(b.grids, grids);
  EXPECT_EQ(b.tokens(c), 10);

  // Rows numbered 0..9, deepstack k = row + 100 k: every input must get exactly its rows.
  auto make = [&] {
    EncoderOutputs o;
    for (int r = 0; r < 10; ++r)
      for (int j = 0; j < 3; ++j) o.merged.push_back(float(r));
    o.deepstack = {o.merged, o.merged};
    for (auto& v : o.deepstack[1]) v += 100;
    return o;
  };
  const std::vector<F32Rows> parts = split_inputs(make(), grids, c);
  ASSERT_EQ(parts.size(), 3u);
  const int first[3] = {0, 2, 4}, count[3] = {2, 2, 6};
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(parts[size_t(i)].merged.size(), size_t(count[i] * 3));
    ASSERT_EQ(parts[size_t(i)].deepstack.size(), 2u);
    for (int r = 0; r < count[i]; ++r) {
      EXPECT_EQ(parts[size_t(i)].merged[size_t(r * 3)], float(first[i] + r));
      EXPECT_EQ(parts[size_t(i)].deepstack[1][size_t(r * 3 + 2)], float(first[i] + r + 100));
    }
  }
  EncoderOutputs short_by_one = make();
  short_by_one.merged.resize(27);
  EXPECT_HAS(error_of([&] { split_inputs(std::move(short_by_one), grids, c); }),
             "27 values for 3 inputs of 10 visual tokens");
  EncoderOutputs bad_deepstack = make();
  bad_deepstack.deepstack[0].pop_back();
  EXPECT_HAS(error_of([&] { split_inputs(std::move(bad_deepstack), grids, c); }), "deepstack output has 29 values");

  OutputTensors out(c);
  out.add(InputKind::IMAGE, grids[0], F32Rows(parts[0]));
  out.add(InputKind::IMAGE, grids[1], F32Rows(parts[1]));
  out.add(InputKind::IMAGE, grids[2], F32Rows(parts[2]));
  const std::vector<TensorToWrite> t(out.tensors().begin() + 8, out.tensors().end());  // image.2's
  ASSERT_EQ(t.size(), 4u);                                                             // embeddings, 2 deepstack, grid
  EXPECT_EQ(t[0].name, "image.2.embeddings");
  EXPECT_EQ(t[0].dtype, DType::F32);
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{6, 3}));
  EXPECT_EQ(t[2].name, "image.2.deepstack.1");
  EXPECT_EQ(t[3].name, "image.2.grid_thw");
  EXPECT_EQ(t[3].dtype, DType::F32);
  float g[3];
  ASSERT_EQ(t[3].data().size(), sizeof g);
  std::memcpy(g, t[3].data().data(), sizeof g);
  EXPECT_EQ(g[0], 1.f);
  EXPECT_EQ(g[1], 4.f);
  EXPECT_EQ(g[2], 6.f);
  EXPECT_HAS(error_of([&] { out.add(InputKind::IMAGE, grids[0], F32Rows(parts[2])); }),
             "18 embedding values, not 2 x 3");
}

// The bf16 split cuts the same rows as the fp32 one, as views into the outputs (no copy), and checks
// the counts the same way; OutputTensors writes its rows as BF16 tensors, the bits as they are, or
// widened to F32; a clip's tensors are named by its own count, with its timestamps and sampling.
TEST(Pipeline, Bf16SplitViewsEveryRowAndOutputTensorsWriteTheBits) {
  qwen3vl::VisionConfig c;
  c.out_hidden = 3;
  const std::vector<qwen3vl::GridThw> grids = {{1, 2, 4}, {2, 2, 2}, {1, 4, 6}};  // 2, 2, 6 tokens
  EncoderOutputsBf16 o;  // rows numbered 0..9 as bf16; deepstack k: row + 100 k
  for (int r = 0; r < 10; ++r)
    for (int j = 0; j < 3; ++j) o.merged.push_back(bf16_from_float(float(r)));
  o.deepstack = {o.merged, o.merged};
  for (auto& v : o.deepstack[1]) v = bf16_from_float(bf16_to_float(v) + 100);
  const std::vector<Bf16Rows> parts = split_inputs(rows_of(o), grids, c);
  ASSERT_EQ(parts.size(), 3u);
  const int first[3] = {0, 2, 4}, count[3] = {2, 2, 6};
  for (int i = 0; i < 3; ++i) {
    const Bf16Rows& p = parts[size_t(i)];
    EXPECT_EQ(p.merged.data(), o.merged.data() + first[i] * 3);  // a view, not a copy
    ASSERT_EQ(p.merged.size(), size_t(count[i] * 3));
    ASSERT_EQ(p.deepstack.size(), 2u);
    EXPECT_EQ(p.deepstack[1].data(), o.deepstack[1].data() + first[i] * 3);
    ASSERT_EQ(p.deepstack[1].size(), size_t(count[i] * 3));
    for (int r = 0; r < count[i]; ++r) {
      EXPECT_EQ(bf16_to_float(p.merged[size_t(r * 3)]), float(first[i] + r));
      EXPECT_EQ(bf16_to_float(p.deepstack[1][size_t(r * 3 + 2)]), float(first[i] + r + 100));
    }
  }
  EncoderOutputsBf16 short_by_one = o;
  short_by_one.merged.resize(27);
  EXPECT_HAS(error_of([&] { split_inputs(rows_of(short_by_one), grids, c); }),
             "27 values for 3 inputs of 10 visual tokens");
  EncoderOutputsBf16 bad_deepstack = o;
  bad_deepstack.deepstack[0].pop_back();
  EXPECT_HAS(error_of([&] { split_inputs(rows_of(bad_deepstack), grids, c); }), "deepstack output has 29 values");

  OutputTensors out(c);
  const ClipSampling sampling{{0, 7, 14, 21}, {0.25, 1.5}, 12};
  EXPECT_EQ(out.add(InputKind::VIDEO, grids[1], parts[1], false, sampling), "video.0");
  EXPECT_EQ(out.add(InputKind::IMAGE, grids[0], parts[0]), "image.0");
  EXPECT_EQ(out.add(InputKind::IMAGE, grids[0], parts[0], /*widen=*/true), "image.1");
  EXPECT_EQ(out.add(InputKind::IMAGE, grids[2], parts[2]), "image.2");
  const std::vector<TensorToWrite>& all = out.tensors();
  ASSERT_EQ(all.size(), 5u + 3 * 4);
  EXPECT_EQ(all[4].name, "video.0.timestamps");
  EXPECT_EQ(all[4].shape, std::vector<int64_t>{2});
  float ts[2];
  std::memcpy(ts, all[4].data().data(), sizeof ts);
  EXPECT_EQ(ts[1], 1.5f);
  EXPECT_EQ(out.meta.at("video.0.frame_indices"), "[0, 7, 14, 21]");
  EXPECT_EQ(out.meta.at("video.0.fps"), "12");
  EXPECT_EQ(all[9].name, "image.1.embeddings");  // widened: F32, the bf16 values exactly
  EXPECT_EQ(all[9].dtype, DType::F32);
  ASSERT_EQ(all[9].data().size(), parts[0].merged.size() * 4);
  for (size_t i = 0; i < parts[0].merged.size(); ++i) {
    float f;
    std::memcpy(&f, all[9].data().data() + 4 * i, 4);
    EXPECT_EQ(f, bf16_to_float(parts[0].merged[i]));
  }
  const std::vector<TensorToWrite> t(all.end() - 4, all.end());
  ASSERT_EQ(t.size(), 4u);  // embeddings, 2 deepstack, grid
  EXPECT_EQ(t[0].name, "image.2.embeddings");
  EXPECT_EQ(t[0].dtype, DType::BF16);
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{6, 3}));
  // BF16 rows are written as views of the outputs (no copy); the bytes are the rows' bits.
  ASSERT_EQ(t[0].data().size(), 6u * 3 * 2);
  EXPECT_TRUE(t[0].bytes.empty());
  EXPECT_EQ(t[0].data().data(), reinterpret_cast<const uint8_t*>(parts[2].merged.data()));
  EXPECT_EQ(t[2].name, "image.2.deepstack.1");
  EXPECT_EQ(t[2].dtype, DType::BF16);
  ASSERT_EQ(t[2].data().size(), 6u * 3 * 2);
  EXPECT_EQ(std::memcmp(t[2].data().data(), parts[2].deepstack[1].data(), t[2].data().size()), 0);
  EXPECT_EQ(t[3].name, "image.2.grid_thw");
  EXPECT_EQ(t[3].dtype, DType::F32);
  float g[3];
  ASSERT_EQ(t[3].data().size(), sizeof g);
  std::memcpy(g, t[3].data().data(), sizeof g);
  EXPECT_EQ(g[0], 1.f);
  EXPECT_EQ(g[1], 4.f);
  EXPECT_EQ(g[2], 6.f);
  EXPECT_HAS(error_of([&] { out.add(InputKind::IMAGE, grids[0], parts[2]); }), "18 embedding values, not 2 x 3");
  Bf16Rows short_deepstack = parts[0];
  short_deepstack.deepstack[1] = short_deepstack.deepstack[1].first(5);
  EXPECT_HAS(error_of([&] { out.add(InputKind::IMAGE, grids[0], short_deepstack); }),
             "deepstack 1 has 5 values, not 6");
}

// Packed attention never crosses images: three images encoded in one batch give, row for row, what
// each gives alone: exactly in BF16; in FP8 with dynamic scaling, whose scales follow the amax
// history of earlier batches, closely.
TEST(Pipeline, PackedBatchMatchesImagesRunAlone) {
  const qwen3vl::Model model = qwen3vl::load_model("synthetic:tiny");
  const InputConfig cfg = load_input_config("synthetic:tiny");
  std::vector<PreparedInput> p;
  for (size_t i = 0; i < 3; ++i)
    p.push_back(prepare_image(noise_image(kSizes[i].first, kSizes[i].second, unsigned(40 + i)), cfg));
  for (PreparedInput& x : p) image::normalize_raw(x.patches);  // the fp32 rows a Batch takes
  for (const char* dtype : {"bf16", "fp8"}) {
    SCOPED_TRACE(dtype);
    EngineOptions o;
    o.device = "cpu";
    o.dtype = dtype;
    const EngineConfig e = resolve_engine(o, query_system());
    EncoderRunner runner(model, e);
    Batch all;
    for (const auto& im : p) all.add(image::Patches(im.patches));
    const std::vector<F32Rows> packed = split_inputs(runner.run(all), all.grids, model.config);
    std::vector<const image::Patches*> ptrs;
    for (const PreparedInput& x : p) ptrs.push_back(&x.patches);
    if (std::string(dtype) == "bf16") EXPECT_EQ(runner.run(ptrs).merged, runner.run(all).merged);  // from patches
    for (size_t i = 0; i < p.size(); ++i) {
      Batch one;
      one.add(image::Patches(p[i].patches));
      const EncoderOutputs alone = runner.run(one);
      ASSERT_EQ(alone.merged.size(), size_t(visual_tokens(model.config, p[i].patches.grid) * model.config.out_hidden));
      ASSERT_EQ(packed[i].merged.size(), alone.merged.size());
      ASSERT_EQ(packed[i].deepstack.size(), alone.deepstack.size());
      if (std::string(dtype) == "bf16") {
        EXPECT_EQ(packed[i].merged, alone.merged) << "image " << i;
      } else {  // dynamic scales follow the batch's amax history: close, not equal
        const auto err = qwen3vl::embedding_error(packed[i].merged, alone.merged, model.config.out_hidden);
        EXPECT_LT(err.rel_l2, 0.05) << "image " << i;
      }
    }
    const EncoderOutputs no_ds = runner.run(all, false);
    EXPECT_TRUE(no_ds.deepstack.empty());
    if (std::string(dtype) == "bf16") {  // run_bf16: the same outputs, rounded to bf16 once
      const EncoderOutputs f = runner.run(all);
      const EncoderOutputsBf16 b = runner.run_bf16(all);
      ASSERT_EQ(b.merged.size(), f.merged.size());
      ASSERT_EQ(b.deepstack.size(), f.deepstack.size());
      for (size_t i = 0; i < f.merged.size(); ++i) ASSERT_EQ(b.merged[i], bf16_from_float(f.merged[i])) << i;
      for (size_t k = 0; k < f.deepstack.size(); ++k)
        for (size_t i = 0; i < f.deepstack[k].size(); ++i)
          ASSERT_EQ(b.deepstack[k][i], bf16_from_float(f.deepstack[k][i]));
      EXPECT_TRUE(runner.run_bf16(all, false).deepstack.empty());
    }
  }
}

// start() / finish(): two batches in flight, raw and normalized patches, give what run() gives,
// oldest first; a third start, a finish with nothing in flight, run() with batches in flight and
// a batch mixing raw and normalized patches are refused.
TEST(Pipeline, StartAndFinishPipelineBatchesInOrder) {
  const qwen3vl::Model model = qwen3vl::load_model("synthetic:tiny");
  const InputConfig cfg = load_input_config("synthetic:tiny");
  const auto make = [&](bool raw) {
    std::vector<PreparedInput> v;
    for (size_t i = 0; i < 4; ++i) {
      v.push_back(prepare_image(noise_image(kSizes[i].first, kSizes[i].second, unsigned(70 + i)), cfg));
      if (!raw)
        v.back().patches =
            image::preprocess(noise_image(kSizes[i].first, kSizes[i].second, unsigned(70 + i)), cfg.image);
    }
    return v;
  };
  const std::vector<PreparedInput> raw = make(true), norm = make(false);
  EngineOptions o;
  o.device = "cpu";
  const EngineConfig e = resolve_engine(o, query_system());
  EncoderRunner runner(model, e);
  Batch first, second;  // images 0-1 and 2-3
  for (size_t i = 0; i < 4; ++i) (i < 2 ? first : second).add(image::Patches(norm[i].patches));
  const EncoderOutputsBf16 want0 = runner.run_bf16(first), want1 = runner.run_bf16(second);

  runner.start({&raw[0].patches, &raw[1].patches}, true);
  runner.start({&norm[2].patches, &norm[3].patches}, true);
  EXPECT_EQ(runner.in_flight(), 2u);
  EXPECT_HAS(error_of([&] { runner.start({&raw[0].patches}, true); }), "2 batches started and not finished");
  EXPECT_HAS(error_of([&] { runner.run(first); }), "batches started and not finished");
  EncoderOutputsBf16 got;
  runner.finish(got);
  EXPECT_EQ(got.merged, want0.merged);
  EXPECT_EQ(got.deepstack, want0.deepstack);
  runner.finish(got);
  EXPECT_EQ(got.merged, want1.merged);
  EXPECT_EQ(got.deepstack, want1.deepstack);
  EXPECT_HAS(error_of([&] { runner.finish(got); }), "no batch started");
  // finish_views: the same bits, as views; with deepstack not asked for, none.
  for (const bool ds : {true, false}) {
    runner.start({&raw[2].patches, &raw[3].patches}, ds);
    const Bf16Rows v = runner.finish_views();
    EXPECT_TRUE(std::equal(v.merged.begin(), v.merged.end(), want1.merged.begin(), want1.merged.end()));
    ASSERT_EQ(v.deepstack.size(), ds ? want1.deepstack.size() : 0u);
    for (size_t k = 0; k < v.deepstack.size(); ++k)
      EXPECT_TRUE(std::equal(v.deepstack[k].begin(), v.deepstack[k].end(), want1.deepstack[k].begin(),
                             want1.deepstack[k].end()));
  }
  EXPECT_HAS(error_of([&] { runner.finish_views(); }), "no batch started");
  // A batch mixing raw and fp32 patches (images beside a video clip) takes the raw ones normalized
  // on the host: the same bits as the all-fp32 batch.
  runner.start({&raw[0].patches, &norm[1].patches}, true);
  runner.finish(got);
  EXPECT_EQ(got.merged, want0.merged);
  EXPECT_EQ(got.deepstack, want0.deepstack);
  image::Patches empty;
  empty.grid = {1, 2, 2};
  EXPECT_HAS(error_of([&] { runner.start({&raw[0].patches, &empty}, false); }), "without pixels");
  EXPECT_EQ(runner.in_flight(), 0u);
}

// ThreadCap bounds the threads parallel_for uses from this thread, and nested loops share it.
TEST(Threads, CapBoundsThreadsAndNestedLoopsShareIt) {
  const auto threads_used = [](int64_t n, const std::function<void(int64_t)>& inner) {
    std::mutex mu;
    std::set<std::thread::id> ids;
    parallel_for(n, [&](int64_t i) {
      {
        std::lock_guard lk(mu);
        ids.insert(std::this_thread::get_id());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      if (inner) inner(i);
    });
    return ids.size();
  };
  {
    ThreadCap cap(3);
    EXPECT_EQ(ThreadCap::current(), 3);
    EXPECT_LE(threads_used(64, {}), 3u);
    ThreadCap one(0);  // at least one
    EXPECT_EQ(ThreadCap::current(), 1);
    EXPECT_EQ(threads_used(16, {}), 1u);
  }
  EXPECT_EQ(ThreadCap::current(), hardware_threads());
  ThreadCap cap(8);
  std::atomic<size_t> most_inner{0};
  const size_t outer = threads_used(2, [&](int64_t) {
    const size_t used = threads_used(32, {});  // each of the 2 outer threads may start 4
    size_t m = most_inner.load();
    while (used > m && !most_inner.compare_exchange_weak(m, used)) {}
  });
  EXPECT_LE(outer, 2u);
  EXPECT_LE(most_inner.load(), 4u);
}
