// Video decoding through FFmpeg's libraries (docs/video.md §Decoding): the container is read from
// memory (no file or network access by FFmpeg), only the video stream is demuxed, a short list of
// containers and video codecs is accepted, and a deadline interrupts demuxing and decoding. This file
// opens a clip (open_clip) and decodes the frames asked for (decode_frames_at, video/decode.h); what
// a clip's decoding is made of (the plan, resizes beside decoding, patchify) is video.cpp's.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>

#include <fmt/format.h>

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/common.h>
#include <libavutil/imgutils.h>
#include <libavutil/log.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include "fovea/clock.h"
#include "fovea/error.h"
#include "fovea/video.h"
#include "video/decode.h"

namespace fovea::video {

namespace {

// Containers and codecs fovea opens: what phones, cameras, screen recorders and the web produce.
constexpr const char* kFormats = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,ogg";
// Without MP4/MOV: for bytes whose sample tables were not walked (FFmpeg's probe may still score them
// as MP4 from a box the walker's detection missed; the demuxer would then build an unchecked index).
constexpr const char* kFormatsNoMov = "matroska,webm,avi,mpegts,flv,ogg";
constexpr const char* kCodecs =
    "h264,hevc,vp8,vp9,libvpx,libvpx-vp9,av1,libdav1d,libaom-av1,mpeg4,mpeg1video,mpeg2video,"
    "mjpeg,theora,h263";
constexpr int64_t kMaxTotalFrames = int64_t(1) << 22;  // whatever the frame rate claims

// FFmpeg's own log lines are kept, not printed: the last error-level line of this thread goes into
// the error message.
thread_local std::string last_log;
thread_local bool over_max_pixels = false;  // FFmpeg refused a frame over max_pixels ("Picture size ... is invalid")
void log_callback(void*, int level, const char* format, va_list args) {
  if (level > AV_LOG_ERROR) return;
  char line[256];
  std::vsnprintf(line, sizeof line, format, args);
  last_log = line;
  while (!last_log.empty() && (last_log.back() == '\n' || last_log.back() == ' ')) last_log.pop_back();
  if (last_log.starts_with("Picture size")) over_max_pixels = true;
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

  Demuxer(std::span<const uint8_t> bytes, const std::string& name, Clock::time_point deadline, int64_t max_pixels,
          bool iso_bmff) {
    try {
      open(bytes, name, deadline, max_pixels, iso_bmff);
    } catch (...) {
      close();  // a constructor that throws runs no destructor: what open() allocated is freed here
      throw;
    }
  }
  void find_stream_info(const std::string& name, int64_t max_pixels) {
    fmt->codec_whitelist = av_strdup(kCodecs);
    fmt->probesize = std::min<int64_t>(fmt->probesize, int64_t(8) << 20);
    // Each stream's probing decoder: one thread, frames no larger than the pixel limit.
    std::vector<AVDictionary*> opts(fmt->nb_streams, nullptr);
    for (AVDictionary*& o : opts) {
      av_dict_set_int(&o, "max_pixels", max_pixels, 0);
      av_dict_set(&o, "threads", "1", 0);
    }
    const int e = avformat_find_stream_info(fmt, opts.empty() ? nullptr : opts.data());
    for (AVDictionary*& o : opts) av_dict_free(&o);
    if (e < 0) fail("video '{}': reading its stream parameters: {}", name, av_error(e));
  }
  void open(std::span<const uint8_t> bytes, const std::string& name, Clock::time_point deadline, int64_t max_pixels,
            bool iso_bmff) {
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
    av_dict_set(&opts, "format_whitelist", iso_bmff ? kFormats : kFormatsNoMov, 0);
    AVFormatContext* f = fmt;
    const int err = avformat_open_input(&f, "", nullptr, &opts);
    av_dict_free(&opts);
    if (err < 0) {
      fmt = nullptr;  // freed by avformat_open_input
      if (Clock::now() > deadline) fail("video '{}': reading the container took longer than the deadline", name);
      fail("video '{}': not a video fovea reads (MP4/MOV, WebM/MKV, AVI, MPEG-TS, FLV, Ogg): {}", name, av_error(err));
    }
    stream = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
    // Containers that create their streams as packets come (FLV), and headers without the frame size
    // (some MPEG-TS): read the first packets to learn them, decoders whitelisted and bounded.
    if (stream < 0 || fmt->streams[stream]->codecpar->width <= 0 || fmt->streams[stream]->codecpar->height <= 0) {
      find_stream_info(name, max_pixels);
      stream = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
    }
    if (stream < 0) fail("video '{}': the {} container has no video stream", name, fmt->iformat->name);
    AVCodecParameters* par = fmt->streams[stream]->codecpar;
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

}  // namespace

// The video packets of a clip, kept back to back, and what each packet was (its size, timestamps and
// flags): enough to send them to a decoder again, in 24 bytes a packet besides its data. No padding
// is kept (avcodec_send_packet copies a packet that is not reference-counted into a padded buffer of
// its own, FFmpeg's av_packet_ref), nor a duration (no decoder reads it for pixels, and fovea places
// frames by pts), nor an offset (packets are sent in order): a packet's bookkeeping, its pts listed
// included, is 33 bytes where it was 112 (a 16x16 clip's packets hold about 20 bytes of data). The
// records are kept in a deque: no doubling, no copy as they grow.
struct OpenedClip::Packets {
  struct Record {
    int64_t pts = 0, dts = 0;
    int32_t size = 0, flags = 0;
  };
  std::vector<uint8_t> data;
  std::deque<Record> records;
  AVCodecParameters* par = nullptr;
  AVRational time_base{1, 1};
  Packets() : par(avcodec_parameters_alloc()) {}
  ~Packets() { avcodec_parameters_free(&par); }
  Packets(const Packets&) = delete;
  Packets& operator=(const Packets&) = delete;
  // A record in the deque's blocks of 512 bytes, and its share of the deque's map (8 bytes a block).
  static constexpr int64_t kRecordBytes = int64_t(sizeof(Record)) * 512 / (512 / sizeof(Record) * sizeof(Record)) + 1;
  static_assert(kRecordBytes + 2 * sizeof(int64_t) <= kPacketRecordBytes, "a kept packet's record and pts");
  // The data as written (its capacity is the file's size, reserved up front: pages never written are
  // never resident) and the records.
  int64_t bytes() const { return int64_t(data.size()) + int64_t(records.size()) * kRecordBytes; }
  void keep(const AVPacket* p) {
    records.push_back({p->pts, p->dts, p->size, p->flags});
    data.insert(data.end(), p->data, p->data + p->size);
  }
};

namespace {

// The frame rate: the stream's average rate, its base rate, or the packets' own timestamps (a
// Matroska file without DefaultDuration), else 24 (transformers' fallback).
double frame_rate(const AVStream* st, const std::vector<int64_t>& sorted_pts) {
  AVRational r = st->avg_frame_rate;
  if (r.num <= 0 || r.den <= 0) r = st->r_frame_rate;
  if (r.num > 0 && r.den > 0) return av_q2d(r);
  if (sorted_pts.size() >= 2 && sorted_pts.back() > sorted_pts.front()) {
    // Every step a multiple of the smallest: the smallest is one frame (a frame the demuxer dropped,
    // as Ogg drops Theora's empty packets, makes a double step). Else the mean over the span (a
    // millisecond time base at 60 fps steps 16 and 17).
    int64_t step = 0;
    for (size_t i = 1; i < sorted_pts.size(); ++i)
      if (const int64_t d = sorted_pts[i] - sorted_pts[i - 1]; d > 0 && (step == 0 || d < step)) step = d;
    bool multiples = step > 0;
    for (size_t i = 1; multiples && i < sorted_pts.size(); ++i)
      multiples = (sorted_pts[i] - sorted_pts[i - 1]) % step == 0;
    const double tb = av_q2d(st->time_base);
    if (multiples && step * tb > 0) return 1.0 / (double(step) * tb);
    const double span = double(sorted_pts.back() - sorted_pts.front()) * tb;
    if (span > 0) return double(sorted_pts.size() - 1) / span;
  }
  return 24.0;
}

// A frame as a decoder holds it: its planes in that pixel format, padded as FFmpeg pads them; for a
// format not known, `unknown` bytes a pixel.
int64_t padded_frame_bytes(int format, int width, int height, int unknown) {
  const int w = FFALIGN(width, 64) + 64, h = FFALIGN(height, 64) + 64;
  const int n = format >= 0 ? av_image_get_buffer_size(AVPixelFormat(format), w, h, 64) : -1;
  return n > 0 ? int64_t(n) : int64_t(w) * h * unknown;
}

// The planar format of a layout (the 16-bit one for 9 to 16 bits: FFmpeg's p10/p12 frames take as much).
AVPixelFormat format_of(const StreamLayout& l) {
  static constexpr AVPixelFormat k8[] = {AV_PIX_FMT_YUV420P, AV_PIX_FMT_YUV422P, AV_PIX_FMT_YUV444P};
  static constexpr AVPixelFormat k16[] = {AV_PIX_FMT_YUV420P16, AV_PIX_FMT_YUV422P16, AV_PIX_FMT_YUV444P16};
  const int c = std::clamp(l.chroma, 1, 3) - 1;
  return l.sample_bytes > 1 ? k16[c] : k8[c];
}

// What the stream's decoder holds (DecoderCost): its pictures in the layout its headers give (the
// first packets carry the parameter sets of streams without extradata), the codec's per-picture data
// and per-thread tables, and whether it decodes frames in parallel (libdav1d's own threads count as
// frame threads). The decoder starts from the container's reorder delay where it is larger.
DecoderCost decoder_cost(const AVCodecParameters* par, const AVCodec* codec, std::span<const uint8_t> packets) {
  const std::span<const uint8_t> extra(par->extradata, size_t(std::max(0, par->extradata_size)));
  const StreamLayout layout = stream_layout(avcodec_get_name(par->codec_id), extra, packets);
  const int64_t pixels = int64_t(par->width) * par->height;
  DecoderCost d;
  d.side_bytes = int64_t(layout.side_per_pixel * double(pixels));
  d.picture_bytes = padded_frame_bytes(format_of(layout), par->width, par->height, 6) + d.side_bytes;
  d.thread_bytes = kThreadBaseBytes + int64_t(layout.thread_per_pixel * double(pixels));
  d.base_bytes = kDecoderBaseBytes + pixels / 4;
  d.held = layout.refs + std::max(layout.reorder, par->video_delay);
  d.frame_threads = codec && (codec->capabilities & (AV_CODEC_CAP_FRAME_THREADS | AV_CODEC_CAP_OTHER_THREADS));
  return d;
}

// The clip's header: its container, codec and frame size, within the pixel limit.
ClipInfo header_info(const Demuxer& d, const std::string& name, int64_t max_px) {
  ClipInfo info;
  info.name = name;
  info.container = d.fmt->iformat->name;
  const AVCodecParameters* par = d.st()->codecpar;
  info.codec = avcodec_get_name(par->codec_id);
  info.width = par->width;
  info.height = par->height;
  if (info.width <= 0 || info.height <= 0)
    fail("video '{}': its frame size {}x{} is empty", name, info.width, info.height);
  if (int64_t(info.width) * info.height > max_px)
    fail("video '{}': frames of {}x{} exceed the limit of {} pixels (--max-image-pixels)", name, info.width,
         info.height, max_px);
  return info;
}

// Reads every packet: the video stream's are counted and kept (with their pts), all within `room`
// bytes (the pts list probe makes of them included). Returns whether every packet had a pts it may be placed by.
bool read_packets(Demuxer& d, ClipInfo& info, OpenedClip::Packets& packets, const VideoLimits& limits, int64_t room) {
  const std::string& name = info.name;
  // Frames past the limit's length stop the count at once where the header gives the rate.
  const double header_fps = frame_rate(d.st(), {});
  const bool rate_known = d.st()->avg_frame_rate.num > 0 || d.st()->r_frame_rate.num > 0;
  const int64_t cap = rate_known ? std::min<int64_t>(kMaxTotalFrames, int64_t(limits.max_seconds * header_fps + 1e-6))
                                 : kMaxTotalFrames;
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
             header_fps, limits.max_seconds);
      pts_usable = pts_usable && pkt.p->pts != AV_NOPTS_VALUE && !(pkt.p->flags & AV_PKT_FLAG_DISCARD);
      packets.keep(pkt.p);
      if (packets.bytes() + info.frames * int64_t(sizeof(int64_t)) > room)  // and the pts list, made at the end
        fail("video '{}': its packets take more than the {} bytes its size allows", name, room);
    }
    av_packet_unref(pkt.p);
  }
  return pts_usable;
}

// Reads the container's header, then every packet (read_packets, within the room open_bytes left
// after the demuxer's index), then what the frame rate, the length and the decoder's cost are.
OpenedClip probe(Demuxer& d, const std::string& name, const VideoLimits& limits, int64_t max_px, int64_t room) {
  OpenedClip c;
  ClipInfo& info = c.info;
  info = header_info(d, name, max_px);
  auto packets = std::make_shared<OpenedClip::Packets>();
  if (avcodec_parameters_copy(packets->par, d.st()->codecpar) < 0)
    fail("video '{}': out of memory reading its header", name);
  packets->time_base = d.st()->time_base;
  packets->data.reserve(
      std::min(d.src.bytes.size(), size_t(std::max<int64_t>(0, room))));  // a packet's data is in the file
  const bool pts_usable = read_packets(d, info, *packets, limits, room);
  if (info.frames == 0) fail("video '{}': its video stream has no frames", name);
  if (pts_usable) {  // listed once, at its size: a list grown packet by packet leaves its old copies behind
    info.frame_pts.reserve(packets->records.size());
    for (const OpenedClip::Packets::Record& r : packets->records) info.frame_pts.push_back(r.pts);
  }
  std::sort(info.frame_pts.begin(), info.frame_pts.end());
  info.fps = pts_usable ? frame_rate(d.st(), info.frame_pts) : frame_rate(d.st(), {});
  if (!(info.fps >= 0.01 && info.fps <= 1000))
    fail("video '{}': its frame rate {} is not in [0.01, 1000]", name, info.fps);
  if (!pts_usable || std::adjacent_find(info.frame_pts.begin(), info.frame_pts.end()) != info.frame_pts.end())
    std::vector<int64_t>().swap(info.frame_pts);
  info.seconds = double(info.frames) / info.fps;
  if (info.seconds > limits.max_seconds * (1 + 1e-9))
    fail("video '{}': {} frames at {:.3g} fps last {:.4g} s, longer than the limit of {} s (--max-video-seconds)", name,
         info.frames, info.fps, info.seconds, limits.max_seconds);
  info.packet_bytes = packets->bytes() + int64_t(info.frame_pts.capacity() * sizeof(int64_t));
  size_t head = 0;  // the first packets' data (at most 32 of them, and 1 MiB: parameter sets lead a stream)
  for (size_t i = 0; i < std::min<size_t>(32, packets->records.size()); ++i) head += size_t(packets->records[i].size);
  head = std::min(head, size_t(1) << 20);
  info.decoder = decoder_cost(d.st()->codecpar, d.codec, {packets->data.data(), head});
  c.packets = std::move(packets);
  return c;
}

void check_size(std::span<const uint8_t> bytes, const std::string& name, const VideoLimits& limits) {
  if (bytes.empty()) fail("video '{}': empty file", name);
  if (bytes.size() > limits.max_encoded_bytes)
    fail("video '{}': {} bytes, over the limit of {}", name, bytes.size(), limits.max_encoded_bytes);
}

// The decoder's frames, counted as the decoder asks for them (AVCodecContext::get_buffer2): a frame
// whose size is not the header's, or one past the pool's bytes, is refused before it is allocated.
// Each counts its planes in the format it has and the codec's per-picture data (side_bytes), as
// DecoderCost::picture_bytes counts it in the format the header gave.
struct FramePool {
  int width = 0, height = 0;
  int64_t capacity = 0, side_bytes = 0;
  std::atomic<int64_t> used{0};
  std::atomic<int> refused{0};  // 1: a size change, 2: over the pool
  int refused_width = 0, refused_height = 0;
};

struct Held {  // one frame's buffer as handed out: the pool's own buffer and its bytes
  FramePool* pool;
  AVBufferRef* buf;
  int64_t bytes;
};

void give_back(void* opaque, uint8_t*) {
  auto* h = static_cast<Held*>(opaque);
  h->pool->used -= h->bytes;
  av_buffer_unref(&h->buf);
  delete h;
}

int get_frame_buffer(AVCodecContext* ctx, AVFrame* f, int flags) {
  auto* pool = static_cast<FramePool*>(ctx->opaque);
  // The decoder asks for its coded size: the header's, rounded up to whole macroblocks or coding units.
  if (f->width < pool->width || f->height < pool->height || f->width > pool->width + 128 ||
      f->height > pool->height + 128) {
    pool->refused_width = f->width;
    pool->refused_height = f->height;
    pool->refused = 1;
    return AVERROR_INVALIDDATA;
  }
  const int64_t bytes = padded_frame_bytes(f->format, f->width, f->height, 8) + pool->side_bytes;
  if (pool->used.fetch_add(bytes) + bytes > pool->capacity) {
    pool->used -= bytes;
    pool->refused = 2;
    return AVERROR(ENOMEM);
  }
  if (const int e = avcodec_default_get_buffer2(ctx, f, flags); e < 0) {
    pool->used -= bytes;
    return e;
  }
  // The frame's first buffer is wrapped: when the last reference to it goes, its bytes go back.
  auto* h = new Held{pool, f->buf[0], bytes};
  AVBufferRef* wrapped = av_buffer_create(h->buf->data, h->buf->size, give_back, h, 0);
  if (!wrapped) {
    delete h;
    pool->used -= bytes;
    av_frame_unref(f);  // the frame still holds the pool's buffer
    return AVERROR(ENOMEM);
  }
  f->buf[0] = wrapped;
  return 0;
}

// A decoder for the kept packets: the stream's codec with its pixel limit and frame pool, and the
// RGB conversion of the frames it gives.
class Decoder {
 public:
  Decoder(const OpenedClip& clip, int threads, int64_t pool_bytes, int64_t max_pixels) : info_(clip.info) {
    try {
      open(clip, threads, pool_bytes, max_pixels);
    } catch (...) {
      close();  // a constructor that throws runs no destructor
      throw;
    }
  }
  ~Decoder() { close(); }
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Sends one packet (nullptr: the end) and hands each frame it completes to out(frame); stops
  // early when out returns false. Throws naming the clip for a corrupt stream or a refused frame.
  template <class Out>
  void send(const AVPacket* p, int64_t at, Out&& out) {
    if (const int s = avcodec_send_packet(ctx_, p); s < 0 && s != AVERROR(EAGAIN) && s != AVERROR_EOF) failed(s, at);
    for (;;) {
      const int e = avcodec_receive_frame(ctx_, frame_);
      if (e == AVERROR(EAGAIN) || e == AVERROR_EOF) return;
      if (e < 0) failed(e, at);
      const bool more = out(frame_);
      av_frame_unref(frame_);
      if (!more) return;
    }
  }
  void skip_unreferenced(bool skip) { ctx_->skip_frame = skip ? AVDISCARD_NONREF : AVDISCARD_DEFAULT; }

  // The frame as RGB at its own size (the stream's colour matrix and range).
  image::Rgb8 rgb(const AVFrame* f, int64_t at);

 private:
  void open(const OpenedClip& clip, int threads, int64_t pool_bytes, int64_t max_pixels) {
    const std::string& name = info_.name;
    const AVCodecParameters* par = clip.packets->par;
    const AVCodec* codec = avcodec_find_decoder(par->codec_id);
    if (!codec) fail("video '{}': no decoder for its {} video", name, info_.codec);
    if (!(ctx_ = avcodec_alloc_context3(codec)) || !(frame_ = av_frame_alloc()) ||
        avcodec_parameters_to_context(ctx_, par) < 0)
      fail("video '{}': out of memory opening its decoder", name);
    pool_.width = info_.width;
    pool_.height = info_.height;
    pool_.capacity = pool_bytes;
    pool_.side_bytes = info_.decoder.side_bytes;
    ctx_->opaque = &pool_;
    // The frame pool is counted wherever the decoder takes its frames from get_buffer2 (every
    // whitelisted codec but libdav1d, which keeps its own pool: bounded by max_pixels alone). Those
    // counted refuse a frame of another size than the header's themselves, before FFmpeg's pixel
    // check (which has the less clear message) would; the others keep that check at the pixel limit.
    if (codec->capabilities & AV_CODEC_CAP_DR1) ctx_->get_buffer2 = get_frame_buffer;
    ctx_->max_pixels = max_pixels;
    max_pixels_ = max_pixels;
    over_max_pixels = false;
    ctx_->thread_count = std::max(1, threads);
    ctx_->pkt_timebase = clip.packets->time_base;
    ctx_->codec_whitelist = av_strdup(kCodecs);
    if (const int e = avcodec_open2(ctx_, codec, nullptr); e < 0)
      fail("video '{}': cannot decode its {} video: {}", name, info_.codec, av_error(e));
  }
  void close() {
    av_frame_free(&frame_);
    sws_freeContext(sws_);
    sws_ = nullptr;
    avcodec_free_context(&ctx_);  // before pool_: the decoder's frames give their bytes back to it
  }
  [[noreturn]] void failed(int e, int64_t at) const {
    const std::string& name = info_.name;
    if (pool_.refused == 1)
      fail("video '{}': a frame of {}x{} where the stream said {}x{} (a size change mid-stream is not supported)", name,
           pool_.refused_width, pool_.refused_height, info_.width, info_.height);
    if (pool_.refused == 2)
      fail(
          "video '{}': its decoder holds more than {} bytes of frames ({} threads and {} pictures kept of {}x{} in the "
          "format its header gives); the stream keeps more frames than its header declares",
          name, pool_.capacity, ctx_->thread_count, info_.decoder.held, info_.width, info_.height);
    if (over_max_pixels)  // FFmpeg's own check of max_pixels, before it allocated the frame
      fail(
          "video '{}': its stream holds frames larger than the limit of {} pixels (--max-image-pixels), though its "
          "header says {}x{}",
          name, max_pixels_, info_.width, info_.height);
    fail("video '{}': corrupt {} video near frame {}: {}", name, info_.codec, at, av_error(e));
  }
  const ClipInfo& info_;
  AVCodecContext* ctx_ = nullptr;
  AVFrame* frame_ = nullptr;
  SwsContext* sws_ = nullptr;
  std::vector<uint8_t> rows_;  // RGB rows with room to spare, for widths libswscale cannot pack
  FramePool pool_;
  int64_t max_pixels_ = 0;
};

image::Rgb8 Decoder::rgb(const AVFrame* f, int64_t at) {
  const std::string& name = info_.name;
  if (f->width != info_.width || f->height != info_.height)  // a decoder with its own allocator
    fail("video '{}': frame {} is {}x{}, the stream said {}x{} (a size change mid-stream is not supported)", name, at,
         f->width, f->height, info_.width, info_.height);
  const auto pf = AVPixelFormat(f->format);
  sws_ = sws_getCachedContext(sws_, f->width, f->height, pf, f->width, f->height, AV_PIX_FMT_RGB24, SWS_BILINEAR,
                              nullptr, nullptr, nullptr);
  if (!sws_)
    fail("video '{}': cannot convert its {} frames to RGB", name,
         av_get_pix_fmt_name(pf) ? av_get_pix_fmt_name(pf) : "?");
  // The stream's colour matrix (BT.601 when untagged, libswscale's default) and range (limited
  // unless tagged full or a yuvj format), to full-range RGB.
  const int cs =
      f->colorspace == AVCOL_SPC_UNSPECIFIED || f->colorspace == AVCOL_SPC_RGB ? SWS_CS_DEFAULT : int(f->colorspace);
  const AVPixFmtDescriptor* desc = av_pix_fmt_desc_get(pf);
  const bool full = f->color_range == AVCOL_RANGE_JPEG || (desc && std::strncmp(desc->name, "yuvj", 4) == 0);
  if (desc && !(desc->flags & AV_PIX_FMT_FLAG_RGB))
    sws_setColorspaceDetails(sws_, sws_getCoefficients(cs), full ? 1 : 0, sws_getCoefficients(SWS_CS_DEFAULT), 1, 0,
                             1 << 16, 1 << 16);
  image::Rgb8 out;
  out.width = f->width;
  out.height = f->height;
  out.name = name;
  // libswscale's SIMD paths for yuv420p/yuv422p convert whole groups of 16 pixels. With rows packed
  // back to back, a width that is not a multiple of 16 either leaves a row's last pixels unconverted
  // (width % 16 in 1..7) or writes up to 45 bytes past the frame (8..15) (measured on FFmpeg 5.1,
  // widths 1-1100; an 854x480 clip is one). Such frames are converted into rows with 64 bytes or
  // more to spare (the last row's overrun included), then packed.
  const size_t row = size_t(out.width) * 3;
  out.data.resize(row * out.height);
  const bool packed = out.width % 16 == 0;
  const int stride = packed ? int(row) : int((row + 63) / 64 * 64 + 64);
  if (!packed) rows_.resize(size_t(stride) * out.height);
  uint8_t* dst[4] = {packed ? out.data.data() : rows_.data(), nullptr, nullptr, nullptr};
  const int strides[4] = {stride, 0, 0, 0};
  if (sws_scale(sws_, f->data, f->linesize, 0, f->height, dst, strides) != f->height)
    fail("video '{}': converting frame {} to RGB failed", name, at);
  if (!packed)
    for (int y = 0; y < out.height; ++y) std::memcpy(out.data.data() + row * y, rows_.data() + size_t(stride) * y, row);
  return out;
}

// How one clip is decoded: its deadline, the threads its decoder may use, its frame pool's bytes.
struct DecodeEnv {
  Clock::time_point deadline;
  int threads = 1;
  int64_t pool_bytes = 0, max_pixels = 0;
  double deadline_seconds = 0;  // for the message: from the clip's opening to its deadline
};

// One decoding pass over the kept packets, handing over the frames at `indices` (sorted; repeats
// allowed) as RGB at their decoded size: take(j, frame) for j = 0, 1, ... in order, on this thread.
// skip (with info.frame_pts): a packet whose frame is not sampled is sent with skip_frame = NONREF,
// so the decoder drops it when no other frame refers to it (most B-frames: on a 60 s x264 clip 785
// of 1800 frames, and 40% of the decoding time), and each decoded frame is placed by its pts.
// Returns the frames decoded, or -1, having stopped, if a frame is not where the probe's pts put it
// (a pts the probe did not list, one placed before its predecessor, or one past a sampled frame
// that never came: a decoder dropping frames): the caller then decodes again, counting.
int64_t decode_pass(const OpenedClip& clip, const std::vector<int64_t>& indices, const DecodeEnv& env,
                    const std::function<void(size_t, image::Rgb8&&)>& take, bool skip) {
  const ClipInfo& info = clip.info;
  const std::vector<int64_t>& pts = info.frame_pts;
  std::vector<char> sampled;
  if (skip) {
    sampled.assign(pts.size(), 0);
    for (const int64_t i : indices) sampled[size_t(i)] = 1;
  }
  const auto index_of = [&](int64_t t) -> int64_t {  // the frame shown at t, or -1
    const auto it = std::lower_bound(pts.begin(), pts.end(), t);
    return it != pts.end() && *it == t ? int64_t(it - pts.begin()) : -1;
  };
  Decoder dec(clip, env.threads, env.pool_bytes, env.max_pixels);
  bool misplaced = false;
  int64_t last_at = -1;  // frames come out in presentation order, so their pts indices rise
  size_t j = 0;
  int64_t k = 0;  // frames decoded so far, in presentation order
  const auto out = [&](const AVFrame* f) {
    const int64_t at = skip ? index_of(f->pts) : k;  // this frame's index in presentation order
    if (skip && (at <= last_at || (j < indices.size() && at > indices[j]))) return !(misplaced = true);
    last_at = at;
    if (j < indices.size() && indices[j] == at) {
      image::Rgb8 rgb = dec.rgb(f, at);
      while (j + 1 < indices.size() && indices[j + 1] == at) take(j++, image::Rgb8(rgb));
      take(j++, std::move(rgb));
    }
    ++k;
    if (Clock::now() > env.deadline)
      fail("video '{}': opening and decoding took longer than the limit of {:.3g} s", info.name, env.deadline_seconds);
    return true;
  };
  Packet pkt;
  const OpenedClip::Packets& kept = *clip.packets;
  size_t offset = 0;  // packet n's data: after those of the packets before it
  for (size_t n = 0; n < kept.records.size() && j < indices.size() && !misplaced;
       offset += size_t(kept.records[n++].size)) {
    const OpenedClip::Packets::Record& r = kept.records[n];
    pkt.p->data = const_cast<uint8_t*>(kept.data.data() + offset);  // sent as is: the decoder copies it
    pkt.p->size = r.size;
    pkt.p->pts = r.pts;
    pkt.p->dts = r.dts;
    pkt.p->flags = r.flags;
    if (skip) {  // the setting travels with the packet (frame threads copy it at submission)
      const int64_t at = index_of(r.pts);
      dec.skip_unreferenced(at >= 0 && !sampled[size_t(at)]);
    }
    dec.send(pkt.p, k, out);
    if (Clock::now() > env.deadline)
      fail("video '{}': opening and decoding took longer than the limit of {:.3g} s", info.name, env.deadline_seconds);
  }
  pkt.p->data = nullptr;  // the Packet frees its own, not ours
  pkt.p->size = 0;
  if (j < indices.size() && !misplaced) dec.send(nullptr, k, out);  // flush the frames the decoder holds back
  if (skip && (misplaced || j < indices.size())) return -1;
  if (j < indices.size())
    fail("video '{}': the container lists {} frames, but decoding gave {} (frame {} was asked for)", info.name,
         info.frames, k, indices[j]);
  return k;
}

// Decodes the frames at `indices` (see decode_pass): skipping the frames nobody sampled where the
// probe placed every frame by its pts, counting every frame where it did not or where that failed.
// Returns the frames decoded.
int64_t decode_indices(const OpenedClip& clip, const std::vector<int64_t>& indices, const DecodeEnv& env,
                       const std::function<void(size_t, image::Rgb8&&)>& take) {
  if (!clip.info.frame_pts.empty() && int64_t(clip.info.frame_pts.size()) == clip.info.frames)
    if (const int64_t n = decode_pass(clip, indices, env, take, true); n >= 0) return n;
  return decode_pass(clip, indices, env, take, false);
}

int64_t max_frame_pixels(const VideoLimits& limits, const image::PreprocessConfig& budget) {
  return limits.max_frame_pixels > 0 ? limits.max_frame_pixels : image::image_pixel_limit(budget);
}

// threads: the plan's (ClipPlan::threads), whose pool its reservation counted.
DecodeEnv env_of(const OpenedClip& clip, int threads, int64_t max_pixels, Clock::time_point deadline) {
  const ClipInfo& info = clip.info;
  DecodeEnv env;
  env.deadline = deadline;
  env.threads = threads;
  env.pool_bytes = info.decoder.pool_bytes(threads);
  env.max_pixels = max_pixels;  // the pixel limit: no codec allocates a frame past it, whatever the header said
  env.deadline_seconds = seconds_between(clip.opened_at, deadline);
  return env;
}

}  // namespace

bool video_supported() { return true; }

std::string ffmpeg_versions() {
  const auto v = [](unsigned x) { return fmt::format("{}.{}.{}", x >> 16, (x >> 8) & 255, x & 255); };
  return fmt::format("libavformat {}, libavcodec {}, libswscale {}", v(avformat_version()), v(avcodec_version()),
                     v(swscale_version()));
}

OpenedClip open_clip(std::span<const uint8_t> bytes, const std::string& name, const VideoLimits& limits,
                     const image::PreprocessConfig& budget, Clock::time_point deadline) {
  const Clock::time_point opened_at = Clock::now();
  check_size(bytes, name, limits);
  const ContainerCost cost = container_cost(bytes, name);
  const int64_t max_px = max_frame_pixels(limits, budget);
  Demuxer d(bytes, name, deadline, max_px, cost.iso_bmff);
  // The demuxer's index is open_bytes' to the end; the packets get the rest (each sample's record share).
  OpenedClip c = probe(d, name, limits, max_px, cost.open_bytes - cost.index_entries * kDemuxerEntryBytes);
  c.max_frame_pixels = max_px;
  c.opened_at = opened_at;
  return c;
}

int64_t decode_frames_at(const OpenedClip& clip, const std::vector<int64_t>& indices, int threads,
                         Clock::time_point deadline, const std::function<void(size_t, image::Rgb8&&)>& take) {
  return decode_indices(clip, indices, env_of(clip, threads, clip.max_frame_pixels, deadline), take);
}

}  // namespace fovea::video
