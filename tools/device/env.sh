#!/usr/bin/env bash
# Sourced by the tools/device scripts: binary folder, output folder, cuDNN path, GPU state line.
B=${1:-.device-bin}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/$B/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
# wait_listening LOG TRIES: waits (0.25 s a try) for the "http://HOST:PORT" line a server prints in
# LOG once it listens; sets url. Returns 1 (after printing the log) if $pid exits or TRIES run out.
wait_listening() {
  local log=$1 tries=$2
  url=""
  for _ in $(seq $tries); do
    url=$(grep -oE "http://[0-9.]+:[0-9]+" "$log" | head -1)
    [ -n "$url" ] && return 0
    kill -0 $pid 2>/dev/null || break  # it exited (a startup error)
    sleep 0.25
  done
  echo "server did not start:"; cat "$log"; kill $pid 2>/dev/null
  return 1
}
# start_server LOG ARGS...: `fovea serve ARGS --port 0` in the background; sets pid and url. Returns 1
# (after printing the log) if the server exits or has not said where it listens within 60 s.
start_server() {
  local log=$1
  shift
  "$B/fovea" serve "$@" --port 0 > "$log" 2>&1 &
  pid=$!
  wait_listening "$log" 240
}
# start_peer LOG ARGS...: bench/hf-serve-peer.py ARGS --port 0 (transformers' Qwen3-VL vision tower
# behind the same HTTP API) in the background; sets pid and url like start_server, waiting up to
# 240 s (importing torch and transformers and building the model take a while).
start_peer() {
  local log=$1
  shift
  PYTHONUNBUFFERED=1 ${PYTHON:-python3} ${PEER_SCRIPT:-bench/hf-serve-peer.py} "$@" --port 0 > "$log" 2>&1 &
  pid=$!
  wait_listening "$log" 960
}
