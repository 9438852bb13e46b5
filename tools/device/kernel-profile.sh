#!/usr/bin/env bash
# On the GPU machine (issue 14, the "before" profile): fovea's attention kernels under Nsight Compute
# at the issue's shapes (FP8 and BF16, hd 72 at S 8192, hd 128 at S 8192), one kernel launch each:
# issue activity, warp stall reasons, occupancy and registers, plus the plain timings of `bench
# attention` beside them. Carry [".device-bin"]. Output: $OUT/ncu-*.txt and a short table.
set -uo pipefail
source "$(dirname "$0")/env.sh"
NCU=${NCU:-ncu}
SECTIONS="--section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --metrics regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
for spec in "72 8192" "128 8192" "72 3520,3520,3520"; do
  read -r hd seqs <<< "$spec"
  for dt in fp8 bf16; do
    echo "== head_dim $hd, seqlens $seqs, $dt"
    "$B/fovea" bench attention --device cuda --head-dim $hd --seqlens $seqs --dtype $dt --reps 20 --check 0 2>&1 | tail -2
    tag="hd$hd-${seqs//,/x}-$dt"
    timeout 240 $NCU --clock-control none -k regex:flash --launch-skip 3 --launch-count 1 $SECTIONS \
      "$B/fovea" bench attention --device cuda --head-dim $hd --seqlens $seqs --dtype $dt --reps 1 --warmup 3 --check 0 \
      > "$OUT/ncu-$tag.txt" 2>&1
    grep -E "Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|One or More Eligible|Warp Cycles Per Issued|Duration|Compute \(SM\) Throughput|Executed Ipc Active|Local Memory" \
      "$OUT/ncu-$tag.txt" | sed 's/^ */   /' | head -16
    echo "   top stall reasons (warps per issue-active cycle):"
    grep -E "smsp__average_warps_issue_stalled_" "$OUT/ncu-$tag.txt" | awk '{print $NF, $1}' | sort -gr | head -7 | sed 's/^/     /'
    grep -E "==ERR|==WARNING|LibraryNotLoaded|not supported" "$OUT/ncu-$tag.txt" | head -3
  done
done
