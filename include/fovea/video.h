// fovea/video.h: video clips to the encoder's pixel rows, as transformers' Qwen3VLVideoProcessor does it
// (docs/video.md): the container's frame count and rate, frame sampling (fps, min/max frames,
// numpy's linspace rounded half to even), decoding through FFmpeg's libraries (src/video/decode-ffmpeg.cpp)
// with each sampled frame converted to RGB and resized as it is decoded, smart_resize over
// frames x height x width with the video budget, the last frame repeated to fill the temporal patch,
// normalize and patchify into merge-window order, and the per-temporal-patch timestamps.
// Every bad input is a fovea::Error naming the clip.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fovea/clock.h"
#include "fovea/image.h"

namespace fovea::video {

// video_preprocessor_config.json (Qwen3VLVideoProcessor's class defaults when absent).
struct VideoConfig {
  int patch = 16, merge = 2, temporal = 2;
  int64_t min_pixels = 128 * 32 * 32, max_pixels = 768 * 32 * 32;  // size.shortest_edge / longest_edge: frames x h x w
  float mean[3] = {0.5f, 0.5f, 0.5f};
  float std[3] = {0.5f, 0.5f, 0.5f};
  double fps = 2;                 // frames sampled per second of video
  int64_t num_frames = 0;         // > 0: exactly this many frames, whatever the length (fps is then unused)
  int64_t min_frames = 4, max_frames = 768;
  bool sample_frames = true;      // do_sample_frames; false: every frame (still at most kMaxFrames)
};

// The hard bounds, whatever a config says: frames decoded per clip and the clip's length.
constexpr int64_t kMaxFrames = 4096;
// Limits on what one clip may cost (fovea encode/serve flags; 0 keeps these defaults).
struct VideoLimits {
  double max_seconds = 3600;                      // --max-video-seconds: the container's duration
  int64_t max_frame_pixels = 0;                   // a frame's width x height; 0: image::image_pixel_limit of the image budget
  int64_t max_bytes_in_flight = int64_t(2) << 30;  // decoded frames held at once (native + resized), bytes
  double deadline_seconds = 300;                  // wall-clock limit on decoding one clip
  size_t max_encoded_bytes = size_t(2) << 30;     // the file itself
};

// Command-line overrides of a model's video preprocessing (0: keep the model's value).
struct VideoOverrides {
  double fps = 0;                       // --video-fps
  int64_t min_pixels = 0, max_pixels = 0;  // --video-min-pixels, --video-max-pixels
  int64_t max_frames = 0;               // --video-max-frames
  double max_seconds = 0;               // --max-video-seconds
};

// The text of a video_preprocessor_config.json (`where` names it in messages): the image fields
// as parse_preprocess_config reads them (size, patch/merge/temporal sizes, mean, std) and fps
// (0.01..240), num_frames, min_frames, max_frames (1..kMaxFrames, min <= max), do_sample_frames.
VideoConfig parse_video_config(std::string_view text, const std::string& where);
// A model's: its folder's video_preprocessor_config.json, or the class defaults (synthetic models,
// or the file absent); then the overrides; checked against the model's patch sizes like images.
VideoConfig load_video_config(const std::string& model, const VideoOverrides& overrides = {});
VideoLimits limits_from(const VideoOverrides& o);

// What a container says before any frame is decoded.
struct ClipInfo {
  std::string name, container, codec;
  int width = 0, height = 0;
  double fps = 0;          // the stream's average frame rate (24 when the container gives none, as transformers)
  int64_t frames = 0;      // the video stream's packets, counted (exact, as torchcodec's exact mode)
  double seconds = 0;      // frames / fps
  // The video packets' pts, sorted: frame i is shown at frame_pts[i]. Empty when a packet has none,
  // two share one, or one is marked discard (an edit list): decoding then counts frames instead.
  std::vector<int64_t> frame_pts;
  // One frame as the decoder holds it: the stream's pixel format at the header's size, its planes
  // padded as FFmpeg pads them (3 bytes a pixel when the header does not name the format).
  int64_t decoder_frame_bytes = 0;
  int64_t packet_bytes = 0;  // the video packets open_clip keeps for decoding (data and bookkeeping)
};

// numpy.linspace(0, total - 1, n).round(): n frame indices over a clip of `total` frames.
std::vector<int64_t> linspace_indices(int64_t total, int64_t n);
// Qwen3VLVideoProcessor.sample_frames: the frames kept of a clip of `total` frames at `clip_fps`.
std::vector<int64_t> sample_indices(int64_t total, double clip_fps, const VideoConfig& cfg);
// smart_resize over frames: the size (h, w) every frame of a clip of `frames` sampled frames of
// height x width is resized to; the budget counts round(frames / temporal) * temporal frames.
// Throws (as transformers) for fewer frames than the temporal patch or an aspect ratio over 200.
std::pair<int, int> smart_resize_video(int64_t frames, int height, int width, const VideoConfig& cfg);
// Per temporal patch: the mean of its frames' times (index / fps; the last index repeated to fill
// the patch), in seconds.
std::vector<double> patch_timestamps(const std::vector<int64_t>& indices, double clip_fps, int temporal);

// Frames already resized (all the same size, a multiple of patch * merge) to patch rows: the last
// frame repeated to a multiple of the temporal patch, normalized as images are, rows in
// merge-window order within each temporal patch, columns (c, t, py, px). grid = {T', h/p, w/p}.
image::Patches patchify_frames(const std::vector<image::Rgb8>& frames, const VideoConfig& cfg);

// The threads a clip's decoder uses: the calling thread's share of the cores (ThreadCap), at most
// 16 (FFmpeg's own ceiling for frame threads: more buy little, and each holds a frame).
int decoding_threads();

// Frames a decoder may hold besides one per thread: the most reference frames any whitelisted codec
// keeps (16 for H.264 and HEVC), the frame being output and one held back for reordering.
constexpr int64_t kDecoderHeldFrames = 18;

// What preprocessing a clip will give, from its header alone (no frame decoded): the sampled
// frames, the size they are resized to, the grid, the timestamps, and the memory decoding holds at
// its peak: the kept packets, the decoder's frame pool (one frame per decoding thread plus
// kDecoderHeldFrames; decode_opened refuses a frame past it), the resized frames, the fp32 patches,
// and two batches of native RGB frames, one per thread each (one batch resizing while the next
// decodes). An encoder-cache hit needs nothing more; the server reserves peak_bytes before decoding.
struct ClipPlan {
  std::vector<int64_t> indices;
  int height = 0, width = 0;  // every sampled frame's size after resizing
  qwen3vl::GridThw grid{};
  std::vector<double> timestamps;
  int64_t resized_bytes = 0, patch_bytes = 0, native_frame_bytes = 0, packet_bytes = 0, decoder_frame_bytes = 0;
  int64_t decoder_bytes(int threads) const { return (threads + kDecoderHeldFrames) * decoder_frame_bytes; }
  int64_t peak_bytes(int threads) const {
    return packet_bytes + decoder_bytes(threads) + resized_bytes + patch_bytes + 2 * int64_t(threads) * native_frame_bytes;
  }
};
ClipPlan plan_clip(const ClipInfo& info, const VideoConfig& cfg);

// A clip, preprocessed.
struct Clip {
  ClipInfo info;
  std::vector<int64_t> indices;    // the sampled frames
  std::vector<double> timestamps;  // per temporal patch, seconds
  image::Patches patches;          // fp32 pixels, grid {t, h, w}
  int64_t frames_decoded = 0;      // decode_clip: frames the decoder produced (unsampled B-frames are skipped)
  // Wall time (decode_clip overlaps decoding and resizing): start to the last frame decoded, then the
  // rest (the last resizes and patchify); preprocess_frames: 0 and its resize and patchify.
  double decode_ms = 0, preprocess_ms = 0;
};

// Sampled frames at their decoded size (as a golden file gives them) to a Clip: resize, patchify,
// timestamps. indices and clip_fps are the clip's (for the timestamps).
Clip preprocess_frames(const std::vector<image::Rgb8>& frames, const std::vector<int64_t>& indices, double clip_fps,
                       const VideoConfig& cfg);

// Whether these bytes start like a video container fovea reads (MP4/MOV/3GP, Matroska/WebM, AVI,
// MPEG-TS, FLV, Ogg), from their magic numbers alone.
bool looks_like_video(std::span<const uint8_t> bytes);

// ---- decoding (FFmpeg; src/video/decode-ffmpeg.cpp) -------------------------------------------------
// Whether this build decodes video (FFmpeg's libraries found at build time), and their versions.
bool video_supported();
std::string ffmpeg_versions();  // "libavformat 59.27.100, libavcodec ..." or "" without

// What opening a container costs FFmpeg before fovea sees a frame, from the bytes alone
// (src/video/mp4-tables.cpp). MP4/MOV sample tables are walked first: a table box must hold the
// entries it lists, samples of one constant size cannot outnumber the file's bytes, nor a fragment's
// samples, and the index the demuxer will build (a sample each, copied once per edit) must stay
// under kMaxIndexEntries; anything else throws "video '<name>': ...". open_bytes bounds the memory
// of opening and probing: that index, the demuxer's buffers and the packets kept.
constexpr int64_t kMaxIndexEntries = int64_t(1) << 21;
constexpr int64_t kIndexEntryBytes = 96;                   // FFmpeg's index entry, sample size, times, edits' copies
constexpr int64_t kContainerBaseBytes = int64_t(4) << 20;  // the demuxer's buffers and state
struct ContainerCost {
  int64_t index_entries = 0;
  int64_t open_bytes = 0;
  bool iso_bmff = false;  // the tables were walked: only then may FFmpeg's MP4/MOV demuxer open the bytes
};
ContainerCost container_cost(std::span<const uint8_t> bytes, const std::string& name);

// A clip opened once: its header read, its video packets counted, their timestamps listed and the
// packets kept (at most open_bytes of them), the container closed again. decode_opened decodes from
// the kept packets, so a clip is demuxed once whatever the passes.
struct OpenedClip {
  ClipInfo info;
  int64_t max_frame_pixels = 0;  // the pixel limit it was opened under: its decoder's too
  Clock::time_point opened_at;   // when opening began (a deadline's message says how long it gave)
  struct Packets;
  std::shared_ptr<const Packets> packets;
};

// Opens a clip (container_cost's checks first): throws "video '<name>': ..." for an unknown or
// refused container or codec, no video stream, an empty or over-limit size, a frame over
// limits.max_frame_pixels, a clip over limits.max_seconds or kMaxFrames, a file over
// limits.max_encoded_bytes, packets past open_bytes, or the deadline (one absolute time for the
// whole clip: opening and decoding share it).
OpenedClip open_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoLimits& limits,
                     const image::PreprocessConfig& image_budget, Clock::time_point deadline);
Clock::time_point deadline_of(const VideoLimits& limits);  // now + limits.deadline_seconds

// open_clip's ClipInfo (its own deadline from limits).
ClipInfo probe_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoLimits& limits = {},
                    const image::PreprocessConfig& image_budget = {});

// Sample, decode, resize, patchify an opened clip: each sampled frame is converted to RGB
// (libswscale, the colour matrix and range the stream is tagged with, BT.601 limited range when it
// is not; bilinear chroma), resized to smart_resize_video's size as it is decoded, then patchified.
// Decoding uses the calling thread's ThreadCap share of the cores (FFmpeg's frame threads and the
// resizes). The decoder is told the pixel limit, and a frame whose size is not the header's, or one
// past the plan's frame pool (ClipPlan::decoder_bytes), is refused before it is allocated. At most
// one decoded frame per thread is held beside the resized ones (limits.max_bytes_in_flight).
Clip decode_opened(const OpenedClip& clip, const VideoConfig& cfg, const VideoLimits& limits, Clock::time_point deadline);
// open_clip then decode_opened, with one deadline.
Clip decode_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoConfig& cfg,
                 const VideoLimits& limits = {}, const image::PreprocessConfig& image_budget = {});
Clip decode_clip_file(const std::string& path, const VideoConfig& cfg, const VideoLimits& limits = {},
                      const image::PreprocessConfig& image_budget = {});

// The frames at `indices` (sorted, unique), decoded and converted to RGB at their own size: what the
// golden tools compare against another decoder. Bounded like decode_clip.
std::vector<image::Rgb8> decode_frames(std::span<const uint8_t> bytes, const std::string& name,
                                       const std::vector<int64_t>& indices, const VideoLimits& limits = {});

}  // namespace fovea::video
