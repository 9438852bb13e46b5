#!/usr/bin/env bash
# On the GPU machine (issue 12: the host path): the GPU tests (encoder, attention, FP8 device), bench mm-processor's stage split for 1 and 3 FullHD-sized images
# (random-mm 1080x1920 at the FullHD budget, FP8 dynamic), `fovea encode` of three
# photographs, and fovea serve under load (generated FullHD PNGs, concurrency 1/4/16/64, BF16 and
# FP8; the load client reports the encoder worker's forward time over the wall time). Carry [".device-bin", "data/photos-device"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
M=synthetic:qwen3-vl-8b
for t in test-encoder-gpu test-attention-gpu test-fp8-device; do
  echo "== $t"
  timeout 300 "$B/$t" > "$OUT/$t.txt" 2>&1; echo "exit $?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.txt" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure" -A3 "$OUT/$t.txt" | head -20
done
for dt in fp8; do
  for k in 1 3; do
    echo "== bench mm-processor: $k x 1080x1920, $dt"
    timeout 120 "$B/fovea" bench mm-processor --model $M --dataset-name random-mm --random-mm-size 1080x1920 --max-pixels 2073600 \
      --images-per-request $k --num-prompts 10 --num-warmups 3 --mm-encoder-attn-dtype $dt 2>/dev/null | grep -E "^stage|^decode|^preprocess|^encoder|^  |^total"
  done
done
for run in 1 2; do  # each a cold process
  echo "== fovea encode: 3 photographs, fp8, run $run"
  timeout 120 "$B/fovea" encode $M data/photos-device/Aqua.jpg data/photos-device/Blinds.jpg data/photos-device/Dune.jpg \
    --mm-encoder-attn-dtype fp8 --max-pixels 2073600 -o /tmp/enc.safetensors 2>&1 | tail -5
done
for dt in ${SERVE_DTYPES-bf16 fp8}; do
  echo "== fovea serve $M --mm-encoder-attn-dtype $dt --max-pixels 2073600"
  start_server "$OUT/serve-$dt.log" $M --mm-encoder-attn-dtype $dt --max-pixels 2073600 || continue
  timeout 300 python3 bench/serve-load.py --url $url --generate 8 --size 1920x1080 --concurrency 1,4,16,64 --requests 48 \
    --warmup 4 --json "$OUT/serve-$dt.json" 2>&1 | grep -E "^serve-load \| +[0-9]|mean ms per image"
  grep -E "VmHWM" /proc/$pid/status
  kill -TERM $pid; wait $pid; echo "server exit code $?"
done
