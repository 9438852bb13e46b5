#!/usr/bin/env bash
# The side-by-side serve matrix, on a GPU machine:
#   bench/serve-matrix.sh [FOVEA]
# For each resize budget in $BUDGETS (pixels; FullHD 2073600 and 4K 8294400) the load images are
# photographs ($PHOTOS, default data/photos: tools/fetch-photos.sh) cropped and resized to that frame
# (1920x1080, 3840x2160: JPEG q90, NIMAGES of them; needs Pillow), and then:
#   1. for each dtype in $DTYPES (bf16, fp8-static; also fp8 = fp8-dynamic): `fovea serve MODEL
#      --max-pixels BUDGET` (fp8-static: --mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path
#      FILE, FILE made once per run by `fovea bench calibration` on these images), bench/serve-load.py
#      at each concurrency in $LEVELS (images/s, p50/p99, images per forward, forward busy from
#      /metrics), the server's threads sampled during each level (bench/thread-sample.py), GPU memory
#      sampled meanwhile (nvidia-smi), the server's peak RSS (VmHWM), SIGTERM and its exit code; with
#      ENDPOINTS="encode chat", each fovea dtype runs twice: POST /v1/encode (embeddings in the
#      replies, no cache), then vLLM's encode instance, POST /v1/chat/completions (server "fovea-chat":
#      --ec-storage-path under /dev/shm when it has 32 GB free, files written, small replies; every
#      image part a fresh key);
#   2. with PEER=1, the same load against bench/hf-serve-peer.py (transformers, BF16; needs torch and
#      transformers);
#   3. with BOUND=1, the GPU bound: `fovea bench encoder` at the bench resolution nearest the load's
#      tokens per image, one image per forward and as many as --max-batch-tokens packs, BF16 and
#      FP8 static, in images/s (and scaled linearly to the load's exact token count).
# JSON in $OUT (run-*.json per server, bound-*.json, load-*.json per level, images-*/images.json),
# then the summary tables (python3 bench/serve-matrix.py summary $OUT). Elapsed time per step is
# printed; with DEADLINE (s) a step that would start past it is skipped and every load level is cut
# at it (DEADLINE=540 keeps a run inside a 600 s limit).
#
# Examples:
#   BUDGETS=2073600 bench/serve-matrix.sh                    # FullHD: fovea BF16, FP8 static, the peer, the bound
#   BUDGETS=8294400 PEER=0 bench/serve-matrix.sh build/fovea # 4K, fovea only
# Other knobs: ENDPOINTS (encode; "encode chat" adds the encode-instance runs), LOAD_EXTRA (more
# serve-load.py flags for every run, e.g. --deepstack), LEVELS (1,4,16,64), REQUESTS per level (64 up to 4 MP budgets, 32 above), WARMUP (4),
# NIMAGES (8), MAX_BATCH_TOKENS (16384, fovea serve's default, used by both servers), SCALES (an
# existing scale file: no calibration), MODEL (synthetic:qwen3-vl-8b), PHOTOS, PEER_ARGS (more
# hf-serve-peer.py flags), BENCH_REPS (5); and FOVEA, CUDNN_LIB, OUT, PYTHON (scripts/lib-gpu.sh).
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
P=$(photos_dir "${PHOTOS:-$FOVEA_ROOT/data/photos}") || exit 2
SCALES=${SCALES:+$(realpath -m -- "$SCALES")}
gpu_setup "${1:-}"
T0=$SECONDS
H=bench/serve-matrix.py
WORK=$(mktemp -d /tmp/fovea-serve-images.XXXXXX)
trap '[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; rm -rf "$WORK"' EXIT
M=${MODEL:-synthetic:qwen3-vl-8b}
BUDGETS=${BUDGETS:-${BUDGET:-2073600 8294400}}
DTYPES=${DTYPES-bf16 fp8-static}
[ "$DTYPES" = none ] && DTYPES=""
LEVELS=${LEVELS:-1,4,16,64}
ENDPOINTS=${ENDPOINTS:-encode}
LOAD_ARGS=""
PEER=${PEER:-1}
BOUND=${BOUND:-1}
NIMAGES=${NIMAGES:-8}
WARMUP=${WARMUP:-4}
MAX_BATCH_TOKENS=${MAX_BATCH_TOKENS:-16384}
DEADLINE=${DEADLINE:-0}
[ "$DEADLINE" -gt 0 ] 2>/dev/null || DEADLINE=1000000000  # none
BENCH_REPS=${BENCH_REPS:-5}
PEER_ARGS=${PEER_ARGS:-}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | head -1)
MAX_LEVEL=$(tr ',' '\n' <<< "$LEVELS" | sort -n | tail -1)

elapsed() { echo $((SECONDS - T0)); }
left() { echo $((DEADLINE - (SECONDS - T0))); }
say() { echo "== [$(elapsed) s] $*"; }
# need S WHAT: true if S seconds are left before DEADLINE, else says WHAT is skipped.
need() {
  [ "$(left)" -ge "$1" ] && return 0
  echo "   SKIPPED $2: $(left) s left before DEADLINE=$DEADLINE, it needs about $1 s"
  return 1
}
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 | tr -d ' '; }
# gpu_sampler PID FILE: every second while PID lives, "app,<pid>,<MiB>" per compute process and
# "gpu,<MiB>" for the device (memory.used) into FILE.
gpu_sampler() {
  command -v nvidia-smi > /dev/null || return 0
  while kill -0 "$1" 2>/dev/null; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | tr -d ' ' | sed 's/^/app,/'
    echo "gpu,$(gpu_used)"
    sleep 1
  done > "$2"
}
# gpu_peaks FILE PID BASELINE: "PROCESS_PEAK DEVICE_PEAK_OVER_BASELINE" in MiB ("null" when unknown).
gpu_peaks() {
  awk -F, -v p="$2" -v b="${3:-}" '
    $1 == "app" && $2 == p && $3 + 0 > a { a = $3 + 0 }
    $1 == "gpu" && $2 != "" && $2 + 0 > g { g = $2 + 0; seen = 1 }
    END { printf "%s %s\n", (a > 0 ? a : "null"), (seen && b != "" ? g - b : "null") }' "$1" 2>/dev/null || echo "null null"
}

# load_test NAME SERVER DTYPE BUDGET READY_S BASELINE MODEL: serve-load.py at each level against $url
# (process $pid), GPU memory sampled meanwhile; then peak RSS, SIGTERM, exit code; $OUT/run-NAME.json.
load_test() {
  local name=$1 server=$2 dtype=$3 budget=$4 ready=$5 base=$6 model=$7 loads=() first=1 t c cut
  timeout 120 $PY $H probe --url "$url" --image "$IMG0"
  gpu_sampler $pid "$OUT/gpu-$name.csv" &
  local sampler=$!
  for c in ${LEVELS//,/ }; do
    cut=$(( $(left) - 15 ))  # leave time to stop the server and print the summary
    if [ $cut -lt 10 ]; then echo "   SKIPPED concurrency $c and above: $(left) s left before DEADLINE=$DEADLINE"; break; fi
    t=$SECONDS
    # Where the CPU goes 3 to 6 s into the level: the server's threads by name, the machine, the clients.
    $PY bench/thread-sample.py --pid $pid --delay 3 --window 3 --also serve-load.py > "$OUT/threads-$name-c$c.txt" 2>&1 &
    timeout $cut $PY bench/serve-load.py --url "$url" --images "$IMG_DIR" --concurrency $c --requests $REQ $LOAD_ARGS ${LOAD_EXTRA:-} \
      --warmup $([ $first = 1 ] && echo $WARMUP || echo 0) --json "$OUT/load-$name-c$c.json" 2>&1 |
      grep -E "^serve-load \| +[0-9]|mean ms|first error|answered|Error"
    [ -f "$OUT/load-$name-c$c.json" ] && loads+=(--load "$OUT/load-$name-c$c.json") || echo "   concurrency $c: no result (cut at $cut s?)"
    echo "   [$(elapsed) s] concurrency $c took $((SECONDS - t)) s"
    first=0
  done
  local rss
  rss=$(awk '/^VmHWM/ {print $2}' /proc/$pid/status 2>/dev/null)
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  read -r gpu_app gpu_dev <<< "$(gpu_peaks "$OUT/gpu-$name.csv" $pid "$base")"
  stop_server; local rc=$?
  echo "   $name: peak RSS ${rss:-?} kB, GPU ${gpu_app} MiB (process) / ${gpu_dev} MiB (device over baseline), SIGTERM exit code $rc"
  $PY $H record --out "$OUT/run-$name.json" "${loads[@]}" server=$server dtype=$dtype budget=$budget \
    "image_size=[${IMG_W},${IMG_H}]" tokens_per_image=$IMG_TOKENS requests=$REQ ready_s=$ready \
    peak_rss_kb=${rss:-null} gpu_process_peak_mib=$gpu_app gpu_device_peak_over_baseline_mib=$gpu_dev \
    gpu_baseline_mib=${base:-null} exit_code=$rc max_batch_tokens=$MAX_BATCH_TOKENS "gpu=$GPU" "model=$model"
}

run_fovea() {  # BUDGET DTYPE [ENDPOINT: encode | chat]
  local budget=$1 dt=$2 endpoint=${3:-encode} flags t base name=fovea-$2-$1 server=fovea ec=""
  case $dt in
    bf16) flags="--mm-encoder-attn-dtype bf16" ;;
    fp8|fp8-dynamic) flags="--mm-encoder-attn-dtype fp8" ;;
    fp8-static)
      if [ ! -s "$SCALES" ]; then echo "   SKIPPED fovea fp8-static: no scale file"; return; fi
      flags="--mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path $SCALES" ;;
    *) echo "   SKIPPED dtype '$dt': not one of bf16, fp8, fp8-dynamic, fp8-static"; return ;;
  esac
  # The queue limits sized to the load (fovea's defaults, 64 requests and 65536 tokens, would answer
  # 503 queue_full to 4K images at concurrency 16): every client's request may wait.
  local queue="--max-queue $(( MAX_LEVEL > 64 ? MAX_LEVEL : 64 )) --max-queue-tokens $(( MAX_LEVEL * IMG_TOKENS > 65536 ? MAX_LEVEL * IMG_TOKENS : 65536 ))"
  if [ "$endpoint" = chat ]; then  # the encode instance: files in RAM as a one-host deployment keeps them
    local shm_gb
    shm_gb=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
    ec=$(mktemp -d "$([ -w /dev/shm ] && [ "${shm_gb:-0}" -ge 32 ] && echo /dev/shm || echo "$WORK")/fovea-ec.XXXXXX")
    flags="$flags --ec-storage-path $ec --ec-storage-min-age 0"
    name=fovea-$dt-chat-$budget server=fovea-chat
  fi
  say "fovea serve $M $flags --max-pixels $budget --max-batch-tokens $MAX_BATCH_TOKENS $queue ($endpoint)"
  need 60 "fovea $dt $endpoint at budget $budget" || return
  base=$(gpu_used); t=$SECONDS
  start_server "$FOVEA" "$OUT/$name.log" $M $flags --max-pixels $budget --max-batch-tokens $MAX_BATCH_TOKENS $queue || return
  echo "   listening on $url after $((SECONDS - t)) s; $(curl -s $url/metrics | grep -E '^fovea_(engine_info|fp8_scale_mode)' | tr '\n' ' ')"
  LOAD_ARGS=$([ "$endpoint" = chat ] && echo "--endpoint chat")
  load_test $name $server $dt $budget $((SECONDS - t)) "$base" "$M"
  LOAD_ARGS=""
  [ -n "$ec" ] && echo "   encoder cache: $(find "$ec" -name encoder_cache.safetensors | wc -l) files, $(du -sh "$ec" | cut -f1)" && rm -rf "$ec"
}

run_peer() {  # BUDGET
  local budget=$1 t base
  say "hf-serve-peer (transformers BF16, sdpa) --max-pixels $budget --max-batch-tokens $MAX_BATCH_TOKENS"
  need 90 "hf-serve-peer at budget $budget" || return
  base=$(gpu_used); t=$SECONDS
  start_peer "$OUT/hf-peer-$budget.log" --max-pixels $budget --max-batch-tokens $MAX_BATCH_TOKENS $PEER_ARGS || return
  echo "   after $((SECONDS - t)) s: $(grep -m1 "^hf-serve-peer: listening" "$OUT/hf-peer-$budget.log")"
  load_test hf-peer-bf16-$budget hf-peer bf16 $budget $((SECONDS - t)) "$base" "transformers Qwen3VLVisionModel, 8B vision config, random weights"
}

run_bound() {  # BUDGET: fovea bench encoder at the bench grid nearest the load's, 1 and K images per forward
  local budget=$1 res k benches=() n t
  res=$($PY -c "
import json, sys
p = json.load(open(sys.argv[1]))['patches']
g = {'HD': 3520, 'FullHD': 8160, 'QHD': 14400, '4K': 32640}
print(min(g, key=lambda r: abs(g[r] - p)), min(16, max(1, int(sys.argv[2]) // (p // 4))))" "$IMG_DIR/images.json" $MAX_BATCH_TOKENS)
  read -r res k <<< "$res"
  for n in $(echo 1 $k | tr ' ' '\n' | sort -nu); do
    say "GPU bound: fovea bench encoder $M --resolutions $res --images-per-request $n --dtype bf16,fp8-static"
    need 45 "bench encoder $res x $n" || continue
    t=$SECONDS
    timeout $(( $(left) - 10 )) "$FOVEA" bench encoder $M --resolutions $res --images-per-request $n --dtype bf16,fp8-static \
      --reps $BENCH_REPS --warmup 1 --json "$OUT/bench-encoder-$budget-x$n.json" 2>&1 | tail -3
    [ -s "$OUT/bench-encoder-$budget-x$n.json" ] && benches+=(--bench "$OUT/bench-encoder-$budget-x$n.json")
    echo "   [$(elapsed) s] took $((SECONDS - t)) s"
  done
  [ ${#benches[@]} -gt 0 ] && $PY $H bound --out "$OUT/bound-$budget.json" --images "$IMG_DIR/images.json" "${benches[@]}" --gpu "$GPU"
}

say "serve matrix: budgets [$BUDGETS], fovea dtypes [$DTYPES], levels $LEVELS, peer $PEER, GPU bound $BOUND, model $M, deadline $DEADLINE s"
for budget in $BUDGETS; do
  REQ=${REQUESTS:-$([ $budget -le 4194304 ] && echo 64 || echo 32)}
  IMG_DIR=$WORK/images-$budget
  say "load images for budget $budget"
  rm -rf "$IMG_DIR"
  $PY $H images --photos "$P" --out "$IMG_DIR" --budget $budget --count $NIMAGES || { echo "   no images: skipping budget $budget"; continue; }
  mkdir -p "$OUT/images-$budget" && cp "$IMG_DIR/images.json" "$OUT/images-$budget/"
  read -r IMG_W IMG_H IMG_TOKENS <<< "$($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(*d['size'], d['tokens'])" "$IMG_DIR/images.json")"
  IMG0=$(ls "$IMG_DIR"/*.jpg | head -1)
  if [[ " $DTYPES " == *" fp8-static "* ]] && [ ! -s "$SCALES" ]; then
    SCALES=$OUT/scales-calibrated.json
    say "calibration (once per call): fovea bench calibration on $((NIMAGES - 2)) of these images, 2 held out"
    t=$SECONDS
    if need 40 "calibration"; then
      timeout 300 "$FOVEA" bench calibration --model $M --dataset-path "$IMG_DIR" --calibration-images $((NIMAGES - 2)) \
        --scale-file "$SCALES" --max-pixels $budget --output-json "$OUT/calibration-$budget.json" 2>&1 | grep -E "calibrated on| \| |rror"
      "$FOVEA" scales inspect "$SCALES" 2>&1 | tail -1
      echo "   [$(elapsed) s] calibration took $((SECONDS - t)) s"
    fi
  fi
  for dt in $DTYPES; do for ep in $ENDPOINTS; do run_fovea $budget $dt $ep; done; done
  [ "$PEER" = 1 ] && run_peer $budget
  [ "$BOUND" = 1 ] && run_bound $budget
done
say "done"
$PY $H summary "$OUT"
