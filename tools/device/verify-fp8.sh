#!/usr/bin/env bash
# On the GPU machine: after a change to the FP8 kernel's accumulation, in one call: the attention
# GPU tests that matter (correlated values over 32768 keys, ragged, long, static, graph), an A/B of
# the kernel speed against an alternative build ($B/fovea-alt, if staged), the full-8B FP8 error
# against transformers, and bench calibration on photographs (FP8 vs BF16 on held-out images).
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== GPU attention tests"
timeout 300 "$B/test-attention-gpu" --gtest_filter='*Correlated*:*Ragged*:*hd72_fp8*:*hd128_fp8*:*Graph*:*Static*' 2>&1 |
  grep -E "gpu rel|^\[  (PASSED|FAILED)|Failure" | head -40
echo "== bench attention (FP8, 16 heads), median ms and TFLOP/s"
for bin in fovea fovea-alt; do
  [ -x "$B/$bin" ] || continue
  for shape in "8192:72" "3520,3520,3520:72" "32640:72" "8192:128"; do
    "$B/$bin" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype fp8,bf16 \
      --json /tmp/b.json >/dev/null 2>&1
    python3 -c "import json; d=json.load(open('/tmp/b.json')); [print('$bin', '$shape', r['dtype'], '%.3f ms' % r['attn_ms'], '%.1f TFLOP/s' % r['tflops'], 'rel %.2e' % (r.get('rel_l2') or 0)) for r in d['results']]"
  done
done
echo "== full 8B FP8 vs transformers"
M=/tmp/qwen3vl-8b-synthetic; mkdir -p $M
"$B/fovea" export-model synthetic:qwen3-vl-8b $M | tail -1
timeout 300 python3 tools/make-golden.py --model $M --out /tmp --name golden-8b --device cuda 2>&1 | tail -1
"$B/fovea" check-golden $M /tmp/golden-8b.safetensors --mm-encoder-attn-dtype fp8 --json "$OUT/check-8b-fp8.json"
echo "== bench calibration on photographs (8B, calibrate on 6, hold out the rest)"
"$B/fovea" bench calibration --model synthetic:qwen3-vl-8b --dataset-path ${PHOTOS:-data/photos-device} \
  --calibration-images 6 --scale-file /tmp/cal-8b.json --output-json "$OUT/calibration-8b.json" 2>/dev/null | tail -14
