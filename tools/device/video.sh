#!/usr/bin/env bash
# Issue 18 on the GPU machine, one call (after tools/device/stage-video.sh; carry [".device-bin",
# "data/video-device"]):
#  1. conformance: a real clip (tests/data/video/bt709.mp4, BT.709-tagged H.264) through transformers' video processor,
#     packed with a random image, in transformers' Qwen3VLVisionModel (the 8B shapes cut to two
#     blocks; fp32 and BF16) and in fovea (GPU BF16 and FP8, CPU): fovea check-golden;
#  2. a 60 s FullHD clip end to end, fovea BF16 / FP8 beside transformers (bench/video-peers.py);
#  3. fovea serve with images and 10 s 720p clips mixed (bench/serve-load.py --videos), BF16 and FP8.
#  4. fovea serve --devices 0 beside the plain single-device server (images, FullHD), issue 17;
#  gputests: the GPU test binaries of this build (stage with WITH_TESTS=1).
# PARTS (default "conformance e2e serve devices") picks the sections. Results in $OUT; the golden file
# comes back as $OUT/golden-video.safetensors.
set -uo pipefail
PARTS=${PARTS:-conformance e2e serve devices}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=/tmp/fovea-video; rm -rf $D; mkdir -p $D
python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .device-bin/video-bundle.tar.xz $D
# Only fovea sees the bundled libraries (python keeps its own).
cat > $D/fovea-run <<EOS
#!/bin/sh
LD_LIBRARY_PATH=$D/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib:\${LD_LIBRARY_PATH:-} exec $D/fovea "\$@"
EOS
chmod +x $D/fovea-run
F=$D/fovea-run
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
$F info 2>&1 | head -8
if [[ $PARTS == *gputests* ]]; then
echo "== GPU tests (this build)"
for t in test-attention-gpu test-encoder-gpu; do
  LD_LIBRARY_PATH=$D/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib timeout 240 $D/$t 2>&1 |
    tee "$OUT/$t.txt" | grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests ran" | head -20
done
fi
if [[ $PARTS == *conformance* ]]; then
echo "== 1. conformance: a real clip packed with an image (8B shapes, 2 blocks)"
M2=/tmp/qwen3vl-8b-2blocks; mkdir -p $M2
$F export-model synthetic:qwen3-vl-8b-2blocks $M2 | tail -1
timeout 300 python3 tools/make-golden.py --model $M2 --out "$OUT" --name golden-video --grids 1x4x4 \
  --video tests/data/video/bt709.mp4 --device cuda 2>&1 | tail -9
for run in "cuda bf16 --require-ratio 1.5" "cuda fp8" "cpu bf16 --require-ratio 1.5"; do
  set -- $run
  dev=$1 dt=$2; shift 2
  echo "-- check-golden $dev $dt $*"
  timeout 300 $F check-golden synthetic:qwen3-vl-8b-2blocks "$OUT/golden-video.safetensors" --device $dev \
    --mm-encoder-attn-dtype $dt --json "$OUT/check-video-$dev-$dt.json" "$@" 2>&1 | tail -6
  echo "exit code ${PIPESTATUS[0]}"
done
fi
if [[ $PARTS == *e2e* ]]; then
echo "== 2. 60 s FullHD clip end to end"
timeout 420 python3 bench/video-peers.py --fovea $F --clip data/video-device/long/fullhd-60s.mp4 --reps 3 \
  --json "$OUT/video-peers.json" 2> "$OUT/video-peers.log"
echo "exit code $?"; grep -E "video [^|]*:|grid|request 2/" "$OUT/video-peers.log" | head -6
fi
source "$(dirname "$0")/env.sh" .device-bin-none >/dev/null
if [[ $PARTS == *serve* ]]; then
echo "== 3. serve: images and clips mixed"
for dt in bf16 fp8; do
  log=$OUT/serve-$dt.log
  $F serve synthetic:qwen3-vl-8b --mm-encoder-attn-dtype $dt --video-min-pixels 4096 --video-max-pixels 25165824 \
    --max-body-bytes 268435456 --port 0 > "$log" 2>&1 &
  pid=$!
  if wait_listening "$log" 240; then
    timeout 200 python3 bench/serve-load.py --url "$url" --generate 4 --size 1280x720 --videos data/video-device/short \
      --video-every 4 --concurrency 16 --requests 48 --warmup 4 --json "$OUT/serve-$dt.json" 2>&1 | tail -12
    kill $pid; wait $pid 2>/dev/null
  fi
done
fi
if [[ $PARTS == *devices* ]]; then
echo "== 4. serve --devices 0 beside the single-device server (FullHD images, concurrency 16)"
mkdir -p /tmp/fullhd && python3 -c "
import sys; sys.path.insert(0, 'bench'); import importlib; sl = importlib.import_module('serve-load')
for i in range(3): open(f'/tmp/fullhd/{i}.png', 'wb').write(sl.png_bytes(1920, 1080, i))"
for flags in "" "--devices 0" "" "--devices 0"; do
  log=$OUT/serve-devices.log
  $F serve synthetic:qwen3-vl-8b --port 0 $flags > "$log" 2>&1 &
  pid=$!
  if wait_listening "$log" 240; then
    echo "-- serve ${flags:-(no --devices)}"
    timeout 120 python3 bench/serve-load.py --url "$url" --images /tmp/fullhd --concurrency 16 --requests 96 \
      --warmup 8 2>&1 | grep -E "^serve-load \| +16 "
    kill $pid; wait $pid 2>/dev/null
  fi
done
fi
echo "== done"
