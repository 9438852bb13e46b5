#!/usr/bin/env bash
# On the GPU machine (issue 15): the robust FP8 scheme on the GPU. Its GPU tests (attention against
# the emulation at every head_dim, static arrays, graph replays; the encoder end to end), its cost
# beside per-tensor FP8 (`bench attention --fp8-scheme tensor,robust`), its error against fp64 on
# outlier channels, the 8B encoder with it, and the register report's flash and prepare kernels.
# Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== GPU tests"
timeout 200 "$B/test-attention-gpu" > "$OUT/test-attention-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-attention-gpu.txt"
grep -E "robust|tensor channels" "$OUT/test-attention-gpu.txt" | head -24
timeout 120 "$B/test-encoder-gpu" > "$OUT/test-encoder-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|outlier channels" "$OUT/test-encoder-gpu.txt"
grep -h -B2 -A6 "Failure$" "$OUT"/test-*.txt | head -40
echo "== cost: attention and prepare ms, per-tensor (fp8) against robust (fp8-r), normal inputs"
for shape in 1024:72 3520,3520,3520:72 8192:72 32640:72 8192:128 16384:128; do
  "$B/fovea" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype bf16,fp8 \
    --fp8-scheme tensor,robust --reps 30 --check 0 2>&1 | grep -E "^(bf16|fp8|fp8-r) " | sed "s/^/$shape /"
done
echo "== error against fp64 (head 0), outlier channels and normal"
for dist in channels normal; do
  for shape in 4096,1024,77:72 4096:128 8192:80; do
    "$B/fovea" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype bf16,fp8 \
      --fp8-scheme tensor,robust --dist $dist --reps 3 2>&1 | grep -E "^(bf16|fp8|fp8-r) " | sed "s/^/$dist $shape /"
  done
done
echo "== 8B encoder, 3 images"
timeout 150 "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions HD,4K --images-per-request 3 --reps 5 --warmup 1 \
  --dtype bf16,fp8-dynamic,fp8-robust,fp8-static 2>&1 | tail -9
