// Video decoding in a build without FFmpeg's libraries (FOVEA_VIDEO=OFF, or they were not found):
// FFmpeg's part (opening a clip, decoding its frames) says so; the rest of a clip's path is video.cpp's.
#include "fovea/error.h"
#include "fovea/video.h"
#include "video/decode.h"

namespace fovea::video {

namespace {
[[noreturn]] void unsupported(const std::string& name) {
  fail(
      "video '{}': this fovea was built without video decoding (FFmpeg's libavformat, libavcodec and libswscale "
      "were not found at build time; install libavformat-dev libavcodec-dev libswscale-dev and rebuild)",
      name);
}
}  // namespace

bool video_supported() { return false; }
std::string ffmpeg_versions() { return ""; }
OpenedClip open_clip(std::span<const uint8_t>, const std::string& name, const VideoLimits&,
                     const image::PreprocessConfig&, Clock::time_point) {
  unsupported(name);
}
int64_t decode_frames_at(const OpenedClip& clip, const std::vector<int64_t>&, int, Clock::time_point,
                         const std::function<void(size_t, image::Rgb8&&)>&) {
  unsupported(clip.info.name);
}

}  // namespace fovea::video
