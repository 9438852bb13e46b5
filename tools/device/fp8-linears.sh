#!/usr/bin/env bash
# On the GPU machine, one call (issue 14, FP8 linears): the GPU encoder tests (the FP8 GEMM against
# its emulation, the encoder against the CPU forward with the same linears), the 8B encoder's time
# with and without --fp8-linears (HD and 4K, 3 images), its error against transformers fp32 on the
# committed 2-block 8B golden file, and bench calibration's held-out photograph cosines against BF16
# with and without FP8 linears. Carry [".device-bin", "data/photos-device"]; logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== test-encoder-gpu, test-fp8-device"
timeout 200 "$B/test-encoder-gpu" > "$OUT/test-encoder-gpu.txt" 2>&1
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|fp8 linear|Failure" -A1 "$OUT/test-encoder-gpu.txt" | grep -v "^--" | head -30
timeout 60 "$B/test-fp8-device" 2>&1 | grep -E "^\[  (PASSED|FAILED) "
echo "== 8B encoder, 3 images, median ms"
timeout 240 "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions HD,4K --images-per-request 3 --reps 5 --warmup 1 \
  --dtype bf16,bf16+fp8-linears,fp8-static,fp8-static+fp8-linears --json "$OUT/encoder.json" 2>&1 | tail -10
echo "== 2-block 8B against transformers fp32 (golden file)"
for f in "" --fp8-linears; do
  for dt in bf16 fp8; do
    "$B/fovea" check-golden synthetic:qwen3-vl-8b-2blocks tests/data/qwen3vl-8b-2blocks/golden.safetensors \
      --mm-encoder-attn-dtype $dt $f 2>&1 | tail -4
  done
done
echo "== bench calibration on photographs (FullHD budget): FP8 against BF16, held-out images"
for f in "" --fp8-linears; do
  timeout 150 "$B/fovea" bench calibration --model synthetic:qwen3-vl-8b --dataset-path data/photos-device \
    --calibration-images 6 --max-pixels 2073600 --scale-file /tmp/cal.json $f --output-json "$OUT/calibration$f.json" \
    2>&1 | tail -1 | sed "s/^/[${f:-bf16 linears}] /"
done
