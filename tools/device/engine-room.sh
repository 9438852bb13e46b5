#!/usr/bin/env bash
# On the GPU machine (issue 11, the engine room: a refactor that must change no result and no
# number): the GPU tests, the attention kernels beside torch SDPA and the 8B encoder beside
# transformers in one call, then `fovea encode` on photographs and `fovea serve` under a short load
# through the new pipeline. Carry [".device-bin", "data/photos-device"]; logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== missing libraries"; ldd "$B/fovea" | grep "not found" || echo none
echo "== GPU tests"
for t in test-fp8-device test-attention-gpu test-encoder-gpu; do
  timeout 300 "$B/$t" > "$OUT/$t.txt" 2>&1; echo "$t exit $?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.txt" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure" "$OUT/$t.txt" | head -10
done
echo "== attention beside torch SDPA"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/attention-peers.py --fovea "$B/fovea" --reps 20 \
  --shapes 8192:72,3520+3520+3520:72,32640:72,8192:128 --json "$OUT/peers.json" 2>"$OUT/peers.log" | tail -8
echo "== 8B encoder beside transformers"
PYTHONUNBUFFERED=1 timeout 200 python3 bench/encoder-peers.py --fovea "$B/fovea" --resolutions HD,4K --reps 5 \
  --json "$OUT/encoder.json" 2>"$OUT/encoder.log" | tail -8
echo "== fovea encode (8B, FP8, photographs)"
imgs=$(ls data/photos-device/*.jpg 2>/dev/null | head -4)
timeout 120 "$B/fovea" encode synthetic:qwen3-vl-8b $imgs data/photos-device/missing.png --mm-encoder-attn-dtype fp8 \
  -o "$OUT/encode.safetensors" > "$OUT/encode.txt" 2>&1; echo "exit $? (1 expected: one file is missing)"; tail -8 "$OUT/encode.txt"
echo "== fovea serve (8B, FP8), short load"
if start_server "$OUT/serve.log" synthetic:qwen3-vl-8b --mm-encoder-attn-dtype fp8 --max-pixels 2073600; then
  timeout 120 python3 bench/serve-load.py --url $url --generate 8 --size 1920x1080 --concurrency 1,4,16 --requests 32 --warmup 4 \
    --json "$OUT/serve.json" 2>&1 | tail -6
  kill -TERM $pid; wait $pid; echo "server exit code $?"
fi
