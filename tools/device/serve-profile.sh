#!/usr/bin/env bash
# On the GPU machine: where `fovea serve` spends its CPU at the FullHD budget under load (issue 12,
# diagnosis). One server (8B, FP8 dynamic), the serve matrix's load images (photographs at 1920x1080),
# then: one client process at concurrency 16, with the server's busiest threads and every process's
# CPU sampled 5 s in; and two client processes at concurrency 8 each at once (is one Python client
# process the limit?). Carry [".device-bin", "data/photos-device"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
M=synthetic:qwen3-vl-8b
BUDGET=2073600
IMG=/tmp/serve-images-$BUDGET
python3 tools/device/serve-matrix.py images --photos data/photos-device --out $IMG --budget $BUDGET --count 8 > /dev/null
start_server "$OUT/serve.log" $M --mm-encoder-attn-dtype fp8 --max-pixels $BUDGET --max-queue 128 --max-queue-tokens 300000 || exit 1
python3 bench/serve-load.py --url $url --images $IMG --concurrency 16 --requests 32 --warmup 4 > /dev/null 2>&1
(sleep 5; echo "-- server threads (top -H)"; top -b -n 1 -H -p $pid | sed -n 7,20p
 echo "-- processes"; top -b -n 1 -w 200 | sed -n 7,14p) &
sampler=$!
python3 bench/serve-load.py --url $url --images $IMG --concurrency 16 --requests 128 --warmup 0 2>&1 | grep -E "^serve-load \| +[0-9]|mean ms"
wait $sampler
echo "-- two client processes at once, concurrency 8 and 64 requests each"
t0=$(date +%s.%N)
clients=()
for k in 1 2; do
  python3 bench/serve-load.py --url $url --images $IMG --concurrency 8 --requests 64 --warmup 0 > "$OUT/two-$k.txt" 2>&1 &
  clients+=($!)
done
wait "${clients[@]}"
python3 -c "import sys, time; print(f'two clients: 128 requests in {time.time() - float(sys.argv[1]):.2f} s')" $t0
grep -hE "^serve-load \| +[0-9]" "$OUT"/two-*.txt
kill -TERM $pid; wait $pid; echo "server exit code $?"
