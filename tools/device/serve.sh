#!/usr/bin/env bash
# On the GPU machine: the load benchmark of `fovea serve` (issue #6). For BF16 and FP8 (dynamic
# scales): start a server with the Qwen3-VL-8B encoder (synthetic weights) on a free port, run
# bench/serve-load.py against it with real photographs at several concurrencies, then SIGTERM it
# (exit code printed). Run with carry [".device-bin", "data/photos-device"]; JSON results in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
P=${PHOTOS:-data/photos-device}
M=${MODEL:-synthetic:qwen3-vl-8b}
BUDGET=${BUDGET:-2073600}   # resize budget (pixels): a FullHD-sized image -> ~2000 tokens
for dt in ${DTYPES:-bf16 fp8}; do
  echo "== fovea serve $M --mm-encoder-attn-dtype $dt --max-pixels $BUDGET"
  start_server /tmp/serve-$dt.log $M --mm-encoder-attn-dtype $dt --max-pixels $BUDGET || continue
  python3 bench/serve-load.py --url $url --images $P --concurrency ${LEVELS:-1,4,16} --requests ${REQUESTS:-48} --warmup 6 \
    --json "$OUT/serve-$dt.json" 2>&1 | tail -8
  curl -s $url/metrics | grep -E "^fovea_(forward|images|tokens|fp8|nonfinite)" | head -12
  kill -TERM $pid; wait $pid; echo "server exit code $?"
done
