#!/usr/bin/env bash
# On the GPU machine, one call: why the prepare step and LayerNorm stop short of the copy bandwidth.
# Nsight Compute's full set on one launch of each (3 x 4K, FP8 static), the lines that say where the
# time goes (throughputs, occupancy, the top warp stall reasons), and the FP8-linear GPU tests.
# Carry [".device-bin"]. Full reports under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== test-encoder-gpu (FP8 linears)"
timeout 120 "$B/test-encoder-gpu" --gtest_filter='*Fp8Linear*' 2>&1 | grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|fp8 linear|against fp32|Failure" -A1 | grep -v "^--"
for k in prepare_kernel layernorm_kernel; do
  echo "== ncu --set full: $k"
  timeout 150 ncu --clock-control none --set full -k regex:$k --launch-skip 2 --launch-count 1 \
    "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions 4K --images-per-request 3 --dtype fp8-static --reps 1 --warmup 0 \
    > "$OUT/ncu-full-$k.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Hit Rate|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit|Shared Memory Configuration Size|Bank Conflicts|Uncoalesced|excessive" "$OUT/ncu-full-$k.txt" | sed 's/  */ /g' | head -30
  grep -E "^ +smsp__pcsamp_warps_issue_stalled|Stall" "$OUT/ncu-full-$k.txt" | head -8
done
