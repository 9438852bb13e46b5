#!/usr/bin/env bash
# The test command: installs the Debian packages, builds everything (the CUDA parts too where nvcc is
# installed) and runs every CPU test. GPU tests (ctest label `gpu`) run on a GPU machine:
#   ctest --test-dir build -L gpu
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
ctest --test-dir build -LE "gpu|photos" --output-on-failure -j "$(nproc)"
