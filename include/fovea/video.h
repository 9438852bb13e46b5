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
  double fps = 2;          // frames sampled per second of video
  int64_t num_frames = 0;  // > 0: exactly this many frames, whatever the length (fps is then unused)
  int64_t min_frames = 4, max_frames = 768;
  bool sample_frames = true;  // do_sample_frames; false: every frame (still at most kMaxFrames)
};

// The hard bounds, whatever a config says: frames decoded per clip and the clip's length.
constexpr int64_t kMaxFrames = 4096;
// Limits on what one clip may cost (fovea encode/serve flags; 0 keeps these defaults).
struct VideoLimits {
  double max_seconds = 3600;     // --max-video-seconds: the container's duration
  int64_t max_frame_pixels = 0;  // a frame's width x height; 0: image::image_pixel_limit of the image budget
  int64_t max_bytes_in_flight = int64_t(2) << 30;  // decoded frames held at once (native + resized), bytes
  double deadline_seconds = 300;                   // wall-clock limit on decoding one clip
  size_t max_encoded_bytes = size_t(2) << 30;      // the file itself
};

// Command-line overrides of a model's video preprocessing (0: keep the model's value).
struct VideoOverrides {
  double fps = 0;                          // --video-fps
  int64_t min_pixels = 0, max_pixels = 0;  // --video-min-pixels, --video-max-pixels
  int64_t max_frames = 0;                  // --video-max-frames
  double max_seconds = 0;                  // --max-video-seconds
};

// The text of a video_preprocessor_config.json (`where` names it in messages): the image fields
// as parse_preprocess_config reads them (size, patch/merge/temporal sizes, mean, std) and fps
// (0.01..240), num_frames, min_frames, max_frames (1..kMaxFrames, min <= max), do_sample_frames.
VideoConfig parse_video_config(std::string_view text, const std::string& where);
// A model's: its folder's video_preprocessor_config.json, or the class defaults (synthetic models,
// or the file absent); then the overrides; checked against the model's patch sizes like images.
VideoConfig load_video_config(const std::string& model, const VideoOverrides& overrides = {});
VideoLimits limits_from(const VideoOverrides& o);

// What a stream's own headers say of the pictures its decoder keeps, read from the codec's
// extradata or its first packets (`packets`, back to back): H.264 and HEVC sequence parameter sets
// (chroma format, bit depth, reference frames, reordering), VP9's profile, AV1's av1C; fixed for VP8,
// MPEG-4 Part 2, H.263 and MPEG-1 (8-bit 4:2:0). What a header does not say is taken at its most for
// the codec (4:4:4, 16-bit samples where the codec has them, 16 references and 16 reordered for H.264
// and HEVC). A stream that keeps more than its header said is refused by the decoder's pool
// (decode_opened), so what is reserved from these stays an upper bound.
struct StreamLayout {
  int chroma = 3;            // 1: 4:2:0 (and monochrome), 2: 4:2:2, 3: 4:4:4
  int sample_bytes = 1;      // 1: 8-bit samples; 2: 9 to 16 bits
  int refs = 16;             // reference pictures kept (H.264 max_num_ref_frames, HEVC's DPB size, VP9's 8 slots)
  int reorder = 0;           // pictures held back for presentation order
  bool from_header = false;  // read from a parameter set or header (else the codec's defaults)
  // The codec's own memory beside the frames, in bytes per pixel of the frame (FFmpeg 5.1, measured
  // at 4096x4096 and 8192x8192 with 1 to 4 threads; docs/video.md §What a clip reserves): per
  // picture (H.264: 0.55 of motion vectors and macroblock types) and per decoding thread (Theora: 3.2
  // of coefficient tables).
  double side_per_pixel = 1, thread_per_pixel = 1;
};
StreamLayout stream_layout(std::string_view codec, std::span<const uint8_t> extradata,
                           std::span<const uint8_t> packets);

// FFmpeg's contexts, libswscale's, and what the allocator keeps of opening (1 to 3 MB measured on
// clips of 64x48 to 640x360 in a process that has decoded a clip before: FFmpeg's one-time tables,
// about 7 MB, are the process's, not a clip's), and a quarter byte a pixel more for the frame size's.
constexpr int64_t kDecoderBaseBytes = int64_t(4) << 20;
// A decoding thread's own, whatever the frame size: its codec context, stack and allocator arena
// (up to 1.1 MB a thread measured from 2 to 8 threads on 64x48 and 160x120 H.264).
constexpr int64_t kThreadBaseBytes = int64_t(1) << 20;

// What a clip's decoder holds with `threads` threads: the pictures of its pool, each the frame in
// the stream's layout and the codec's per-picture data (counted by decode_opened's pool as the
// decoder allocates them: the pool refuses one past `pictures`), and each thread's tables. The
// pictures: those the stream keeps (its references and reordering: `held`) and the ones in flight:
// a frame-threaded decoder (H.264, HEVC, VP8, VP9, MPEG-4, Theora; libdav1d) holds two per thread,
// one decoding alone one (FFmpeg 5.1, measured with x264 streams of 1 to 16 references on 1 to 16
// threads: 2 x threads + references exactly, references + 1 on one thread).
struct DecoderCost {
  int64_t picture_bytes = 0;  // frame + per-picture data
  int64_t side_bytes = 0;     // the per-picture data alone (counted with each frame by the pool)
  int64_t thread_bytes = 0;   // kThreadBaseBytes and the codec's tables a thread
  int64_t base_bytes = 0;     // kDecoderBaseBytes and a quarter byte a pixel
  int held = 0;
  bool frame_threads = false;
  int64_t pictures(int threads) const { return held + (frame_threads && threads > 1 ? 2 * int64_t(threads) : 1); }
  int64_t pool_bytes(int threads) const { return pictures(threads) * picture_bytes; }
  int64_t bytes(int threads) const { return pool_bytes(threads) + threads * thread_bytes + base_bytes; }
};

// What a container says before any frame is decoded.
struct ClipInfo {
  std::string name, container, codec;
  int width = 0, height = 0;
  double fps = 0;      // the stream's average frame rate (24 when the container gives none, as transformers)
  int64_t frames = 0;  // the video stream's packets, counted (exact, as torchcodec's exact mode)
  double seconds = 0;  // frames / fps
  // The video packets' pts, sorted: frame i is shown at frame_pts[i]. Empty when a packet has none,
  // two share one, or one is marked discard (an edit list): decoding then counts frames instead.
  std::vector<int64_t> frame_pts;
  DecoderCost decoder;       // what decoding it holds in FFmpeg (stream_layout and the codec)
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
// 16 (FFmpeg's own ceiling for frame threads: more buy little, and each holds two pictures).
int decoding_threads();

// What preprocessing a clip will give, from its header alone (no frame decoded): the sampled
// frames, the size they are resized to, the grid, the timestamps, the decoding threads, and the
// memory decoding holds at its peak (peak_bytes; the server reserves it before decoding):
//   packets  the kept packets (ClipInfo::packet_bytes), and 24 bytes a packet while decoding (the
//            Clip's copy of the pts list, the flags of the frames sampled, the allocator's share);
//   decoder  DecoderCost::bytes(threads): its pool of pictures (decode_opened refuses one past
//            it), the threads' tables, FFmpeg's contexts;
//   frames   the native RGB frames of two resize batches (one resizing while the next decodes), never
//            more than the sampled frames; each frame being resized also holds its horizontal pass
//            (source height x resized width); the resized frames; the fp32 patches; and for a width
//            that is not a multiple of 16, the padded rows it is converted into.
// threads: the caller's decoding_threads(), fewer where the decoder would hold more than half of
// limits.max_bytes_in_flight (at 8192x8192 a frame thread holds two pictures of 143 MB).
// batch: native frames per resize batch: threads, fewer where the frames would pass
// limits.max_bytes_in_flight (0: they cannot fit; decode_opened refuses the clip).
// An encoder-cache hit needs nothing more.
struct ClipPlan {
  std::vector<int64_t> indices;
  int height = 0, width = 0;  // every sampled frame's size after resizing
  qwen3vl::GridThw grid{};
  std::vector<double> timestamps;
  int threads = 1;
  int64_t batch = 1;
  int64_t resized_bytes = 0, patch_bytes = 0, native_frame_bytes = 0, resize_pass_bytes = 0, convert_bytes = 0;
  int64_t packet_bytes = 0, sampling_bytes = 0;
  DecoderCost decoder;
  int64_t decoder_bytes() const { return decoder.bytes(threads); }
  int64_t frame_bytes() const;  // the frames' part, at its peak
  int64_t peak_bytes() const { return packet_bytes + sampling_bytes + decoder_bytes() + frame_bytes(); }
};
ClipPlan plan_clip(const ClipInfo& info, const VideoConfig& cfg, const VideoLimits& limits = {},
                   int threads = decoding_threads());

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

// ---- decoding (FFmpeg: src/video/decode-ffmpeg.cpp; decode_opened and decode_clip: video.cpp) ------
// Whether this build decodes video (FFmpeg's libraries found at build time), and their versions.
bool video_supported();
std::string ffmpeg_versions();  // "libavformat 59.27.100, libavcodec ..." or "" without

// What opening a container costs FFmpeg before fovea sees a frame, from the bytes alone
// (src/video/mp4-tables.cpp). MP4/MOV sample tables are walked first: a table box must hold the
// entries it lists, samples of one constant size cannot outnumber the file's bytes, nor a fragment's
// samples, and the index the demuxer will build (a sample each, copied once per edit) must stay
// under kMaxIndexEntries; anything else throws "video '<name>': ...". open_bytes bounds the memory
// of opening and probing: that index and the packets' records (kIndexEntryBytes a sample), the
// packets' data and other demuxers' indexes (2 x the file), the demuxer's buffers (kContainerBaseBytes).
constexpr int64_t kMaxIndexEntries = int64_t(1) << 21;
constexpr int64_t kDemuxerEntryBytes = 96;  // FFmpeg's index entry, sample size, times, edits' copies
constexpr int64_t kPacketRecordBytes = 48;  // a kept packet's record (25 in its deque) and pts (8), and slack
constexpr int64_t kIndexEntryBytes = kDemuxerEntryBytes + kPacketRecordBytes;
// The demuxer's buffers and state, and what the allocator keeps of packets read one by one (2 MB at
// 200,000 packets: a 16x16 clip of 200 s at 1000 fps in Matroska, in a process that has opened a
// clip before; FFmpeg's one-time tables, about 5 MB, are the process's).
constexpr int64_t kContainerBaseBytes = int64_t(4) << 20;
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

// Sample, decode, resize, patchify an opened clip: each sampled frame is converted to RGB
// (libswscale, the colour matrix and range the stream is tagged with, BT.601 limited range when it
// is not; bilinear chroma), resized to smart_resize_video's size as it is decoded, then patchified.
// Decoding uses plan_clip's threads (the calling thread's ThreadCap share of the cores, fewer for
// frames too large for them) for FFmpeg's frame threads and the resizes. The decoder is told the
// pixel limit, and a frame whose size is not the header's, or one past the plan's pool of pictures
// (DecoderCost::pool_bytes), is refused before it is allocated. At most two batches of decoded
// frames (ClipPlan::batch each) are held beside the resized ones (limits.max_bytes_in_flight).
Clip decode_opened(const OpenedClip& clip, const VideoConfig& cfg, const VideoLimits& limits,
                   Clock::time_point deadline);
// open_clip then decode_opened, with one deadline.
Clip decode_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoConfig& cfg,
                 const VideoLimits& limits = {}, const image::PreprocessConfig& image_budget = {});

}  // namespace fovea::video
