#!/usr/bin/env bash
# fovea's main job on its built-in defaults, from a fresh clone: install, build, then run.
# Until `fovea encode` takes image files (issue #5), the main job is the encoder itself on bundled
# inputs: the Qwen3-VL vision encoder (tests/data/qwen3vl-tiny, the real architecture, small) run
# on the golden pixels made by transformers, with BF16 and FP8 attention, against transformers'
# outputs; then the FP8 attention accuracy oracle; and, where a Hopper GPU is visible, the
# Qwen3-VL-8B encoder (synthetic weights) timed at HD, BF16 vs FP8.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target fovea
F=build/fovea
$F info
data=tests/data/qwen3vl-tiny
$F check-golden $data $data/golden.safetensors --device cpu --mm-encoder-attn-dtype bf16
$F check-golden $data $data/golden.safetensors --device cpu --mm-encoder-attn-dtype fp8
$F bench attention --device cpu --seqlens 256,1024,64 --heads 16 --head-dim 72 --dist outliers
if $F info 2>/dev/null | grep -q "sm_90"; then
  $F bench encoder synthetic:qwen3-vl-8b --resolutions HD --images-per-request 3
fi
