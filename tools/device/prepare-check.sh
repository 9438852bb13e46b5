#!/usr/bin/env bash
# On the GPU machine, one short call: the staged, coalesced prepare kernel and the multi-row
# LayerNorm. Their GPU tests (attention against the emulation, the encoder against the CPU), their
# time and DRAM bytes under ncu (3 x 4K, FP8 static), prepare times from bench attention, and the 8B
# encoder at HD and 4K. Carry [".device-bin"].
set -uo pipefail
source "$(dirname "$0")/env.sh"
echo "== GPU tests"
timeout 150 "$B/test-attention-gpu" > "$OUT/test-attention-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-attention-gpu.txt"
python3 -c 'import re,sys; r=[(float(m[2])/float(m[1]),m[0].strip()) for m in re.findall(r"^(?!bf16)(.{28}).*\| emu rel (\S+) .*gpu-vs-emu rel (\S+)", open(sys.argv[1]).read(), re.M)]; print("largest FP8 gpu-vs-emu / emu error: %.3f (%s)" % max(r))' "$OUT/test-attention-gpu.txt"
timeout 90 "$B/test-encoder-gpu" > "$OUT/test-encoder-gpu.txt" 2>&1; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test-encoder-gpu.txt"
grep -h -A3 "Failure$" "$OUT"/test-*.txt | head -20
echo "== prepare and LayerNorm under ncu (3 x 4K, FP8 static)"
timeout 90 ncu --clock-control none -k regex:"prepare_kernel|layernorm_kernel" --launch-skip 4 --launch-count 4 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
  "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions 4K --images-per-request 3 --dtype fp8-static --reps 1 --warmup 0 \
  > "$OUT/ncu-bandwidth.txt" 2>&1
grep -E "prepare_kernel|layernorm_kernel|gpu__time|dram__bytes|dram__throughput" "$OUT/ncu-bandwidth.txt" | sed 's/  */ /g' | cut -c1-90 | head -20
echo "== bench attention (attention ms, prepare ms)"
for shape in 1024:72 3520,3520,3520:72 1024:128 8192:128; do
  "$B/fovea" bench attention --device cuda --seqlens ${shape%:*} --heads 16 --head-dim ${shape#*:} --dtype bf16,fp8 --reps 20 --check 0 \
    2>&1 | grep -E "^(bf16|fp8) " | sed "s/^/$shape /"
done
echo "== 8B encoder, 3 images"
timeout 120 "$B/fovea" bench encoder synthetic:qwen3-vl-8b --resolutions HD,4K --images-per-request 3 --reps 5 --warmup 1 \
  --dtype bf16,fp8-static 2>&1 | tail -5
