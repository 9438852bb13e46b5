#!/usr/bin/env bash
# On the GPU machine, one call: conformance with transformers (issues #4 and #5).
#  1. the GPU encoder tests;
#  2. the full Qwen3-VL-8B architecture (fovea's synthetic weights, exported) in transformers (fp32
#     and BF16, on the GPU, TF32 off) and in fovea (BF16, FP8), same inputs: fovea check-golden;
#  3. golden files for the 2-block 8B shapes (committed to tests/data/qwen3vl-8b-2blocks);
#  4. transformers' image processor on the synthetic images and on photographs, then fovea's
#     preprocessing against them (test-processor-golden).
# Run with carry [".device-bin", "data/photos-device"]; results and small golden files land in $OUT.
set -uo pipefail
source "$(dirname "$0")/env.sh"
export FOVEA_ROOT=$PWD
PARTS=${PARTS:-encoder processor}
G=/tmp/golden; mkdir -p $G   # golden files made here come back as one tarball: $OUT/golden.tar
if [[ $PARTS == *encoder* ]]; then
echo "== test-encoder-gpu"
timeout 300 "$B/test-encoder-gpu" 2>&1 | grep -E "^\[  |rel|cos|FAIL|Failure|error" | head -30
echo "== full 8B: transformers vs fovea"
M=/tmp/qwen3vl-8b-synthetic; mkdir -p $M
"$B/fovea" export-model synthetic:qwen3-vl-8b $M | tail -1
timeout 300 python3 tools/make-golden.py --model $M --out /tmp --name golden-8b --device cuda 2>&1 | tail -12
for dt in bf16 fp8; do
  "$B/fovea" check-golden $M /tmp/golden-8b.safetensors --mm-encoder-attn-dtype $dt --json "$OUT/check-8b-$dt.json" \
    $([ $dt = bf16 ] && echo --require-ratio 1.5); echo "exit code $?"
done
echo "== 2-block 8B golden"
mkdir -p $G/qwen3vl-8b-2blocks
M2=/tmp/qwen3vl-8b-2blocks; mkdir -p $M2
"$B/fovea" export-model synthetic:qwen3-vl-8b-2blocks $M2 | tail -1
python3 tools/make-golden.py --model $M2 --out $G/qwen3vl-8b-2blocks --name golden --grids 1x8x8,2x4x4 --device cuda 2>&1 | tail -8
"$B/fovea" check-golden synthetic:qwen3-vl-8b-2blocks $G/qwen3vl-8b-2blocks/golden.safetensors --device cpu
fi
if [[ $PARTS == *processor* ]]; then
echo "== image processor golden files"
python3 tools/make-processor-golden.py --synthetic tests/data/processor 2>&1 | tail -20
cp -r tests/data/processor $G/processor
python3 tools/make-processor-golden.py --photos data/photos-device --out /tmp/processor-photos 2>&1 | tail -12
mkdir -p $G/processor-photos && cp /tmp/processor-photos/cases.json /tmp/processor-photos/golden.safetensors $G/processor-photos/
"$B/test-processor-golden" --gtest_filter=*SyntheticImages 2>&1 | grep -vE "^\[ *(RUN|OK) "
FOVEA_PROCESSOR_GOLDEN=/tmp/processor-photos "$B/test-processor-golden" --gtest_filter=*Photos 2>&1 | grep -vE "^\[ *(RUN|OK) "
fi
tar -C $G -cf "$OUT/golden.tar" . && ls -la "$OUT/golden.tar"
