#!/usr/bin/env bash
# Sourced by the tools/device scripts: binary folder, output folder, cuDNN path, GPU state line.
B=${1:-.device-bin}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/$B/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
# start_server LOG ARGS...: `fovea serve ARGS --port 0` in the background; sets pid and url. Returns 1
# (after printing the log) if the server exits or has not said where it listens within 60 s.
start_server() {
  local log=$1
  shift
  "$B/fovea" serve "$@" --port 0 > "$log" 2>&1 &
  pid=$!
  url=""
  for _ in $(seq 240); do
    url=$(grep -oE "http://[0-9.]+:[0-9]+" "$log" | head -1)
    [ -n "$url" ] && return 0
    kill -0 $pid 2>/dev/null || break  # it exited (a startup error)
    sleep 0.25
  done
  echo "server did not start:"; cat "$log"; kill $pid 2>/dev/null
  return 1
}
