#!/usr/bin/env bash
# On the GPU machine (issue 15, last part): the robust scheme's history on the device and its
# calibration. GPU tests (every attention and encoder test, the history replayed in a graph against
# the host book, calibration end to end), the cost beside per-tensor FP8 with the history recording,
# calibration through the engine (bench mm-processor: 16 forwards write the fine scales, then static
# robust FP8 from them), and the 8B encoder. Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== GPU tests"
timeout 240 "$B/test-attention-gpu" > "$OUT/test-attention-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-attention-gpu.txt"
timeout 150 "$B/test-encoder-gpu" > "$OUT/test-encoder-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|outlier channels|robust calibration" "$OUT/test-encoder-gpu.txt"
grep -h -B2 -A6 "Failure$" "$OUT"/test-*.txt | head -40
echo "== cost: attention and prepare ms, per-tensor (fp8) against robust (fp8-r; prep dyn records the history)"
for shape in 8192:72 32640:72 8192:128; do
  "$B/fovea" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype bf16,fp8 \
    --fp8-scheme tensor,robust --reps 30 --check 0 2>&1 | grep -E "^(bf16|fp8|fp8-r) " | sed "s/^/$shape /"
done
echo "== calibration through the engine: 8B, 3 x FullHD requests"
base="bench mm-processor --model synthetic:qwen3-vl-8b --dataset-name random-mm --random-mm-size 1080x1920 --device cuda --mm-encoder-attn-dtype fp8"
timeout 120 "$B/fovea" $base --fp8-scheme robust --num-warmups 6 --num-prompts 10 --mm-encoder-fp8-scale-save-path /tmp/robust.json 2>&1 | tail -4
echo "fine fields in the file: $(grep -c fovea_k_mean /tmp/robust.json) layers with fovea_k_mean of $(grep -c attn.attn /tmp/robust.json)"
for s in "--fp8-scheme robust --mm-encoder-fp8-scale-path /tmp/robust.json" "--fp8-scheme robust" "--fp8-scheme tensor"; do
  echo "-- $s"
  timeout 120 "$B/fovea" $base $s --num-warmups 3 --num-prompts 20 2>&1 | grep -E "encoder forward|total|scales" | head -4
done
echo "== 8B encoder, 3 images"
timeout 150 "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions HD,4K --images-per-request 3 --reps 5 --warmup 1 \
  --dtype fp8-dynamic,fp8-robust 2>&1 | tail -5
