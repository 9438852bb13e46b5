#!/usr/bin/env bash
# On the GPU machine (issue 16, second call): the CUDNN backend against transformers' golden outputs
# (the committed 2-block 8B golden file, made by transformers) beside FOVEA's, and the 8B encoder
# beside transformers with the fovea cudnn column (bench/encoder-peers.py). Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
export FOVEA_ROOT=$PWD
echo "== conformance: 2-block 8B golden (transformers), BF16, each backend"
for be in FOVEA CUDNN; do
  "$B/fovea" check-golden synthetic:qwen3-vl-8b-2blocks tests/data/qwen3vl-8b-2blocks/golden.safetensors --device cuda \
    --mm-encoder-attn-backend $be --require-ratio 1.5 --json "$OUT/check-2b-$be.json" 2>&1 | tail -6; echo "$be exit code $?"
done
echo "== 8B encoder beside transformers (eager), 3 images"
PYTHONUNBUFFERED=1 timeout 300 python3 bench/encoder-peers.py --fovea "$B/fovea" --resolutions HD,FullHD,4K --images 3 --reps 5 \
  --no-compile --json "$OUT/encoder-peers.json" 2>"$OUT/encoder-peers.log" | tail -8
grep -E "rror" "$OUT/encoder-peers.log" | head -5
