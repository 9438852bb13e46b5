#!/usr/bin/env bash
# Sourced by the GPU scripts (scripts/gpu-tests.sh, bench/*.sh, tools/*.sh); not run on its own.
# What they share: which binaries to run, where the cuDNN library comes from, where output goes, and
# starting and stopping a server. Environment, all optional:
#   FOVEA        the fovea binary (or the script's first argument); default build/fovea
#   FOVEA_BUILD  the build folder holding the test binaries (tests/test-*); default: the binary's folder
#   CUDNN_LIB    a folder put first on LD_LIBRARY_PATH, for a cuDNN newer than the system's (the CUDNN
#                backend needs 9.15+); "torch" takes the cuDNN of torch's pip wheel; default: nothing added
#   OUT          output folder (logs, JSON); default: a new /tmp/fovea-<script>.XXXXXX, printed
#   PYTHON       the Python with torch/transformers, for the scripts that need it; default python3
# Paths given relative are taken from the folder the script was started in; the scripts then run
# from the repository root.

FOVEA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}

die() { echo "$(basename "$0"): $*" >&2; exit 2; }
say() { echo "== $*"; }

# usage: prints the script's header comment (from line 2 to the first line that is not a comment).
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; }

# gpu_setup [FOVEA]: resolves FOVEA, FOVEA_BUILD, CUDNN_LIB and OUT, checks the binary, and changes to
# the repository root. Call it once, before anything else runs.
gpu_setup() {
  local given=${1:-${FOVEA:-}}
  if [ -n "$given" ]; then FOVEA=$(realpath -m -- "$given"); else FOVEA=$FOVEA_ROOT/build/fovea; fi
  [ -x "$FOVEA" ] || die "no fovea binary at $FOVEA (build one: cmake -S . -B build -G Ninja && cmake --build build; or pass FOVEA=PATH)"
  FOVEA_BUILD=$(realpath -m -- "${FOVEA_BUILD:-$(dirname "$FOVEA")}")
  use_cudnn_lib
  local name
  name=$(basename "$0" .sh)
  if [ -n "${OUT:-}" ]; then OUT=$(realpath -m -- "$OUT"); else OUT=$(mktemp -d "/tmp/fovea-$name.XXXXXX"); fi
  mkdir -p "$OUT"
  # FOVEA_ROOT: where the test binaries find tests/data, wherever they were built.
  export FOVEA FOVEA_BUILD OUT FOVEA_ROOT
  cd "$FOVEA_ROOT" || exit 2
  echo "$name: fovea $FOVEA; output in $OUT"
}

# use_cudnn_lib: puts $CUDNN_LIB first on LD_LIBRARY_PATH ("torch": the wheel's; empty: the system's).
use_cudnn_lib() {
  if [ "${CUDNN_LIB:-}" = torch ]; then
    CUDNN_LIB=$($PY -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null) ||
      die "CUDNN_LIB=torch: no nvidia.cudnn package for $PY"
  fi
  if [ -n "${CUDNN_LIB:-}" ]; then
    [ -d "$CUDNN_LIB" ] || die "CUDNN_LIB: no folder $CUDNN_LIB"
    CUDNN_LIB=$(realpath -- "$CUDNN_LIB")
    export LD_LIBRARY_PATH=$CUDNN_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  echo "cuDNN: ${CUDNN_LIB:-the system default}"
}

# test_bin NAME: the path of a test binary of the build (FOVEA_BUILD/tests/NAME, or FOVEA_BUILD/NAME
# for a flat folder of copied binaries); empty if there is none.
test_bin() {
  local f
  for f in "$FOVEA_BUILD/tests/$1" "$FOVEA_BUILD/$1"; do
    [ -x "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}

# cuda_tool NAME: the path of a CUDA toolkit program (cuobjdump, compute-sanitizer, ncu): from PATH, else
# from $CUDA_HOME/bin (default /usr/local/cuda); empty and false if there is none.
cuda_tool() {
  command -v "$1" 2>/dev/null && return 0
  local f=${CUDA_HOME:-/usr/local/cuda}/bin/$1
  [ -x "$f" ] && { echo "$f"; return 0; }
  return 1
}

# gpu_state: one line about GPU 0 (name, driver, clocks, temperature), when nvidia-smi is there.
gpu_state() {
  command -v nvidia-smi > /dev/null &&
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader -i 0
}

# photos_dir DIR: DIR if it holds images, else a message saying how to get some, and exit 2.
photos_dir() {
  local d
  d=$(realpath -m -- "$1")
  # Any .jpg or .png will do (ls of both globs fails when either matches nothing).
  [ -n "$(find "$d" -maxdepth 1 -type f \( -name '*.jpg' -o -name '*.png' \) -print -quit 2>/dev/null)" ] ||
    die "no photographs in $d: run tools/fetch-photos.sh (Debian's mate-backgrounds into data/photos) or set PHOTOS=DIR"
  echo "$d"
}

# wait_listening LOG TRIES: waits (0.25 s a try) for the "http://HOST:PORT" line a server prints in LOG
# once it listens; sets url. Returns 1 (after printing the log) if $pid exits or TRIES run out.
wait_listening() {
  local log=$1 tries=$2
  url=""
  for _ in $(seq "$tries"); do
    url=$(grep -oE "http://[0-9.]+:[0-9]+" "$log" | head -1)
    [ -n "$url" ] && return 0
    kill -0 "$pid" 2>/dev/null || break  # it exited (a startup error)
    sleep 0.25
  done
  echo "server did not start:"; cat "$log"; kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  pid=""
  return 1
}

# start_server BIN LOG ARGS...: `BIN serve ARGS --port 0` in the background; sets pid and url.
# Returns 1 (after printing the log) if the server exits or has not said where it listens within 120 s.
start_server() {
  local bin=$1 log=$2
  shift 2
  "$bin" serve "$@" --port 0 > "$log" 2>&1 &
  pid=$!
  wait_listening "$log" 480
}

# start_peer LOG ARGS...: bench/hf-serve-peer.py ARGS --port 0 (transformers' Qwen3-VL vision tower
# behind the same HTTP API) in the background; sets pid and url like start_server, waiting up to
# 240 s (importing torch and transformers and building the model take a while).
start_peer() {
  local log=$1
  shift
  PYTHONUNBUFFERED=1 $PY bench/hf-serve-peer.py "$@" --port 0 > "$log" 2>&1 &
  pid=$!
  wait_listening "$log" 960
}

# stop_server: SIGTERM to $pid, waits; returns its exit code (0: a clean shutdown).
stop_server() {
  [ -n "${pid:-}" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  local rc=$?
  pid=""
  return $rc
}

# A server still running when the script ends (an error, Ctrl-C) is stopped.
trap '[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null' EXIT
