#!/usr/bin/env bash
# fovea's GPU kernels under Nsight Compute (ncu), on a Hopper GPU:
#   tools/kernel-profile.sh [FOVEA]
# Parts ($PARTS, default "flash"):
#   flash      the flash attention kernel, one launch per shape and dtype (`fovea bench attention`,
#              16 heads; $SHAPES, default "72:8192 128:8192 72:3520,3520,3520" as head_dim:seqlens):
#              plain timings, then registers, occupancy, issue activity and the top warp-stall reasons
#   bandwidth  the prepare step, LayerNorm and the amax statistics in the 8B encoder (3 x 4K, FP8
#              static): time and DRAM bytes per launch, against the copy bandwidth
#   full       `ncu --set full` on one launch each of prepare and LayerNorm: throughputs, occupancy,
#              excess sectors, bank conflicts, stall reasons
#   pipes      the FP8 flash kernel ($PIPE_SHAPES, default "72:8192 128:8192"): each pipe's share of
#              its peak (MUFU = xu), instructions executed per opcode and per pipe (which pipe F2FP
#              issues to: compare xu's count with MUFU's and F2FP's), L2 throughput, and the SASS
#              lines with the most warp-stall samples (tools/ncu-source-top.py)
# Full reports in $OUT/ncu-*.txt; short lines on stdout. NCU (default ncu) names the profiler; ncu
# may need root or the profiling permission (NVreg_RestrictProfilingToAdminUsers=0). Also FOVEA,
# CUDNN_LIB, OUT (scripts/lib-gpu.sh). For FP8 TFLOP/s of several builds and tile choices without a
# profiler: python3 tools/kernel-sweep.py --bins A,B --wgs auto,2,3.
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
gpu_setup "${1:-}"
PARTS=${PARTS:-flash}
NCU=${NCU:-$(cuda_tool ncu)} || die "no ncu (Nsight Compute comes with the CUDA toolkit; or set NCU=PATH)"
gpu_state
ENC4K=(bench encoder synthetic:qwen3-vl-8b --resolutions 4K --images-per-request 3 --dtype fp8-static --reps 1 --warmup 0)

if [[ $PARTS == *flash* ]]; then
  SECTIONS=(--section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats
            --section ComputeWorkloadAnalysis --section SpeedOfLight
            --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$')
  for spec in ${SHAPES:-72:8192 128:8192 72:3520,3520,3520}; do
    hd=${spec%%:*} seqs=${spec#*:}
    for dt in fp8 bf16; do
      say "flash kernel: head_dim $hd, seqlens $seqs, $dt"
      "$FOVEA" bench attention --device cuda --head-dim "$hd" --seqlens "$seqs" --dtype $dt --reps 20 --check 0 2>&1 | tail -2
      tag="hd$hd-${seqs//,/x}-$dt"
      timeout 300 "$NCU" --clock-control none -k regex:flash --launch-skip 3 --launch-count 1 "${SECTIONS[@]}" \
        "$FOVEA" bench attention --device cuda --head-dim "$hd" --seqlens "$seqs" --dtype $dt --reps 1 --warmup 3 --check 0 \
        > "$OUT/ncu-$tag.txt" 2>&1
      grep -E "Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|One or More Eligible|Warp Cycles Per Issued|Duration|Compute \(SM\) Throughput|Executed Ipc Active|Local Memory" \
        "$OUT/ncu-$tag.txt" | sed 's/^ */   /' | head -16
      echo "   top stall reasons (warps per issue-active cycle):"
      grep -E "smsp__average_warps_issue_stalled_" "$OUT/ncu-$tag.txt" | awk '{print $NF, $1}' | sort -gr | head -7 | sed 's/^/     /'
      grep -E "==ERR|==WARNING|LibraryNotLoaded|not supported" "$OUT/ncu-$tag.txt" | head -3
    done
  done
fi

if [[ $PARTS == *pipes* ]]; then
  for spec in ${PIPE_SHAPES:-72:8192 128:8192}; do
    hd=${spec%%:*} seqs=${spec#*:} tag="hd$hd-${seqs//,/x}-fp8"
    say "flash kernel pipes: head_dim $hd, seqlens $seqs, fp8"
    run=(bench attention --device cuda --head-dim "$hd" --seqlens "$seqs" --dtype fp8 --reps 1 --warmup 3 --check 0)
    timeout 300 "$NCU" --clock-control none -k regex:flash --launch-skip 3 --launch-count 1 --print-metric-instances values \
      --metrics 'regex:^sm__inst_executed_pipe_[a-z_]+\.(sum|avg\.pct_of_peak_sustained_active)$,regex:^sm__pipe_[a-z_]+_cycles_active\.avg\.pct_of_peak_sustained_active$,sass__inst_executed_per_opcode,lts__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum' \
      "$FOVEA" "${run[@]}" > "$OUT/ncu-pipes-$tag.txt" 2>&1
    grep -E "sm__(inst_executed_pipe|pipe)_.*(pct|sum)|lts__throughput|issue_active|gpu__time" "$OUT/ncu-pipes-$tag.txt" |
      awk '$NF != 0 && $NF != "0"' | sed 's/  */ /g' | head -60
    grep -A2 "sass__inst_executed_per_opcode" "$OUT/ncu-pipes-$tag.txt" | head -4 | cut -c1-1500
    timeout 300 "$NCU" --clock-control none -k regex:flash --launch-skip 3 --launch-count 1 --section SourceCounters \
      --section WarpStateStats -f -o "$OUT/ncu-source-$tag" "$FOVEA" "${run[@]}" > /dev/null 2>&1
    "$NCU" -i "$OUT/ncu-source-$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-source-$tag.csv" 2>&1
    python3 "$FOVEA_ROOT/tools/ncu-source-top.py" "$OUT/ncu-source-$tag.csv" --top 25
  done
fi

if [[ $PARTS == *bandwidth* ]]; then
  say "prepare, LayerNorm and amax under ncu (3 x 4K, FP8 static), time and DRAM bytes per launch"
  timeout 300 "$NCU" --clock-control none -k regex:"prepare_kernel|layernorm_kernel|qkv_amax" --launch-skip 6 --launch-count 6 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
    "$FOVEA" "${ENC4K[@]}" > "$OUT/ncu-bandwidth.txt" 2>&1
  grep -E "prepare_kernel|layernorm_kernel|qkv_amax|gpu__time|dram__bytes|dram__throughput|warps_active" "$OUT/ncu-bandwidth.txt" |
    sed 's/  */ /g' | head -40
  echo "   (the device's copy bandwidth, for comparison: 4.27 TB/s read + write on the H200, bench/RESULTS.md)"
fi

if [[ $PARTS == *full* ]]; then
  for k in prepare_kernel layernorm_kernel; do
    say "ncu --set full: $k (3 x 4K, FP8 static)"
    timeout 300 "$NCU" --clock-control none --set full -k regex:$k --launch-skip 2 --launch-count 1 \
      "$FOVEA" "${ENC4K[@]}" > "$OUT/ncu-full-$k.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Hit Rate|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit|Shared Memory Configuration Size|Bank Conflicts|Uncoalesced|excessive" \
      "$OUT/ncu-full-$k.txt" | sed 's/  */ /g' | head -30
    grep -E "^ +smsp__pcsamp_warps_issue_stalled|Stall" "$OUT/ncu-full-$k.txt" | head -8
  done
fi
