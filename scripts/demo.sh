#!/usr/bin/env bash
# fovea's main job on its built-in default, from a fresh clone: install, build, then run.
# Today fovea's main job is its FP8 attention accuracy oracle: the CPU emulations of the BF16 and FP8
# kernels against fp64 on a packed varlen batch shaped like Qwen3-VL-8B's vision attention (16 heads,
# head_dim 72, the segment lengths of several images). `fovea encode synthetic:qwen3-vl-8b IMAGE...`
# takes this place once the encoder lands (issues #4 and #5).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target fovea
./build/fovea info
./build/fovea bench attention --device cpu --seqlens 256,1024,64 --heads 16 --head-dim 72 --dist normal
./build/fovea bench attention --device cpu --seqlens 256,1024,64 --heads 16 --head-dim 72 --dist outliers
