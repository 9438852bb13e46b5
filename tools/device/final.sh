#!/usr/bin/env bash
# On the GPU machine, one call after the FP8 accumulation fix: attention beside torch SDPA, the 8B
# encoder beside transformers (HD and 4K), and the serve load test with FP8 (stage breakdown).
# Run with carry [".device-bin", "data/photos-device"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== attention beside torch SDPA"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/attention-peers.py --fovea "$B/fovea" --reps 20 \
  --shapes 8192:72,3520+3520+3520:72,32640:72,8192:128 --json "$OUT/peers.json" 2>"$OUT/peers.log" | tail -8
for shape in "8192:72" "32640:72"; do
  "$B/fovea-alt" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype fp8 \
    --check 0 --json /tmp/b.json >/dev/null 2>&1 &&
  python3 -c "import json; r=json.load(open('/tmp/b.json'))['results'][0]; print('2-WG build $shape fp8 %.3f ms %.1f TFLOP/s' % (r['attn_ms'], r['tflops']))"
done
echo "== 8B encoder beside transformers"
PYTHONUNBUFFERED=1 timeout 200 python3 bench/encoder-peers.py --fovea "$B/fovea" --resolutions HD,4K --reps 5 \
  --json "$OUT/encoder.json" 2>"$OUT/encoder.log" | tail -8
echo "== serve load (FP8)"
DTYPES=fp8 LEVELS=1,16 REQUESTS=32 timeout 150 bash tools/device/serve.sh 2>&1 | tail -12
