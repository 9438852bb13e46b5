#!/usr/bin/env bash
# On the GPU machine, one call: the image path of issue #5 with the Qwen3-VL-8B encoder (synthetic
# weights) on real photographs (data/photos-device: mate-backgrounds JPEG/PNG, carried, never
# committed): fovea encode, bench mm-processor (BF16, FP8 dynamic, calibration, FP8 static with the
# calibrated file) and bench calibration (calibrate on some photographs, hold out the others).
# Run with carry [".device-bin", "data/photos-device"]. JSON results land in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
P=${PHOTOS:-data/photos-device}
M=${MODEL:-synthetic:qwen3-vl-8b}
echo "== encode: 3 photographs (4K, 1920x1280, 1600x1203), BF16 then FP8 dynamic"
for dt in bf16 fp8; do
  "$B/fovea" encode $M $P/Elephants_3840x2160.jpg $P/Storm.jpg $P/FreshFlower.jpg --mm-encoder-attn-dtype $dt -o /tmp/enc-$dt.safetensors
done
run_mm() {  # label, then extra flags
  local label=$1; shift
  echo "== bench mm-processor: $label"
  "$B/fovea" bench mm-processor --model $M --dataset-name folder --dataset-path $P --num-warmups 4 --num-prompts 12 \
    --images-per-request 3 --output-json "$OUT/mm-$label.json" "$@" 2>/dev/null | tail -7
}
run_mm bf16 --mm-encoder-attn-dtype bf16
run_mm fp8-dynamic --mm-encoder-attn-dtype fp8
run_mm fp8-calibrate --mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-save-path "$OUT/scales-8b.json"
run_mm fp8-static --mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path "$OUT/scales-8b.json"
"$B/fovea" scales inspect "$OUT/scales-8b.json" --num-layers 27 | tail -3
echo "== bench calibration: calibrate on the first 6 photographs, hold out the other $(( $(ls $P | wc -l) - 6 ))"
"$B/fovea" bench calibration --model $M --dataset-path $P --calibration-images 6 --scale-file /tmp/cal-8b.json \
  --output-json "$OUT/calibration-8b.json" 2>/dev/null | tail -20
