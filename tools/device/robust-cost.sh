#!/usr/bin/env bash
# On the GPU machine (issue 15): the robust scheme's GPU tests and its cost beside per-tensor FP8
# (bench attention; "prep dyn" records the history). Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
timeout 240 "$B/test-attention-gpu" > "$OUT/test-attention-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-attention-gpu.txt"
timeout 150 "$B/test-encoder-gpu" --gtest_filter='*Robust*' > "$OUT/test-encoder-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|outlier channels|robust calibration" "$OUT/test-encoder-gpu.txt"
grep -h -B2 -A6 "Failure$" "$OUT"/test-*.txt | head -40
for rep in 1 2; do
for shape in 8192:72 32640:72 8192:128; do
  "$B/fovea" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype fp8 \
    --fp8-scheme tensor,robust --reps 50 --check 0 2>&1 | grep -E "^(bf16|fp8|fp8-r) " | sed "s/^/$shape /"
done
done
