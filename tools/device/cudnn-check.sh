#!/usr/bin/env bash
# On the GPU machine (issue 16): the CUDNN backend on the H200. Its GPU tests and every other GPU test
# (the fat binary changed what FOVEA links with), fovea info's per-GPU backend lines, and BF16
# attention beside FOVEA's (bench attention --backend FOVEA,CUDNN). The machine's system cuDNN is
# 9.14; the CUDNN backend needs 9.15, so the cuDNN of the Python wheel there is put first on the
# library path. Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
W=$(python3 -c "import nvidia.cudnn as c; print(c.__path__[0] + '/lib')" 2>/dev/null || true)
[ -n "$W" ] && export LD_LIBRARY_PATH="$W:${LD_LIBRARY_PATH:-}"
echo "cuDNN from: ${W:-system}"
"$B/fovea" info 2>&1 | head -8
timeout 240 "$B/test-attention-gpu" > "$OUT/test-attention-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-attention-gpu.txt"
grep -E "cudnn" "$OUT/test-attention-gpu.txt" | head -20
timeout 200 "$B/test-encoder-gpu" > "$OUT/test-encoder-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|bf16 merged" "$OUT/test-encoder-gpu.txt"
grep -h -B2 -A8 "Failure$" "$OUT"/test-*.txt | head -40
echo "== 8B encoder, 3 images, BF16: FOVEA against CUDNN"
timeout 120 "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions HD,4K --images-per-request 3 --reps 5 --warmup 1 \
  --dtype bf16,cudnn-bf16 2>&1 | tail -5
echo "== attention beside torch SDPA (bench/attention-peers.py: fovea cudnn, fovea bf16/fp8, torch flash/cuDNN)"
PYTHONUNBUFFERED=1 timeout 150 python3 bench/attention-peers.py --fovea "$B/fovea" --reps 20 \
  --shapes 3520+3520+3520:72,8192:72,32640:72,8192:128 --json "$OUT/peers.json" 2>"$OUT/peers.log" | tail -8
grep -E "rror" "$OUT/peers.log" | head -5
