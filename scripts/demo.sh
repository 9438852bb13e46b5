#!/usr/bin/env bash
# fovea's main job on its built-in defaults, from a fresh clone: install, build, fetch photographs
# (Debian's mate-backgrounds, never committed), then encode them.
#  - everywhere: the Qwen3-VL encoder architecture at test size (synthetic:tiny) on the CPU, FP8
#    attention with dynamic scaling, three photographs and a bundled video clip (packed into the same
#    forward) -> visual tokens in demo-out.safetensors; and
#    the bundled transformers golden checks (fovea's error against transformers, BF16 and FP8; on
#    the 8B shapes beside transformers' own BF16 error);
#  - where a Hopper GPU is visible: the Qwen3-VL-8B encoder (synthetic weights) on the same photos at
#    full resolution on the GPU, and its BF16-vs-FP8 timing at 3 x HD.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target fovea
F=build/fovea
$F info
photos=$(tools/fetch-photos.sh)
set -- "$photos/Garden.jpg" "$photos/Dune.jpg" "$photos/Elephants_5640x3172.jpg"
$F encode synthetic:tiny "$@" tests/data/video/h264.mp4 --device cpu --mm-encoder-attn-dtype fp8 --max-pixels 262144 \
  -o demo-out.safetensors
data=tests/data/qwen3vl-tiny
$F check-golden $data $data/golden.safetensors --device cpu --mm-encoder-attn-dtype bf16
$F check-golden $data $data/golden.safetensors --device cpu --mm-encoder-attn-dtype fp8
# The 8B encoder's shapes (2 blocks): fovea's error beside transformers BF16's own, held to 1.5x,
# on random pixels and on a real clip packed with an image.
for g in golden golden-video; do
  $F check-golden synthetic:qwen3-vl-8b-2blocks tests/data/qwen3vl-8b-2blocks/$g.safetensors --device cpu \
    --mm-encoder-attn-dtype bf16 --require-ratio 1.5
done
if $F info 2>/dev/null | grep -q "sm_90"; then
  $F encode synthetic:qwen3-vl-8b "$@" --mm-encoder-attn-dtype fp8 -o demo-out-8b.safetensors
  $F bench encoder synthetic:qwen3-vl-8b --resolutions HD --images-per-request 3
fi
