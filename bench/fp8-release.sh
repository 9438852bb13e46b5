#!/usr/bin/env bash
# An FP8 release's weights as stored (docs/fp8.md §FP8 linears), against transformers and BF16:
#   bench/fp8-release.sh [FOVEA]
# Writes $MODEL (default synthetic:qwen3-vl-8b) as an FP8 release stores it (`export-model
# --fp8-weights $LAYOUT`, default blocks: E4M3 in [128, 128] blocks, quantization_config "fp8") and
# that release's dequantized BF16 twin (`--fp8-weights none`: the values transformers computes from
# the file); tools/make-golden.py runs transformers on the twin (fp32 and BF16, GRIDS), then `fovea
# check-golden` reports each mode's error as a multiple of transformers BF16's own: BF16 linears (the
# release dequantized at load), --fp8-linears on the release (its weights as stored), and on the twin
# (re-quantized per channel). Last, `fovea bench encoder` times both checkpoints at RESOLUTIONS in
# DTYPES (BF16 linears against the FP8 ones, beside each other in one process).
# Environment: MODEL, LAYOUT (blocks|channel), GRIDS (make-golden's, default 1x44x80,1x16x16),
# RESOLUTIONS (HD,4K), DTYPES (bf16,bf16+fp8-linears,fp8-static,fp8-static+fp8-linears), REPS (10),
# and FOVEA, CUDNN_LIB, OUT, PYTHON (scripts/lib-gpu.sh). Logs and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
gpu_setup "${1:-}"
MODEL=${MODEL:-synthetic:qwen3-vl-8b}
LAYOUT=${LAYOUT:-blocks}
GRIDS=${GRIDS:-1x44x80,1x16x16}
RESOLUTIONS=${RESOLUTIONS:-HD,4K}
DTYPES=${DTYPES:-bf16,bf16+fp8-linears,fp8-static,fp8-static+fp8-linears}
REPS=${REPS:-10}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/fovea-fp8-release.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/release" "$WORK/twin"
failed=0
run() {  # run NAME CMD...: its output in $OUT/NAME.log, the last lines shown
  local name=$1
  shift
  "$@" > "$OUT/$name.log" 2>&1 || { failed=1; echo "   $name failed (exit $?): $OUT/$name.log"; }
  grep -v Warning "$OUT/$name.log" | tail -${TAIL:-4}
}
say "$MODEL as an FP8 release ($LAYOUT) and its dequantized twin"
run export-release "$FOVEA" export-model "$MODEL" "$WORK/release" --fp8-weights "$LAYOUT"
run export-twin "$FOVEA" export-model "$WORK/release" "$WORK/twin" --fp8-weights none
say "transformers on the twin (its dequantized forward)"
run make-golden timeout 900 $PY tools/make-golden.py --model "$WORK/twin" --out "$WORK" --name golden --grids "$GRIDS" --device cuda
for mode in "bf16-linears release" "fp8-linears release --fp8-linears" "fp8-linears-requantized twin --fp8-linears"; do
  read -r name ckpt flags <<< "$mode"
  say "check-golden: $name ($ckpt${flags:+ $flags}), BF16 attention"
  # shellcheck disable=SC2086  # flags is a list
  TAIL=6 run "check-$name" "$FOVEA" check-golden "$WORK/$ckpt" "$WORK/golden.safetensors" --mm-encoder-attn-dtype bf16 \
    $flags --json "$OUT/check-$name.json"
done
for ckpt in release twin; do
  say "bench encoder: the $ckpt ($RESOLUTIONS, $DTYPES)"
  TAIL=12 run "bench-$ckpt" "$FOVEA" bench encoder "$WORK/$ckpt" --resolutions "$RESOLUTIONS" --dtype "$DTYPES" \
    --reps "$REPS" --json "$OUT/bench-$ckpt.json"
done
exit $failed
