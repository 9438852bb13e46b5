// src/video/decode.h: the one call a clip's orchestration (video.cpp: decode_opened) makes of the
// decoder. FFmpeg's side implements it (decode-ffmpeg.cpp); a build without FFmpeg's libraries
// (no-ffmpeg.cpp) says it was built without video decoding.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "fovea/clock.h"
#include "fovea/image.h"
#include "fovea/video.h"

namespace fovea::video {

// Decodes the frames at `indices` (sorted, within 0..frames - 1; repeats allowed) of an opened clip
// from its kept packets and hands each over as RGB at its decoded size: take(j, frame) for j = 0, 1,
// ... in order, on this thread. A frame nobody sampled is skipped where no other frame refers to it
// and the probe placed every frame by its pts; where it did not, or where a frame is not where its
// pts put it, every frame is decoded and counted instead (the frames already handed over are handed
// over again). threads: the decoder's (ClipPlan::threads, whose pool of pictures, DecoderCost::
// pool_bytes, is enforced); the pixel limit is the one the clip was opened under. Throws
// "video '<name>': ..." for a corrupt stream, a refused frame, or `deadline` passed. Returns the
// frames the decoder produced.
int64_t decode_frames_at(const OpenedClip& clip, const std::vector<int64_t>& indices, int threads,
                         Clock::time_point deadline, const std::function<void(size_t, image::Rgb8&&)>& take);

}  // namespace fovea::video
