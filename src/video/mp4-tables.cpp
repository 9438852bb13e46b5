// What FFmpeg's MP4/MOV demuxer will build from a file's sample tables, bounded before it reads them
// (docs/video.md §Limits). A sample table may describe far more samples than its file holds: a
// constant-size `stsz` claims 80 million samples in 20 bytes, a `trun` without per-sample fields
// claims any count in 12, and each entry of an edit list (`elst`) makes the demuxer copy the index
// again. The demuxer allocates an index entry per sample (and more per edit) while it opens the
// file, before fovea sees a frame; so the boxes are walked here first, and a file whose tables claim
// more than it holds, or more samples than the limit, is refused. Only the boxes that hold tables
// are read; everything else is skipped by its size.
#include <algorithm>
#include <array>
#include <cstring>

#include <fmt/format.h>

#include "fovea/error.h"
#include "fovea/video.h"

namespace fovea::video {

namespace {

constexpr int kMaxDepth = 16;

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }
uint64_t be64(const uint8_t* p) { return uint64_t(be32(p)) << 32 | be32(p + 4); }

struct Box {
  std::array<char, 4> type{};
  const uint8_t* body = nullptr;  // after the header
  uint64_t size = 0;              // of the body, clamped to the parent (FFmpeg reads a cut box as far as it goes)
  bool is(const char* t) const { return std::memcmp(type.data(), t, 4) == 0; }
  std::string name() const { return {type.data(), 4}; }
};

// A track's tables, as far as they decide the index FFmpeg builds.
struct Track {
  char handler[4] = {};
  uint64_t samples = 0;       // stsz / stz2
  uint64_t sample_size = 0;   // stsz's constant size (0: a size per sample)
  uint64_t chunks = 0;        // stco / co64
  uint64_t time_entries = 0;  // stts
  bool unit_deltas = false;   // stts: one entry with delta 1 (uncompressed audio, indexed by chunk)
  uint64_t edits = 0;         // elst
  uint64_t fragment_samples = 0;
};

class Walker {
 public:
  Walker(std::span<const uint8_t> bytes, const std::string& name) : bytes_(bytes), name_(name) {}

  ContainerCost run() {
    walk(bytes_.data(), bytes_.size(), 0);
    uint64_t entries = loose_fragment_samples_;
    for (const Track& t : tracks_) entries = saturated((unsigned __int128)entries + entries_of(t));
    ContainerCost c;
    c.index_entries = int64_t(entries);
    if (c.index_entries > kMaxIndexEntries)
      fail("video '{}': its sample tables describe {} samples (edits included); the limit is {}", name_,
           c.index_entries, kMaxIndexEntries);
    c.open_bytes = c.index_entries * kIndexEntryBytes;
    return c;
  }

 private:
  // What FFmpeg's index holds for a track: an entry per sample (uncompressed audio with unit deltas:
  // one per chunk and per 1024 samples), copied once per edit.
  // In 128 bits and saturated below 2^62: counts and edits are 32-bit each, and a file may hold
  // many runs, so neither the product nor the sums may wrap.
  static uint64_t entries_of(const Track& t) {
    const bool by_chunk = std::memcmp(t.handler, "soun", 4) == 0 && t.sample_size > 0 && t.unit_deltas;
    const unsigned __int128 samples =
        (by_chunk ? t.chunks + t.samples / 1024 : t.samples) + (unsigned __int128)t.fragment_samples;
    return saturated(samples * std::max<uint64_t>(1, t.edits));
  }
  static constexpr uint64_t kCeiling = uint64_t(1) << 62;
  static uint64_t saturated(unsigned __int128 n) { return n > kCeiling ? kCeiling : uint64_t(n); }

  [[noreturn]] void bad(const std::string& what) const {
    fail("video '{}': corrupt MP4 sample table: {}", name_, what);
  }

  void walk(const uint8_t* p, uint64_t n, int depth) {
    if (depth > kMaxDepth) bad("boxes nested deeper than 16");
    while (n >= 8) {
      Box b;
      uint64_t header = 8, total = be32(p);
      std::memcpy(b.type.data(), p + 4, 4);
      if (total == 1) {
        if (n < 16) bad("a box header is cut short");
        total = be64(p + 8);
        header = 16;
      } else if (total == 0) {
        total = n;  // to the end of its parent
      }
      if (total < header) bad(b.name() + " box smaller than its header");
      total = std::min(total, n);
      b.body = p + header;
      b.size = total - header;
      visit(b, depth);
      p += total;
      n -= total;
    }
  }

  // The full box's entry count, checked to fit in the box at entry_bytes each.
  uint64_t entries(const Box& b, uint64_t offset, uint64_t entry_bytes) const {
    if (b.size < offset + 4) bad(b.name() + " box cut short");
    const uint64_t count = be32(b.body + offset);
    if (entry_bytes && count > (b.size - offset - 4) / entry_bytes)
      bad(fmt::format("{} box lists {} entries of {} bytes in {} bytes", b.name(), count, entry_bytes, b.size));
    return count;
  }

  Track& track() {
    if (tracks_.empty()) bad(std::string("a sample table outside a track"));
    return tracks_.back();
  }

  void visit(const Box& b, int depth) {
    static constexpr const char* kContainers[] = {"moov", "trak", "mdia", "minf", "stbl",
                                                  "edts", "mvex", "moof", "traf"};
    if (b.is("trak")) tracks_.emplace_back();
    for (const char* c : kContainers)
      if (b.is(c)) return walk(b.body, b.size, depth + 1);
    table(b);
  }

  void table(const Box& b) {
    if (b.is("hdlr")) {
      if (b.size >= 12 && !tracks_.empty()) std::memcpy(track().handler, b.body + 8, 4);
    } else if (b.is("stsz")) {
      if (b.size < 12) bad("stsz box cut short");
      Track& t = track();
      t.sample_size = be32(b.body + 4);
      t.samples = entries(b, 8, t.sample_size ? 0 : 4);
      // Samples of one size lie in the file one after another: they cannot outnumber its bytes.
      if (t.sample_size && t.samples > bytes_.size() / t.sample_size)
        bad(fmt::format("stsz box lists {} samples of {} bytes in a file of {}", t.samples, t.sample_size,
                        bytes_.size()));
    } else if (b.is("stz2")) {
      if (b.size < 12) bad("stz2 box cut short");
      const uint64_t bits = b.body[7];
      if (bits != 4 && bits != 8 && bits != 16) bad("stz2 field size is not 4, 8 or 16");
      Track& t = track();
      t.samples = entries(b, 8, 0);
      if (t.samples > (b.size - 12) * 8 / bits)
        bad(fmt::format("stz2 box lists {} samples in {} bytes", t.samples, b.size));
    } else if (b.is("stts")) {
      Track& t = track();
      t.time_entries = entries(b, 4, 8);
      t.unit_deltas = t.time_entries == 1 && be32(b.body + 12) == 1;
    } else if (b.is("stco")) {
      track().chunks = entries(b, 4, 4);
    } else if (b.is("co64")) {
      track().chunks = entries(b, 4, 8);
    } else if (b.is("ctts") || b.is("sbgp")) {
      entries(b, b.is("sbgp") ? 8 + (b.size && b.body[0] == 1 ? 4 : 0) : 4, 8);
    } else if (b.is("stsc")) {
      entries(b, 4, 12);
    } else if (b.is("stss") || b.is("stps")) {
      entries(b, 4, 4);
    } else if (b.is("elst")) {
      track().edits = entries(b, 4, b.size && b.body[0] == 1 ? 20 : 12);
    } else if (b.is("trun")) {
      trun(b);
    } else if (b.is("senc") || b.is("saiz") || b.is("saio") || b.is("pssh")) {
      fail("video '{}': an encrypted MP4 ({} box): fovea does not decrypt video", name_, b.name());
    }
  }

  // A track fragment's run: its samples count toward the file's, and when each sample has fields of
  // its own they must fit in the box.
  void trun(const Box& b) {
    // version and flags, the count, then a data offset and the first sample's flags where flagged.
    const uint32_t flags = b.size >= 4 ? be32(b.body) & 0xFFFFFF : 0;
    const uint64_t per_sample = 4 * uint64_t(__builtin_popcount(flags & 0xF00));
    const uint64_t head = 8 + ((flags & 0x1) ? 4 : 0) + ((flags & 0x4) ? 4 : 0);
    const uint64_t count = entries(b, 4, 0);
    if (b.size < head) bad("trun box cut short");
    if (per_sample && count > (b.size - head) / per_sample)
      bad(fmt::format("trun box lists {} samples of {} bytes in {} bytes", count, per_sample, b.size));
    // Each sample of a run lies in the file: a run cannot hold more samples than the file has bytes.
    if (count > bytes_.size())
      bad(fmt::format("trun box lists {} samples in a file of {} bytes", count, bytes_.size()));
    // Fragments follow the moov: counted against its last track. Saturated, as entries_of is.
    uint64_t& sum = tracks_.empty() ? loose_fragment_samples_ : tracks_.back().fragment_samples;
    sum = saturated((unsigned __int128)sum + count);
  }

  std::span<const uint8_t> bytes_;
  const std::string& name_;
  std::vector<Track> tracks_;
  uint64_t loose_fragment_samples_ = 0;
};

// Whether FFmpeg may take the bytes for MP4 / MOV: any box of the top-level chain (followed by the
// boxes' sizes, as its probe does, from the first box on) of a type its probe knows. Not just the
// first box: a file opening with an unknown box and then a moov is demuxed as MP4 all the same.
// Linear: each step passes at least 4 bytes. Bytes it misses are not demuxed as MP4 at all (the
// demuxer's whitelist, decode-ffmpeg.cpp), so a miss refuses a clip; it never skips the walk.
bool is_iso_bmff(std::span<const uint8_t> b) {
  static constexpr const char* kTop[] = {"ftyp", "moov", "mdat", "moof", "free", "wide", "skip", "pnot", "uuid",
                                         "udta", "styp", "sidx", "mfra", "junk", "pict", "ediw", "meta"};
  for (uint64_t at = 0; b.size() - at >= 8;) {
    for (const char* t : kTop)
      if (std::memcmp(b.data() + at + 4, t, 4) == 0) return true;
    uint64_t size = be32(b.data() + at);
    if (size == 1 && b.size() - at >= 16) size = be64(b.data() + at + 8);
    if (size < 8) {  // as FFmpeg's probe: a size too small to be a box, skip four bytes and look again
      at += 4;
      continue;
    }
    if (size > b.size() - at) return false;  // cut short: the chain ends
    at += size;
  }
  return false;
}

}  // namespace

ContainerCost container_cost(std::span<const uint8_t> bytes, const std::string& name) {
  ContainerCost c;
  if (is_iso_bmff(bytes)) {
    c = Walker(bytes, name).run();
    c.iso_bmff = true;
  }
  // Whatever else the demuxers keep (Matroska cues, AVI and FLV indexes, their read buffers) is read
  // from the file entry by entry: at most a few times its size.
  c.open_bytes += 2 * int64_t(bytes.size()) + kContainerBaseBytes;
  return c;
}

}  // namespace fovea::video
