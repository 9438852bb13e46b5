#!/usr/bin/env bash
# On the GPU machine (issue 14): the attention GPU tests on the default build, the static instruction
# mix of the flash kernels, then FP8 TFLOP/s of every build in .device-bin/variants (kernel-variants.sh)
# and of the default one with each tile-row choice, and finally the side-by-side table with torch SDPA
# for the default build (and the "before" one, when present). Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== test-attention-gpu"
timeout 420 "$B/test-attention-gpu" 2>&1 | tee "$OUT/test-attention-gpu.txt" | grep -E "^\[  (PASSED|FAILED) |Failure|FAILED|rel" | head -40
echo "== SASS instruction mix (static counts per kernel instance)"
cuobjdump --dump-sass "$B/fovea" 2>/dev/null | python3 "$(dirname "$0")/sass-mix.py"
bins="$B/fovea"
for v in "$B"/variants/*; do [ -f "$v" ] && bins="$bins,$v"; done
echo "== FP8 sweep"
python3 "$(dirname "$0")/kernel-sweep.py" --bins "$bins" --wgs ${WGS:-auto,2,3} --json "$OUT/sweep.json" 2>"$OUT/sweep.log"
tail -3 "$OUT/sweep.log"
if [ -z "${NO_PEERS:-}" ]; then
  for b in "$B/fovea" "$B/variants/before"; do
    [ -f "$b" ] || continue
    echo "== beside torch: $b"
    PYTHONUNBUFFERED=1 python3 bench/attention-peers.py --fovea "$b" --shapes ${PEER_SHAPES:-1024:72,3520+3520+3520:72,8192:72,32640:72,1024:128,8192:128,16384:128} \
      --json "$OUT/peers-$(basename "$b").json" 2>"$OUT/peers-$(basename "$b").log" | tail -9
  done
fi
