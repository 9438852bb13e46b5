#!/usr/bin/env bash
# The FP8 schemes on photographs, with and without outlier channels (docs/fp8.md §Choosing a scheme):
#   bench/fp8-schemes.sh [FOVEA]
# For each model in $MODELS (default: the 8B shapes cut to two blocks, plain and with the outlier
# channels of trained ViTs; synthetic:qwen3-vl-2b-2blocks[-outliers] gives head_dim 64),
# `fovea bench calibration` with the fp32 CPU forward as the reference:
# calibrates per-tensor, robust and auto on the first $CALIB photos, then runs BF16, FP8 dynamic and
# FP8 static (each margin in $MARGINS) on the rest; each error is also given as a ratio to BF16's own.
# Then `fovea scales inspect` of each model's calibrated robust file (the per-layer robust gain that
# auto reads). The fp32 CPU forward dominates the time (about 6 s a held-out photo of 1000 tokens on
# 16 cores for two blocks): keep MAX_PIXELS small and the models shallow.
# Environment: MODELS, PHOTOS (default data/photos: tools/fetch-photos.sh), CALIB (4), MARGINS
# (1,1.25,1.5,2), MAX_PIXELS (262144), SCHEMES (robust,tensor,auto; the file inspected is the first
# scheme's), and FOVEA, CUDNN_LIB, OUT
# (scripts/lib-gpu.sh). JSON of each run in $OUT.
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
P=$(photos_dir "${PHOTOS:-$FOVEA_ROOT/data/photos}") || exit 2
gpu_setup "${1:-}"
MODELS=${MODELS:-synthetic:qwen3-vl-8b-2blocks synthetic:qwen3-vl-8b-2blocks-outliers}
CALIB=${CALIB:-4}
MARGINS=${MARGINS:-1,1.25,1.5,2}
MAX_PIXELS=${MAX_PIXELS:-262144}
SCHEMES=${SCHEMES:-robust,tensor,auto}
failed=0
for m in $MODELS; do
  name=${m//[^A-Za-z0-9.-]/_}
  say "$m: bench calibration on $P (first $CALIB calibrate), schemes $SCHEMES, margins $MARGINS, max pixels $MAX_PIXELS"
  "$FOVEA" bench calibration --model "$m" --dataset-path "$P" --calibration-images "$CALIB" --reference fp32 \
    --fp8-scheme "$SCHEMES" --margins "$MARGINS" --max-pixels "$MAX_PIXELS" --scale-file "$OUT/$name-scales.json" \
    --output-json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1 || { failed=1; echo "   failed: $OUT/$name.txt"; }
  grep -vE "^[^ ]+ \([0-9]+ tokens\):" "$OUT/$name.txt"
  if [[ $SCHEMES == robust* ]]; then
    say "$m: the calibrated robust file (margin ${MARGINS%%,*})"
    "$FOVEA" scales inspect "$OUT/$name-scales.json" 2>&1 | grep -E "robust gain"
  fi
done
exit $failed
