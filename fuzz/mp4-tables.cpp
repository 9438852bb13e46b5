// Fuzzes the MP4/MOV sample-table walk (src/video/mp4-tables.cpp) that runs before FFmpeg opens a
// clip: any bytes give a cost or a fovea::Error naming the clip, never a crash or a hang, and a cost
// it accepts keeps the index under the limit and opening within a few times the file. Needs no
// FFmpeg. Seeds: fuzz/corpus/mp4-tables/ (real MP4, MOV and fragmented MP4 files, and the sample-table
// bombs of tests/hostile/clips.py).
#include <cstdlib>
#include <string>

#include "fovea/error.h"
#include "fovea/video.h"

// A sample is counted twice in open_bytes: the demuxer's index entry, and the record of the packet
// open_clip keeps (decode-ffmpeg.cpp's probe gets open_bytes less the demuxer's entries).
static_assert(fovea::video::kIndexEntryBytes == fovea::video::kDemuxerEntryBytes + fovea::video::kPacketRecordBytes);

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fovea;
  try {
    const video::ContainerCost c = video::container_cost({data, size}, "fuzz");
    if (c.index_entries < 0 || c.index_entries > video::kMaxIndexEntries) std::abort();
    if (c.open_bytes != c.index_entries * video::kIndexEntryBytes + 2 * int64_t(size) + video::kContainerBaseBytes)
      std::abort();
  } catch (const Error& e) {
    if (std::string(e.what()).find("video 'fuzz'") == std::string::npos) std::abort();
  }
  return 0;
}
