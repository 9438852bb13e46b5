#!/usr/bin/env bash
# On the GPU machine: GPU tests (label gpu), memcheck on a small case, and the SASS check (QGMMA for
# FP8, HGMMA for BF16). Binaries are built on the development machine and carried in .device-bin/
# (tools/device/stage.sh); logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
ldd "$B/fovea" | grep "not found"
"$B/fovea" info 2>&1 | tee "$OUT/info.txt"
echo "== SASS: wgmma kinds in the flash kernels"
cuobjdump --dump-sass "$B/fovea" 2>/dev/null | grep -oE "\b[HQ]GMMA\.[0-9A-Z.x]+" | sort | uniq -c | head -20
echo "== test-fp8-device"
timeout 120 "$B/test-fp8-device" 2>&1 | tail -5
echo "== test-attention-gpu"
timeout 420 "$B/test-attention-gpu" "${GTEST_ARGS:---gtest_brief=0}" 2>&1 | tee "$OUT/test-attention-gpu.txt" | grep -E "^\[  |gpu rel|FAIL|Failure|error" | head -80
echo "== memcheck"
timeout 200 compute-sanitizer --tool memcheck "$B/test-attention-gpu" --gtest_filter='*Small*' 2>&1 | tail -6
