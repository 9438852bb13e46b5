#!/usr/bin/env bash
# Stages the video measurements (tools/device/video.sh) for the GPU machine: the fovea binary and
# the FFmpeg libraries it links (Debian's, with everything they need beyond glibc and libstdc++: the
# GPU machine has none of them) packed into .device-bin/video-bundle.tar.xz (~43 MB), and the clips
# in data/video-device/ (a 60 s FullHD clip and a 10 s 720p one, made here with the ffmpeg command
# line from its test pattern; never committed). Then: run with carry [".device-bin", "data/video-device"]
# and command "bash tools/device/video.sh".
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target fovea
rm -rf .device-bin /tmp/fovea-bundle && mkdir -p .device-bin /tmp/fovea-bundle/lib
strip -o /tmp/fovea-bundle/fovea build/fovea
# WITH_TESTS=1: the GPU test binaries too (video.sh's section "gputests"); the clips are then left out.
if [ "${WITH_TESTS:-0}" = 1 ]; then
  cmake --build build --target test-attention-gpu test-encoder-gpu
  for t in test-attention-gpu test-encoder-gpu; do strip -o /tmp/fovea-bundle/$t build/tests/$t; done
fi
ldd build/fovea | awk '$3 ~ /^\// {print $1, $3}' |
  grep -vE "^(libc|libm|libpthread|libdl|librt|libresolv|libgcc_s|libstdc\+\+|ld-linux[^ ]*)\.so|libcuda|libcudart|libcudnn|libcublas" |
  while read -r so path; do cp -L "$path" "/tmp/fovea-bundle/lib/$so"; done
tar -C /tmp/fovea-bundle -cf - . | xz -9 -T"$(nproc)" > .device-bin/video-bundle.tar.xz
mkdir -p data/video-device/long data/video-device/short
[ -f data/video-device/long/fullhd-60s.mp4 ] || ffmpeg -v error -y -f lavfi -i testsrc2=size=1920x1080:rate=30 -t 60 \
  -c:v libx264 -preset veryfast -b:v 500k -pix_fmt yuv420p data/video-device/long/fullhd-60s.mp4
[ -f data/video-device/short/hd-10s.mp4 ] || ffmpeg -v error -y -f lavfi -i testsrc2=size=1280x720:rate=30 -t 10 \
  -c:v libx264 -preset veryfast -crf 36 -pix_fmt yuv420p data/video-device/short/hd-10s.mp4
du -shc .device-bin data/video-device
