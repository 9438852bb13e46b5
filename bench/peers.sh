#!/usr/bin/env bash
# fovea beside its peers on one GPU machine (torch, transformers; OpenCV for the video part):
#   bench/peers.sh [FOVEA]
# Parts ($PARTS, default "attention encoder"; add "video" for the clip):
#   attention  bench/attention-peers.py: fovea's FP8 and BF16 attention kernels (and the CUDNN
#              backend's BF16) beside torch SDPA (flash and cuDNN), TFLOP/s, 16 heads; shapes
#              $ATTN_SHAPES (default 1024:72,3520+3520+3520:72,8192:72,32640:72,1024:128,8192:128,16384:128)
#   encoder    bench/encoder-peers.py: the Qwen3-VL-8B vision encoder (random weights), 3 images a
#              forward at $RESOLUTIONS (default HD,4K), fovea BF16 / FP8 dynamic / FP8 static / CUDNN
#              beside transformers BF16 eager and torch.compile (NO_COMPILE=1 leaves that out)
#   video      bench/video-peers.py: a clip end to end (decode, preprocess, forward), fovea BF16 and
#              FP8 beside transformers; $CLIP, or else a 60 s FullHD H.264 test clip made here with the
#              ffmpeg command line (testsrc2 at 0.5 Mbit/s, as recorded in bench/RESULTS.md)
# Tables on stdout, JSON and logs in $OUT. Also: FOVEA, CUDNN_LIB, OUT, PYTHON (scripts/lib-gpu.sh).
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
CLIP=${CLIP:+$(realpath -m -- "$CLIP")}
gpu_setup "${1:-}"
PARTS=${PARTS:-attention encoder}
rc=0
gpu_state

if [[ $PARTS == *attention* ]]; then
  say "attention beside torch SDPA"
  PYTHONUNBUFFERED=1 $PY bench/attention-peers.py --fovea "$FOVEA" --reps "${REPS:-20}" \
    --shapes "${ATTN_SHAPES:-1024:72,3520+3520+3520:72,8192:72,32640:72,1024:128,8192:128,16384:128}" \
    --json "$OUT/attention-peers.json" 2> "$OUT/attention-peers.log" || { rc=1; tail -5 "$OUT/attention-peers.log"; }
fi

if [[ $PARTS == *encoder* ]]; then
  say "8B encoder beside transformers"
  PYTHONUNBUFFERED=1 $PY bench/encoder-peers.py --fovea "$FOVEA" --resolutions "${RESOLUTIONS:-HD,4K}" --reps 5 \
    ${NO_COMPILE:+--no-compile} --json "$OUT/encoder-peers.json" 2> "$OUT/encoder-peers.log" ||
    { rc=1; tail -5 "$OUT/encoder-peers.log"; }
fi

if [[ $PARTS == *video* ]]; then
  say "a clip end to end beside transformers"
  if [ -z "$CLIP" ]; then
    CLIP=$OUT/fullhd-60s.mp4
    ffmpeg -v error -y -f lavfi -i testsrc2=size=1920x1080:rate=30 -t 60 -c:v libx264 -preset veryfast -b:v 500k \
      -pix_fmt yuv420p "$CLIP" || { echo "   could not make the test clip (ffmpeg with libx264?); set CLIP=FILE"; CLIP=""; rc=1; }
  fi
  if [ -n "$CLIP" ]; then
    PYTHONUNBUFFERED=1 $PY bench/video-peers.py --fovea "$FOVEA" --clip "$CLIP" --reps 3 --json "$OUT/video-peers.json" \
      2> "$OUT/video-peers.log" || { rc=1; tail -5 "$OUT/video-peers.log"; }
  fi
fi
exit $rc
