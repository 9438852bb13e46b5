#!/usr/bin/env bash
# On the GPU machine: fovea's attention kernels beside torch SDPA, one table (bench/RESULTS.md).
set -uo pipefail
source "$(dirname "$0")/env.sh"
PYTHONUNBUFFERED=1 python3 bench/attention-peers.py --fovea "$B/fovea" --json "$OUT/peers.json" ${SHAPES:+--shapes $SHAPES} 2>"$OUT/peers.log"
tail -5 "$OUT/peers.log"
echo "== SASS (wgmma instructions in the fovea binary)"
cuobjdump --dump-sass "$B/fovea" > "$OUT/sass.txt" 2>&1; grep -oE "[HQ]GMMA\.[0-9A-Za-z.]+" "$OUT/sass.txt" | sort | uniq -c | head; head -c 300 "$OUT/sass.txt"
