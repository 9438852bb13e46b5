#!/usr/bin/env bash
# Installs the Debian packages fovea builds against (docs/architecture.md §Dependencies). Run as root or with sudo.
# The CUDA toolkit (nvcc, cuBLASLt, cuDNN) is not a Debian package here; CMake finds it when present
# and builds the CPU-only parts when it is not.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config
      nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev
      libboost-dev         # Boost.Asio + Beast (header-only): the HTTP layer of fovea serve
      libcpp-httplib-dev   # the HTTP client of the serve tests (test-only)
      libjpeg62-turbo-dev libpng-dev libgif-dev libwebp-dev zlib1g-dev  # image decoders (static archives)
      libavformat-dev libavcodec-dev libswscale-dev libavutil-dev  # video decoding (FFmpeg's libraries)
      libcurl4-openssl-dev # fovea serve's http(s) media URLs (--allowed-media-domains)
      ffmpeg               # the video tests make and decode clips with its command line (test-only)
      haproxy              # the deployment test puts two servers behind it (test-only; docs/deploy.md)
      b3sum                # BLAKE3 as its authors compute it, against fovea's own (tests/test-blake3.cpp; test-only)
      python3-numpy        # the C ABI's test through the Python package (python/tests/test_capi.py)
      python3-setuptools python3-wheel  # the wheel check (tests/python-wheel-test.py: scripts/python-wheel.sh)
      clang-format         # the tree's format (.clang-format; ctest check-format)
      clang libclang-rt-14-dev llvm-14 python3)  # the sanitizer/fuzz build, its symbolizer, the hostile suite
missing=()
for p in "${pkgs[@]}"; do
  # Installed, not merely known: `dpkg -s` also succeeds for a removed package whose config files remain.
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
  exit 0
fi
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "setup: installing ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
