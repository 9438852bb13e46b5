#!/usr/bin/env bash
# Builds here and copies what the GPU machine runs into .device-bin/ (ignored by git; carried by the
# device tool). Then: run with carry [".device-bin"] and command "bash tools/device/check.sh".
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build
rm -rf .device-bin && mkdir -p .device-bin
cp build/fovea build/tests/test-attention-gpu build/tests/test-encoder-gpu build/tests/test-fp8-device \
   build/tests/test-processor-golden .device-bin/
# Libraries from Debian packages are linked statically (image decoders) or header-only (Boost), so
# the binaries need nothing the GPU machine lacks; lib/ stays for anything that ever does (env.sh
# puts it on the path).
mkdir -p .device-bin/lib
# The photographs the GPU scripts use (carry "data/photos-device"; under 64 MiB with .device-bin):
# a fixed subset of tools/fetch-photos.sh's mate-backgrounds, never committed.
if [ -d data/photos ]; then
  mkdir -p data/photos-device
  for f in Aqua.jpg Arc-Colors-Transparent-Wallpaper.png Blinds.jpg Dune.jpg Elephants.jpg Elephants_3840x2160.jpg Elephants_5640x3172.jpg FreshFlower.jpg Garden.jpg \
           GreenMeadow.jpg GreenTraditional.jpg Gulp.png LadyBird.jpg RainDrops.jpg Storm.jpg TwoWings.jpg Wood.jpg YellowFlower.jpg; do
    [ -f "data/photos-device/$f" ] || cp "data/photos/$f" data/photos-device/
  done
fi
du -sh .device-bin
