#!/usr/bin/env bash
# On the GPU machine (issue 13, point 4): fovea fills vLLM's encoder cache for three photographs at
# the FullHD budget (the 8B architecture with fovea's synthetic weights, exported as a checkpoint so
# transformers loads the same weights; BF16 attention, then FP8), and tools/device/ec-cache-vllm.py
# loads each file as vLLM does and compares it with transformers. Carry [".device-bin", "data/photos-device"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
M=/tmp/qwen3vl-8b-synthetic; mkdir -p $M
"$B/fovea" export-model synthetic:qwen3-vl-8b $M | tail -1
IMGS="data/photos-device/Aqua.jpg data/photos-device/Blinds.jpg data/photos-device/Gulp.png"
for dt in bf16 fp8; do
  C=/tmp/ec-$dt; rm -rf $C
  echo "== fovea encode --ec-storage-path, $dt"
  "$B/fovea" encode $M $IMGS --ec-storage-path $C --max-pixels 2073600 --mm-encoder-attn-dtype $dt 2>&1 | tail -3
  "$B/fovea" encode $M $IMGS --ec-storage-path $C --max-pixels 2073600 --mm-encoder-attn-dtype $dt 2>&1 | tail -1
  echo "== vLLM's reading of it against transformers, $dt"
  timeout 400 python3 tools/device/ec-cache-vllm.py --model $M --cache $C --max-pixels 2073600 $IMGS 2>&1 | grep -v Warning
done
