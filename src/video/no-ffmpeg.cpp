// Video decoding in a build without FFmpeg's libraries (FOVEA_VIDEO=OFF, or they were not found):
// every entry point says so.
#include "fovea/error.h"
#include "fovea/video.h"

namespace fovea::video {

namespace {
[[noreturn]] void unsupported(const std::string& name) {
  fail("video '{}': this fovea was built without video decoding (FFmpeg's libavformat, libavcodec and libswscale "
       "were not found at build time; install libavformat-dev libavcodec-dev libswscale-dev and rebuild)", name);
}
}  // namespace

bool video_supported() { return false; }
std::string ffmpeg_versions() { return ""; }
ClipInfo probe_clip(std::span<const uint8_t>, const std::string& name, const VideoLimits&, const image::PreprocessConfig&) {
  unsupported(name);
}
OpenedClip open_clip(std::span<const uint8_t>, const std::string& name, const VideoLimits&, const image::PreprocessConfig&,
                     Clock::time_point) {
  unsupported(name);
}
Clip decode_opened(const OpenedClip& clip, const VideoConfig&, const VideoLimits&, Clock::time_point) {
  unsupported(clip.info.name);
}
Clip decode_clip(std::span<const uint8_t>, const std::string& name, const VideoConfig&, const VideoLimits&,
                 const image::PreprocessConfig&) {
  unsupported(name);
}
std::vector<image::Rgb8> decode_frames(std::span<const uint8_t>, const std::string& name, const std::vector<int64_t>&,
                                       const VideoLimits&) {
  unsupported(name);
}

}  // namespace fovea::video
