#!/usr/bin/env bash
# On the GPU machine: where `fovea serve`'s time goes at the FullHD budget under load (issue 12,
# diagnosis). One server (8B, FP8 dynamic), the serve matrix's load images (photographs at 1920x1080).
# For each level (concurrency / client processes): bench/serve-load.py, with the server's phases per
# request (/metrics) and the client's view, and tools/device/thread-sample.py reading the server's
# threads and the machine's cores during the level. LEVELS="16/1 16/4 64/8" by default.
# Carry [".device-bin", "data/photos-device"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
M=synthetic:qwen3-vl-8b
BUDGET=${BUDGET:-2073600}
REQUESTS=${REQUESTS:-192}
IMG=/tmp/serve-images-$BUDGET
python3 tools/device/serve-matrix.py images --photos data/photos-device --out $IMG --budget $BUDGET --count 8 > /dev/null
start_server "$OUT/serve.log" $M --mm-encoder-attn-dtype fp8 --max-pixels $BUDGET --max-queue 128 --max-queue-tokens 300000 || exit 1
python3 bench/serve-load.py --url $url --images $IMG --concurrency 16 --requests 32 --warmup 4 > /dev/null 2>&1
for level in ${LEVELS:-16/1 16/4 64/8}; do
  c=${level%/*}; p=${level#*/}
  echo "== concurrency $c, $p client process(es), $REQUESTS requests"
  python3 bench/serve-load.py --url $url --images $IMG --concurrency $c --processes $p --requests $REQUESTS --warmup 0 \
    --json "$OUT/profile-c$c-p$p.json" > "$OUT/profile-c$c-p$p.txt" 2>&1 &
  client=$!
  python3 tools/device/thread-sample.py --pid $pid --delay 2 --window 3 --also serve-load.py
  wait $client
  grep -E "^serve-load \| +[0-9]|mean ms" "$OUT/profile-c$c-p$p.txt"
done
kill -TERM $pid; wait $pid; echo "server exit code $?"
