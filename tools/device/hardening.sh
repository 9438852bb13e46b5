#!/usr/bin/env bash
# On the GPU machine (issue 10): the binaries built here run there with the new static image
# decoders and the Asio/Beast server; the GPU encoder tests pass; `fovea serve` with the Qwen3-VL-8B
# encoder (synthetic weights) under load (generated FullHD PNGs, concurrency 1/4/16) with /health
# sampled meanwhile; then SIGTERM (exit code printed). Carry [".device-bin"]; logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== missing libraries"; ldd "$B/fovea" | grep "not found" || echo none
"$B/fovea" info 2>&1 | tail -3
echo "== test-encoder-gpu"
timeout 240 "$B/test-encoder-gpu" 2>&1 | tee "$OUT/test-encoder-gpu.txt" | grep -E "^\[  (PASSED|FAILED)|rel|cos|Failure" | head -20
for dt in ${DTYPES:-bf16 fp8}; do
  echo "== fovea serve synthetic:qwen3-vl-8b --mm-encoder-attn-dtype $dt --max-pixels 2073600"
  start_server "$OUT/serve-$dt.log" synthetic:qwen3-vl-8b --mm-encoder-attn-dtype $dt --max-pixels 2073600 || continue
  ( for _ in $(seq 400); do curl -s -o /dev/null -w "%{time_total}\n" $url/health; sleep 0.05; done ) > "$OUT/health-$dt.txt" &
  hp=$!
  python3 bench/serve-load.py --url $url --generate 8 --size 1920x1080 --concurrency 1,4,16 --requests 48 --warmup 6 \
    --json "$OUT/serve-$dt.json" 2>&1 | tail -6
  kill $hp 2>/dev/null; wait $hp 2>/dev/null
  sort -n "$OUT/health-$dt.txt" | awk '{a[NR]=$1} END {if (NR) printf "/health under load: %d samples, p50 %.1f ms, p99 %.1f ms, max %.1f ms\n", NR, 1000*a[int(NR*0.5)+1], 1000*a[int(NR*0.99)], 1000*a[NR]}'
  kill -TERM $pid; wait $pid; echo "server exit code $?"
done
