// Video decoding through FFmpeg's libraries (docs/video.md §Decoding): the container is read from
// memory (no file or network access by FFmpeg), only the video stream is demuxed, a short list of
// containers and video codecs is accepted, and a deadline interrupts demuxing and decoding.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>

#include <fmt/format.h>

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/log.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/threads.h"
#include "fovea/video.h"

namespace fovea::video {

namespace {

// Containers and codecs fovea opens: what phones, cameras, screen recorders and the web produce.
constexpr const char* kFormats = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,ogg";
constexpr const char* kCodecs = "h264,hevc,vp8,vp9,libvpx,libvpx-vp9,av1,libdav1d,libaom-av1,mpeg4,mpeg1video,mpeg2video,"
                                "mjpeg,theora,h263";
constexpr int64_t kMaxTotalFrames = int64_t(1) << 22;  // whatever the frame rate claims

// FFmpeg's own log lines are kept, not printed: the last error-level line of this thread goes into
// the error message.
thread_local std::string last_log;
void log_callback(void*, int level, const char* format, va_list args) {
  if (level > AV_LOG_ERROR) return;
  char line[256];
  std::vsnprintf(line, sizeof line, format, args);
  last_log = line;
  while (!last_log.empty() && (last_log.back() == '\n' || last_log.back() == ' ')) last_log.pop_back();
}
void init_ffmpeg() {
  static std::once_flag once;
  std::call_once(once, [] {
    av_log_set_level(AV_LOG_ERROR);
    av_log_set_callback(log_callback);
  });
}

std::string av_error(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(err, buf, sizeof buf);
  std::string s = buf;
  if (!last_log.empty() && last_log != s) s += " (" + last_log + ")";
  return s;
}

struct Source {
  std::span<const uint8_t> bytes;
  size_t pos = 0;
  Clock::time_point deadline;
};

int read_cb(void* opaque, uint8_t* buf, int size) {
  auto* s = static_cast<Source*>(opaque);
  const size_t n = std::min(size_t(std::max(size, 0)), s->bytes.size() - s->pos);
  if (n == 0) return AVERROR_EOF;
  std::memcpy(buf, s->bytes.data() + s->pos, n);
  s->pos += n;
  return int(n);
}

int64_t seek_cb(void* opaque, int64_t offset, int whence) {
  auto* s = static_cast<Source*>(opaque);
  const int64_t size = int64_t(s->bytes.size());
  int64_t to;
  switch (whence & ~AVSEEK_FORCE) {
    case AVSEEK_SIZE: return size;
    case SEEK_SET: to = offset; break;
    case SEEK_CUR: to = int64_t(s->pos) + offset; break;
    case SEEK_END: to = size + offset; break;
    default: return AVERROR(EINVAL);
  }
  if (to < 0 || to > size) return AVERROR(EINVAL);
  s->pos = size_t(to);
  return to;
}

int interrupt_cb(void* opaque) { return Clock::now() > static_cast<Source*>(opaque)->deadline ? 1 : 0; }

// One opened container with its video stream chosen.
struct Demuxer {
  Source src;
  AVFormatContext* fmt = nullptr;
  AVIOContext* io = nullptr;
  int stream = -1;
  const AVCodec* codec = nullptr;

  Demuxer(std::span<const uint8_t> bytes, const std::string& name, Clock::time_point deadline) {
    try {
      open(bytes, name, deadline);
    } catch (...) {
      close();  // a constructor that throws runs no destructor: what open() allocated is freed here
      throw;
    }
  }
  void open(std::span<const uint8_t> bytes, const std::string& name, Clock::time_point deadline) {
    init_ffmpeg();
    last_log.clear();
    src = {bytes, 0, deadline};
    fmt = avformat_alloc_context();
    auto* buf = static_cast<uint8_t*>(av_malloc(1 << 16));
    if (fmt && buf) io = avio_alloc_context(buf, 1 << 16, 0, &src, read_cb, nullptr, seek_cb);
    if (!io) {
      av_free(buf);
      fail("video '{}': out of memory opening it", name);
    }
    fmt->pb = io;
    fmt->flags |= AVFMT_FLAG_CUSTOM_IO;
    fmt->interrupt_callback = {interrupt_cb, &src};
    AVDictionary* opts = nullptr;
    av_dict_set(&opts, "format_whitelist", kFormats, 0);
    AVFormatContext* f = fmt;
    const int err = avformat_open_input(&f, "", nullptr, &opts);
    av_dict_free(&opts);
    if (err < 0) {
      fmt = nullptr;  // freed by avformat_open_input
      if (Clock::now() > deadline) fail("video '{}': reading the container took longer than the deadline", name);
      fail("video '{}': not a video fovea reads (MP4/MOV, WebM/MKV, AVI, MPEG-TS, FLV, Ogg): {}", name, av_error(err));
    }
    stream = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
    if (stream < 0) fail("video '{}': the {} container has no video stream", name, fmt->iformat->name);
    AVCodecParameters* par = fmt->streams[stream]->codecpar;
    if (par->width <= 0 || par->height <= 0) {
      // Headers without the frame size (rare: some MPEG-TS): probe the stream, decoders whitelisted.
      fmt->codec_whitelist = av_strdup(kCodecs);
      for (unsigned i = 0; i < fmt->nb_streams; ++i)
        if (int(i) != stream) fmt->streams[i]->discard = AVDISCARD_ALL;
      const int e = avformat_find_stream_info(fmt, nullptr);
      if (e < 0) fail("video '{}': reading its stream parameters: {}", name, av_error(e));
    }
    for (unsigned i = 0; i < fmt->nb_streams; ++i)
      if (int(i) != stream) fmt->streams[i]->discard = AVDISCARD_ALL;
    codec = avcodec_find_decoder(par->codec_id);
    if (!codec) fail("video '{}': no decoder for its {} video", name, avcodec_get_name(par->codec_id));
  }
  ~Demuxer() { close(); }
  void close() {
    if (fmt) avformat_close_input(&fmt);
    if (io) {
      av_freep(&io->buffer);
      avio_context_free(&io);
    }
  }
  Demuxer(const Demuxer&) = delete;
  Demuxer& operator=(const Demuxer&) = delete;
  AVStream* st() const { return fmt->streams[stream]; }
};

struct Packet {
  AVPacket* p = av_packet_alloc();
  ~Packet() { av_packet_free(&p); }
};

ClipInfo probe_with(Demuxer& d, const std::string& name, const VideoLimits& limits, const image::PreprocessConfig& budget) {
  ClipInfo info;
  info.name = name;
  info.container = d.fmt->iformat->name;
  const AVCodecParameters* par = d.st()->codecpar;
  info.codec = avcodec_get_name(par->codec_id);
  info.width = par->width;
  info.height = par->height;
  if (info.width <= 0 || info.height <= 0) fail("video '{}': its frame size {}x{} is empty", name, info.width, info.height);
  const int64_t max_px = limits.max_frame_pixels > 0 ? limits.max_frame_pixels : image::image_pixel_limit(budget);
  if (int64_t(info.width) * info.height > max_px)
    fail("video '{}': frames of {}x{} exceed the limit of {} pixels (--max-image-pixels)", name, info.width, info.height, max_px);
  AVRational r = d.st()->avg_frame_rate;
  if (r.num <= 0 || r.den <= 0) r = d.st()->r_frame_rate;
  info.fps = r.num > 0 && r.den > 0 ? av_q2d(r) : 24.0;  // transformers' fallback
  if (!(info.fps >= 0.01 && info.fps <= 1000)) fail("video '{}': its frame rate {} is not in [0.01, 1000]", name, info.fps);
  const int64_t cap = std::min<int64_t>(kMaxTotalFrames, int64_t(limits.max_seconds * info.fps) + 1);
  bool pts_usable = true;
  Packet pkt;
  for (;;) {
    const int e = av_read_frame(d.fmt, pkt.p);
    if (e == AVERROR_EOF) break;
    if (e < 0) {
      if (Clock::now() > d.src.deadline) fail("video '{}': reading the container took longer than the deadline", name);
      fail("video '{}': corrupt {} container: {}", name, info.container, av_error(e));
    }
    if (pkt.p->stream_index == d.stream) {
      if (++info.frames > cap)
        fail("video '{}': over {} frames at {:.3g} fps, longer than the limit of {} s (--max-video-seconds)", name, cap,
             info.fps, limits.max_seconds);
      pts_usable = pts_usable && pkt.p->pts != AV_NOPTS_VALUE && !(pkt.p->flags & AV_PKT_FLAG_DISCARD);
      if (pts_usable) info.frame_pts.push_back(pkt.p->pts);
    }
    av_packet_unref(pkt.p);
  }
  if (info.frames == 0) fail("video '{}': its video stream has no frames", name);
  std::sort(info.frame_pts.begin(), info.frame_pts.end());
  if (!pts_usable || std::adjacent_find(info.frame_pts.begin(), info.frame_pts.end()) != info.frame_pts.end())
    std::vector<int64_t>().swap(info.frame_pts);
  info.seconds = double(info.frames) / info.fps;
  return info;
}

Clock::time_point deadline_of(const VideoLimits& l) {
  return Clock::now() + from_seconds(std::max(0.0, l.deadline_seconds));
}

void check_size(std::span<const uint8_t> bytes, const std::string& name, const VideoLimits& limits) {
  if (bytes.empty()) fail("video '{}': empty file", name);
  if (bytes.size() > limits.max_encoded_bytes)
    fail("video '{}': {} bytes, over the limit of {}", name, bytes.size(), limits.max_encoded_bytes);
}

// One decoding pass over the clip, handing over the frames at `indices` (sorted; repeats allowed) as
// RGB at their decoded size: take(j, frame) for j = 0, 1, ... in order, on this thread.
// skip (with info.frame_pts): a packet whose frame is not sampled is sent with skip_frame = NONREF,
// so the decoder drops it when no other frame refers to it (most B-frames: on a 60 s x264 clip 785
// of 1800 frames, and 40% of the decoding time), and each decoded frame is placed by its pts.
// Returns the frames decoded, or -1, having stopped, if a frame is not where the probe's pts put it
// (a pts the probe did not list, one placed before its predecessor, or one past a sampled frame
// that never came: a decoder dropping frames): the caller then decodes again, counting.
int64_t decode_pass(std::span<const uint8_t> bytes, const ClipInfo& info, const std::vector<int64_t>& indices,
                 const VideoLimits& limits, const std::function<void(size_t, image::Rgb8&&)>& take, bool skip) {
  const std::string& name = info.name;
  std::vector<char> sampled;
  if (skip) {
    sampled.assign(info.frame_pts.size(), 0);
    for (const int64_t i : indices) sampled[size_t(i)] = 1;
  }
  const auto index_of = [&](int64_t pts) -> int64_t {  // the frame shown at pts, or -1
    const auto it = std::lower_bound(info.frame_pts.begin(), info.frame_pts.end(), pts);
    return it != info.frame_pts.end() && *it == pts ? int64_t(it - info.frame_pts.begin()) : -1;
  };
  bool misplaced = false;
  int64_t last_at = -1;  // frames come out in presentation order, so their pts indices rise
  Demuxer d(bytes, name, deadline_of(limits));
  AVCodecContext* ctx = avcodec_alloc_context3(d.codec);
  if (!ctx) fail("video '{}': out of memory opening its decoder", name);
  struct Owned {
    AVCodecContext*& c;
    AVFrame* f = av_frame_alloc();
    SwsContext* sws = nullptr;
    std::vector<uint8_t> rows{};  // RGB rows with room to spare, for widths libswscale cannot pack
    ~Owned() {
      av_frame_free(&f);
      sws_freeContext(sws);
      avcodec_free_context(&c);
    }
  } own{ctx};
  avcodec_parameters_to_context(ctx, d.st()->codecpar);
  ctx->thread_count = 0;  // FFmpeg picks (the cores)
  ctx->codec_whitelist = av_strdup(kCodecs);
  if (const int e = avcodec_open2(ctx, d.codec, nullptr); e < 0)
    fail("video '{}': cannot decode its {} video: {}", name, info.codec, av_error(e));
  size_t j = 0;
  int64_t k = 0;  // frames decoded so far, in presentation order
  const auto frame_out = [&]() {
    AVFrame* f = own.f;
    if (f->width != info.width || f->height != info.height)
      fail("video '{}': frame {} is {}x{}, the stream said {}x{} (a size change mid-stream is not supported)", name, k,
           f->width, f->height, info.width, info.height);
    const int64_t at = skip ? index_of(f->pts) : k;  // this frame's index in presentation order
    if (skip && (at <= last_at || (j < indices.size() && at > indices[j]))) {
      misplaced = true;
      return;
    }
    last_at = at;
    if (j < indices.size() && indices[j] == at) {
      const auto pf = AVPixelFormat(f->format);
      own.sws = sws_getCachedContext(own.sws, f->width, f->height, pf, f->width, f->height, AV_PIX_FMT_RGB24, SWS_BILINEAR,
                                     nullptr, nullptr, nullptr);
      if (!own.sws) fail("video '{}': cannot convert its {} frames to RGB", name, av_get_pix_fmt_name(pf) ? av_get_pix_fmt_name(pf) : "?");
      // The stream's colour matrix (BT.601 when untagged, libswscale's default) and range (limited
      // unless tagged full or a yuvj format), to full-range RGB.
      const int cs = f->colorspace == AVCOL_SPC_UNSPECIFIED || f->colorspace == AVCOL_SPC_RGB ? SWS_CS_DEFAULT : int(f->colorspace);
      const AVPixFmtDescriptor* desc = av_pix_fmt_desc_get(pf);
      const bool full = f->color_range == AVCOL_RANGE_JPEG || (desc && std::strncmp(desc->name, "yuvj", 4) == 0);
      if (desc && !(desc->flags & AV_PIX_FMT_FLAG_RGB))
        sws_setColorspaceDetails(own.sws, sws_getCoefficients(cs), full ? 1 : 0, sws_getCoefficients(SWS_CS_DEFAULT), 1, 0,
                                 1 << 16, 1 << 16);
      image::Rgb8 rgb;
      rgb.width = f->width;
      rgb.height = f->height;
      rgb.name = name;
      // libswscale's SIMD paths for yuv420p/yuv422p convert whole groups of 16 pixels. With rows
      // packed back to back, a width that is not a multiple of 16 either leaves a row's last pixels
      // unconverted (width % 16 in 1..7) or writes up to 45 bytes past the frame (8..15) (measured on
      // FFmpeg 5.1, widths 1-1100; an 854x480 clip is one). Such frames are converted into rows with
      // 64 bytes or more to spare (the last row's overrun included), then packed.
      const size_t row = size_t(rgb.width) * 3;
      rgb.data.resize(row * rgb.height);
      const bool packed = rgb.width % 16 == 0;
      const int stride = packed ? int(row) : int((row + 63) / 64 * 64 + 64);
      if (!packed) own.rows.resize(size_t(stride) * rgb.height);
      uint8_t* dst[4] = {packed ? rgb.data.data() : own.rows.data(), nullptr, nullptr, nullptr};
      const int strides[4] = {stride, 0, 0, 0};
      if (sws_scale(own.sws, f->data, f->linesize, 0, f->height, dst, strides) != f->height)
        fail("video '{}': converting frame {} to RGB failed", name, at);
      if (!packed)
        for (int y = 0; y < rgb.height; ++y) std::memcpy(rgb.data.data() + row * y, own.rows.data() + size_t(stride) * y, row);
      while (j + 1 < indices.size() && indices[j + 1] == at) take(j++, image::Rgb8(rgb));
      take(j++, std::move(rgb));
    }
    ++k;
  };
  const auto drain = [&]() {
    for (;;) {
      const int e = avcodec_receive_frame(ctx, own.f);
      if (e == AVERROR(EAGAIN) || e == AVERROR_EOF) return;
      if (e < 0) fail("video '{}': corrupt {} video at frame {}: {}", name, info.codec, k, av_error(e));
      frame_out();
      av_frame_unref(own.f);
      if (misplaced) return;
      if (Clock::now() > d.src.deadline)
        fail("video '{}': decoding took longer than the limit of {} s", name, limits.deadline_seconds);
    }
  };
  Packet pkt;
  while (j < indices.size()) {
    const int e = av_read_frame(d.fmt, pkt.p);
    if (e == AVERROR_EOF) break;
    if (e < 0) {
      if (Clock::now() > d.src.deadline) fail("video '{}': decoding took longer than the limit of {} s", name, limits.deadline_seconds);
      fail("video '{}': corrupt {} container: {}", name, info.container, av_error(e));
    }
    if (pkt.p->stream_index == d.stream) {
      if (skip) {  // the setting travels with the packet (frame threads copy it at submission)
        const int64_t at = index_of(pkt.p->pts);
        ctx->skip_frame = at >= 0 && !sampled[size_t(at)] ? AVDISCARD_NONREF : AVDISCARD_DEFAULT;
      }
      const int s = avcodec_send_packet(ctx, pkt.p);
      if (s < 0 && s != AVERROR(EAGAIN)) fail("video '{}': corrupt {} video at frame {}: {}", name, info.codec, k, av_error(s));
      drain();
    }
    av_packet_unref(pkt.p);
    if (misplaced) return -1;
  }
  if (j < indices.size()) {
    avcodec_send_packet(ctx, nullptr);  // flush the frames the decoder holds back
    drain();
  }
  if (skip && (misplaced || j < indices.size())) return -1;
  if (j < indices.size())
    fail("video '{}': the container lists {} frames, but decoding gave {} (frame {} was asked for)", name, info.frames, k,
         indices[j]);
  return k;
}

// Decodes the frames at `indices` (see decode_pass): skipping the frames nobody sampled where the
// probe placed every frame by its pts, counting every frame where it did not or where that failed.
// Returns the frames decoded.
int64_t decode_indices(std::span<const uint8_t> bytes, const ClipInfo& info, const std::vector<int64_t>& indices,
                       const VideoLimits& limits, const std::function<void(size_t, image::Rgb8&&)>& take) {
  if (!info.frame_pts.empty() && int64_t(info.frame_pts.size()) == info.frames)
    if (const int64_t n = decode_pass(bytes, info, indices, limits, take, true); n >= 0) return n;
  return decode_pass(bytes, info, indices, limits, take, false);
}

}  // namespace

bool video_supported() { return true; }

std::string ffmpeg_versions() {
  const auto v = [](unsigned x) { return fmt::format("{}.{}.{}", x >> 16, (x >> 8) & 255, x & 255); };
  return fmt::format("libavformat {}, libavcodec {}, libswscale {}", v(avformat_version()), v(avcodec_version()),
                     v(swscale_version()));
}

ClipInfo probe_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoLimits& limits,
                    const image::PreprocessConfig& budget) {
  check_size(bytes, name, limits);
  Demuxer d(bytes, name, deadline_of(limits));
  return probe_with(d, name, limits, budget);
}

std::vector<image::Rgb8> decode_frames(std::span<const uint8_t> bytes, const std::string& name,
                                       const std::vector<int64_t>& indices, const VideoLimits& limits) {
  const ClipInfo info = probe_clip(bytes, name, limits);
  for (size_t i = 0; i < indices.size(); ++i)
    if (indices[i] < 0 || indices[i] >= info.frames || (i && indices[i] < indices[i - 1]))
      fail("video '{}': frame indices must be sorted within 0..{}", name, info.frames - 1);
  const int64_t bytes_needed = int64_t(indices.size()) * info.width * info.height * 3;
  if (bytes_needed > limits.max_bytes_in_flight)
    fail("video '{}': {} frames of {}x{} need {} bytes, over the limit of {}", name, indices.size(), info.width, info.height,
         bytes_needed, limits.max_bytes_in_flight);
  std::vector<image::Rgb8> out(indices.size());
  decode_indices(bytes, info, indices, limits, [&](size_t j, image::Rgb8&& f) { out[j] = std::move(f); });
  return out;
}

Clip decode_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoConfig& cfg, const VideoLimits& limits,
                 const image::PreprocessConfig& budget) {
  const auto t0 = Clock::now();
  Clip c;
  c.info = probe_clip(bytes, name, limits, budget);
  try {
    const ClipPlan plan = plan_clip(c.info, cfg);
    c.indices = plan.indices;
    const int h = plan.height, w = plan.width;
    // Decoding (this thread, and FFmpeg's frame threads) and resizing (the cores) overlap: each batch
    // of decoded frames is resized on the other threads while the next batch decodes. Memory: the
    // resized frames, the patches, and two batches of native frames (one resizing, one filling).
    const int64_t room = limits.max_bytes_in_flight - plan.resized_bytes - plan.patch_bytes;
    const int64_t batch = std::min<int64_t>(std::max(1, hardware_threads()), room / (2 * plan.native_frame_bytes));
    if (batch < 1)
      fail("{} frames resized to {}x{} with frames of {}x{} decoding need more than the limit of {} bytes", c.indices.size(), w,
           h, c.info.width, c.info.height, limits.max_bytes_in_flight);
    std::vector<image::Rgb8> sized(c.indices.size());
    struct Batch {
      std::vector<image::Rgb8> frames;
      std::vector<size_t> at;
    };
    Batch pending;
    std::future<void> resizing;  // the previous batch's resize
    Clock::time_point decoded_at;
    const auto flush = [&] {
      if (resizing.valid()) resizing.get();
      if (pending.frames.empty()) return;
      resizing = std::async(std::launch::async, [&sized, h, w, b = std::move(pending)]() mutable {
        // Resized in place, then placed one by one: a batch may name a frame twice (a pass that gave
        // up on pts placement hands its frames over again), and two threads must never write one slot.
        parallel_for(int64_t(b.frames.size()), [&](int64_t i) {
          image::Rgb8& f = b.frames[size_t(i)];
          if (f.height != h || f.width != w) f = image::resize_bicubic(f, h, w);
        });
        for (size_t i = 0; i < b.frames.size(); ++i) sized[b.at[i]] = std::move(b.frames[i]);
      });
      pending = {};
    };
    try {
      c.frames_decoded = decode_indices(bytes, c.info, c.indices, limits, [&](size_t j, image::Rgb8&& f) {
        pending.frames.push_back(std::move(f));
        pending.at.push_back(j);
        if (int64_t(pending.frames.size()) >= batch) flush();
      });
      decoded_at = Clock::now();
      flush();
      flush();  // the last batch's resize
    } catch (...) {
      if (resizing.valid()) resizing.wait();  // it writes into `sized`
      throw;
    }
    c.timestamps = plan.timestamps;
    c.patches = patchify_frames(sized, cfg);
    // Resizing overlaps decoding, so the stages are wall time: decode_ms until the last frame is
    // decoded (the resizes that ran meanwhile included), preprocess_ms after it (the last resizes and
    // patchify).
    c.decode_ms = ms_between(t0, decoded_at);
    c.preprocess_ms = ms_since(decoded_at);
  } catch (const Error& e) {
    if (std::string_view(e.what()).starts_with("video '")) throw;
    fail("video '{}': {}", name, e.what());
  }
  return c;
}

}  // namespace fovea::video
