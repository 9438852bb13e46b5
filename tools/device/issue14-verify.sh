#!/usr/bin/env bash
# On the GPU machine, one call (issue 14, round 2): what session 7 could not run. The committed
# build's GPU tests (attention, encoder) and the kernel's static instruction mix; FP8 TFLOP/s with
# each tile choice (kernel-sweep.py) and beside torch SDPA; the 8B encoder beside transformers eager
# and torch.compile (HD and 4K); an Nsight Compute profile of the 3-warpgroup FP8 kernel built with
# packed-f16 exponentials (the 35-45% drop nobody has profiled), when that variant is staged:
#   tools/device/stage.sh && tools/device/kernel-variants.sh half3=-DFOVEA_FP8_FMA_EXP_MASK_3WG=0xAAAA
# Carry [".device-bin"]. Short tables on stdout, logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== test-attention-gpu, test-encoder-gpu"
timeout 240 "$B/test-attention-gpu" > "$OUT/test-attention-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-attention-gpu.txt"
timeout 150 "$B/test-encoder-gpu" > "$OUT/test-encoder-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-encoder-gpu.txt"
timeout 60 "$B/test-fp8-device" > "$OUT/test-fp8-device.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-fp8-device.txt"
grep -h -A3 "Failure$" "$OUT"/test-*.txt | head -20
python3 -c 'import re,sys; r=[(float(m[2])/float(m[1]),m[0].strip()) for m in re.findall(r"^(?!bf16)(.{28}).*\| emu rel (\S+) .*gpu-vs-emu rel (\S+)", open(sys.argv[1]).read(), re.M)]; print("largest FP8 gpu-vs-emu / emu error: %.3f (%s)" % max(r))' "$OUT/test-attention-gpu.txt"
echo "== SASS instruction mix"
cuobjdump --dump-sass "$B/fovea" 2>/dev/null | python3 "$(dirname "$0")/sass-mix.py" | grep -E "kernel|fp8 hd(72|128)"
echo "== FP8 sweep (committed build)"
python3 "$(dirname "$0")/kernel-sweep.py" --bins "$B/fovea" --wgs auto,2,3 --json "$OUT/sweep.json" 2>"$OUT/sweep.log"
echo "== beside torch SDPA"
PYTHONUNBUFFERED=1 timeout 200 python3 bench/attention-peers.py --fovea "$B/fovea" \
  --shapes 1024:72,3520+3520+3520:72,8192:72,32640:72,1024:128,8192:128,16384:128 --json "$OUT/peers.json" \
  2>"$OUT/peers.log" | tail -9
echo "== 8B encoder beside transformers (eager and torch.compile)"
PYTHONUNBUFFERED=1 timeout 300 python3 bench/encoder-peers.py --fovea "$B/fovea" --resolutions HD,4K --reps 5 \
  --json "$OUT/encoder.json" 2>"$OUT/encoder.log" | tail -5
echo "== prepare and LayerNorm against the copy bandwidth (3 x 4K, FP8 static)"
python3 - <<'PY' 2>&1 | tail -1
import torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(10): y.copy_(x)
b.record(); b.synchronize()
print(f"device copy: {2 * 10 * x.numel() / (a.elapsed_time(b) * 1e-3) / 1e12:.2f} TB/s (read + write bytes)")
PY
timeout 120 ncu --clock-control none -k regex:"prepare_kernel|layernorm_kernel|qkv_amax" --launch-skip 6 --launch-count 6 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
  "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions 4K --images-per-request 3 --dtype fp8-static --reps 1 --warmup 0 \
  > "$OUT/ncu-bandwidth.txt" 2>&1
grep -E "prepare_kernel|layernorm_kernel|qkv_amax|gpu__time|dram__bytes|dram__throughput|warps_active" "$OUT/ncu-bandwidth.txt" | sed 's/  */ /g' | head -40
if [ -f "$B/variants/half3" ]; then
  echo "== ncu: FP8 hd72 S8192, 3 warpgroups, packed-f16 share 50%"
  FOVEA_FLASH_WARPGROUPS=3 timeout 200 ncu --clock-control none -k regex:flash --launch-skip 3 --launch-count 1 \
    --section SchedulerStats --section WarpStateStats --section LaunchStats \
    --metrics regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$ \
    "$B/variants/half3" bench attention --device cuda --head-dim 72 --seqlens 8192 --dtype fp8 --reps 1 --warmup 3 --check 0 \
    > "$OUT/ncu-half3.txt" 2>&1
  grep -E "Registers Per Thread|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Local Memory" "$OUT/ncu-half3.txt" | head -8
  grep -E "smsp__average_warps_issue_stalled_" "$OUT/ncu-half3.txt" | awk '{print $NF, $1}' | sort -gr | head -6
fi
