#!/usr/bin/env bash
# fovea against transformers (and vLLM's reading of the encoder cache), on a GPU machine with torch,
# transformers, Pillow and OpenCV:
#   tools/conformance.sh [FOVEA]
# Parts ($PARTS, default "encoder video processor ec-cache"):
#   encoder    the full Qwen3-VL-8B architecture (fovea's synthetic weights, exported with `fovea
#              export-model`) in transformers (fp32 and BF16 on the GPU, TF32 off; tools/make-golden.py)
#              and in fovea (`check-golden`: BF16 held to 1.5x transformers BF16's own error, FP8
#              reported); a fresh 2-block 8B golden file checked on the CPU; and the committed 2-block
#              golden file through each GPU backend (FOVEA, CUDNN; CUDNN needs cuDNN 9.15+, see CUDNN_LIB)
#   video      a real clip (tests/data/video/bt709.mp4) packed with an image, through transformers'
#              video processor and vision model (8B shapes, 2 blocks), then fovea on the GPU (BF16, FP8)
#              and the CPU
#   processor  transformers' image processor on the synthetic images and on photographs ($PHOTOS),
#              then fovea's preprocessing against them (test-processor-golden, from the build of FOVEA)
#   ec-cache   fovea fills vLLM's encoder cache for three photographs (FullHD budget, BF16 then FP8);
#              tools/ec-cache-vllm.py loads each file as vLLM's ECExampleConnector does, splits it as
#              vLLM's Qwen3-VL model does, and compares every part with transformers; then the same
#              through `fovea serve`'s POST /v1/chat/completions, posted as vLLM's EPD proxy posts them
# Nothing in the tree is written: golden files made here come back in $OUT/golden.tar. Exit 0 when
# every check passes. Environment: PARTS, PHOTOS (default data/photos: tools/fetch-photos.sh), and
# FOVEA, FOVEA_BUILD, CUDNN_LIB, OUT, PYTHON (scripts/lib-gpu.sh).
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
PARTS=${PARTS:-encoder video processor ec-cache}
if [[ $PARTS == *processor* || $PARTS == *ec-cache* ]]; then
  P=$(photos_dir "${PHOTOS:-$FOVEA_ROOT/data/photos}") || exit 2
fi
gpu_setup "${1:-}"
WORK=$(mktemp -d /tmp/fovea-conformance.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
G=$WORK/golden; mkdir -p "$G"
failed=()
# check NAME CMD...: runs CMD (its output in $OUT/NAME.log), prints the log's last lines, and records NAME
# as failed on a non-zero exit.
check() {
  local name=$1 log
  shift
  log=$OUT/${name// /-}.log
  "$@" > "$log" 2>&1
  local rc=$?
  grep -v Warning "$log" | tail -8
  echo "   $name: exit code $rc"
  [ $rc = 0 ] || failed+=("$name")
}
gpu_state

if [[ $PARTS == *encoder* ]]; then
  say "full 8B encoder: transformers vs fovea"
  M=$WORK/qwen3vl-8b-synthetic; mkdir -p "$M"
  "$FOVEA" export-model synthetic:qwen3-vl-8b "$M" | tail -1
  check "make-golden 8B" timeout 600 $PY tools/make-golden.py --model "$M" --out "$WORK" --name golden-8b --device cuda
  check "8B bf16" "$FOVEA" check-golden "$M" "$WORK/golden-8b.safetensors" --mm-encoder-attn-dtype bf16 \
    --require-ratio 1.5 --json "$OUT/check-8b-bf16.json"
  check "8B fp8" "$FOVEA" check-golden "$M" "$WORK/golden-8b.safetensors" --mm-encoder-attn-dtype fp8 \
    --json "$OUT/check-8b-fp8.json"
  say "2-block 8B golden, made again and checked on the CPU"
  mkdir -p "$G/qwen3vl-8b-2blocks" "$WORK/qwen3vl-8b-2blocks"
  "$FOVEA" export-model synthetic:qwen3-vl-8b-2blocks "$WORK/qwen3vl-8b-2blocks" | tail -1
  check "make-golden 2-block" $PY tools/make-golden.py --model "$WORK/qwen3vl-8b-2blocks" --out "$G/qwen3vl-8b-2blocks" \
    --name golden --grids 1x8x8,2x4x4 --device cuda
  check "2-block cpu" "$FOVEA" check-golden synthetic:qwen3-vl-8b-2blocks "$G/qwen3vl-8b-2blocks/golden.safetensors" --device cpu
  say "the committed 2-block golden file through each GPU backend (BF16)"
  for be in FOVEA CUDNN; do
    check "2-block $be" "$FOVEA" check-golden synthetic:qwen3-vl-8b-2blocks tests/data/qwen3vl-8b-2blocks/golden.safetensors \
      --device cuda --mm-encoder-attn-backend $be --require-ratio 1.5 --json "$OUT/check-2b-$be.json"
  done
fi

if [[ $PARTS == *video* ]]; then
  say "a real clip packed with an image (8B shapes, 2 blocks)"
  M2=$WORK/qwen3vl-8b-2blocks-video; mkdir -p "$M2"
  "$FOVEA" export-model synthetic:qwen3-vl-8b-2blocks "$M2" | tail -1
  check "make-golden video" timeout 600 $PY tools/make-golden.py --model "$M2" --out "$G" --name golden-video --grids 1x4x4 \
    --video tests/data/video/bt709.mp4 --device cuda
  for run in "cuda bf16 --require-ratio 1.5" "cuda fp8" "cpu bf16 --require-ratio 1.5"; do
    set -- $run
    dev=$1 dt=$2; shift 2
    check "video $dev $dt" timeout 600 "$FOVEA" check-golden synthetic:qwen3-vl-8b-2blocks "$G/golden-video.safetensors" \
      --device "$dev" --mm-encoder-attn-dtype "$dt" --json "$OUT/check-video-$dev-$dt.json" "$@"
  done
fi

if [[ $PARTS == *processor* ]]; then
  say "image processor: transformers' golden files, fovea's preprocessing against them"
  if tpg=$(test_bin test-processor-golden); then
    R=$WORK/root; mkdir -p "$R/tests/data"   # a scratch root: the committed golden files stay as they are
    (cd "$R" && $PY "$FOVEA_ROOT/tools/make-processor-golden.py" --synthetic tests/data/processor \
      --photos "$P" --out "$R/processor-photos") 2>&1 | tail -12
    cp -r "$R/tests/data/processor" "$G/processor"
    mkdir -p "$G/processor-photos" && cp "$R"/processor-photos/cases.json "$R"/processor-photos/golden.safetensors "$G/processor-photos/"
    check "processor synthetic" env FOVEA_ROOT="$R" "$tpg" --gtest_filter=*SyntheticImages
    check "processor photos" env FOVEA_ROOT="$R" FOVEA_PROCESSOR_GOLDEN="$R/processor-photos" "$tpg" --gtest_filter=*Photos
  else
    echo "   no test-processor-golden in $FOVEA_BUILD"; failed+=("processor (no test binary)")
  fi
fi

if [[ $PARTS == *ec-cache* ]]; then
  say "vLLM's encoder-cache files: fovea writes them, read as vLLM reads them, against transformers"
  M=$WORK/qwen3vl-8b-synthetic; mkdir -p "$M"
  [ -f "$M/config.json" ] || "$FOVEA" export-model synthetic:qwen3-vl-8b "$M" | tail -1
  imgs=("$P/Aqua.jpg" "$P/Blinds.jpg" "$P/Gulp.png")
  for dt in bf16 fp8; do
    C=$WORK/ec-$dt
    echo "-- fovea encode --ec-storage-path, $dt (twice: the second run finds every file)"
    "$FOVEA" encode "$M" "${imgs[@]}" --ec-storage-path "$C" --max-pixels 2073600 --mm-encoder-attn-dtype $dt 2>&1 | tail -3
    "$FOVEA" encode "$M" "${imgs[@]}" --ec-storage-path "$C" --max-pixels 2073600 --mm-encoder-attn-dtype $dt 2>&1 | tail -1
    check "ec-cache $dt" timeout 600 $PY tools/ec-cache-vllm.py --model "$M" --cache "$C" --max-pixels 2073600 "${imgs[@]}"
    echo "-- fovea serve as vLLM's encode instance, $dt: the images posted as the EPD proxy posts them"
    C=$WORK/ec-chat-$dt
    "$FOVEA" serve "$M" --port 0 --ec-storage-path "$C" --max-pixels 2073600 --mm-encoder-attn-dtype $dt \
      >"$OUT/serve-ec-$dt.log" 2>&1 &
    spid=$!
    port=""
    for _ in $(seq 1 600); do
      port=$(sed -n 's/.*listening on http:\/\/[^ ]*:\([0-9]*\).*/\1/p' "$OUT/serve-ec-$dt.log" | head -1)
      [ -n "$port" ] || ! kill -0 $spid 2>/dev/null && break
      sleep 0.5
    done
    if [ -n "$port" ]; then
      check "ec-cache via chat $dt" timeout 600 $PY tools/ec-cache-vllm.py --model "$M" --cache "$C" --max-pixels 2073600 \
        --via-chat "http://127.0.0.1:$port" "${imgs[@]}"
    else
      echo "   fovea serve did not start (log: $OUT/serve-ec-$dt.log)"; failed+=("ec-cache via chat $dt (no server)")
    fi
    kill $spid 2>/dev/null; wait $spid 2>/dev/null
  done
fi

tar -C "$G" -cf "$OUT/golden.tar" . && echo "golden files made here: $OUT/golden.tar"
if [ ${#failed[@]} -eq 0 ]; then echo "conformance: every check passed (logs in $OUT)"; exit 0; fi
echo "conformance: FAILED: ${failed[*]}"
exit 1
