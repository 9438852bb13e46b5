#!/usr/bin/env bash
# The test command: installs the Debian packages, builds everything (the CUDA parts too where nvcc is
# installed) and runs every CPU test; then the sanitizer stage, scripts/sanitize.sh (issue 10): the
# CPU parts built again with clang, ASan + UBSan (build-san), the CPU tests under the sanitizers, and
# every libFuzzer harness for a bounded time. FOVEA_SKIP_SANITIZE=1 skips that stage (local runs).
# GPU tests (ctest label `gpu`) run on a GPU machine:
#   ctest --test-dir build -L gpu
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
# setup.sh installed FFmpeg's libraries, so this build must decode video (its tests need it).
# (The output is captured first: grep -q would close the pipe early, and pipefail would see SIGPIPE.)
info=$(build/fovea info 2>&1 || true)
grep -q "^video: yes" <<<"$info" || { echo "test: the build has no video decoding (FFmpeg's -dev packages not found)"; exit 1; }
grep -q "^http media: yes" <<<"$info" || { echo "test: the build cannot fetch http(s) media (libcurl's -dev package not found)"; exit 1; }
ctest --test-dir build -LE "gpu|photos" --output-on-failure -j "$(nproc)"
if [ "${FOVEA_SKIP_SANITIZE:-0}" = 1 ]; then
  echo "test: FOVEA_SKIP_SANITIZE=1: the sanitizer and fuzz stage is skipped"
else
  scripts/sanitize.sh
fi
