#!/usr/bin/env bash
# The CPU test suite, run RUNS times while a parallel build keeps every core busy: do the tests that
# wait on a server, a child process or a decoder hold on a loaded, shared machine?
#   scripts/loaded-suite.sh BUILD_DIR [RUNS] [LOAD_DIR]
# BUILD_DIR: a built fovea tree (its tests are run with `ctest -LE "gpu|photos" -j$JOBS`).
# LOAD_DIR: another configured build folder (default: none, then the caller makes the load); while
# the suite runs it is cleaned and rebuilt with -j$(nproc), again and again.
# Each run's ctest log is kept in $OUT (default loaded-suite-out); the summary lists every failed
# test by run. Exit status: 0 if every run passed, 1 otherwise.
# Environment: JOBS (2), OUT, LABELS_EXCLUDE ("gpu|photos").
set -uo pipefail
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
if [ $# -lt 1 ] || [ $# -gt 3 ]; then usage >&2; exit 2; fi
BUILD=$(realpath -- "$1") || exit 2
RUNS=${2:-10}
LOAD=${3:+$(realpath -- "$3")}
JOBS=${JOBS:-2}
OUT=$(realpath -m -- "${OUT:-loaded-suite-out}")
LABELS_EXCLUDE=${LABELS_EXCLUDE:-gpu|photos}
[ -f "$BUILD/CTestTestfile.cmake" ] || { echo "loaded-suite: $BUILD is not a build folder with tests" >&2; exit 2; }
[ -z "$LOAD" ] || [ -f "$LOAD/CMakeCache.txt" ] || { echo "loaded-suite: $LOAD is not a configured build folder" >&2; exit 2; }
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "loaded-suite: RUNS must be a positive number" >&2; exit 2; }
mkdir -p "$OUT"

load_pid=""
stop_load() {
  [ -n "$load_pid" ] || return 0
  kill -- -"$load_pid" 2>/dev/null
  wait "$load_pid" 2>/dev/null
  load_pid=""
}
trap stop_load EXIT
if [ -n "$LOAD" ]; then
  # Its own process group, so that stopping it stops the compilers too.
  setsid bash -c "while :; do cmake --build '$LOAD' --target clean >/dev/null 2>&1;
                   cmake --build '$LOAD' -j$(nproc) >/dev/null 2>&1; done" &
  load_pid=$!
fi

failed_runs=0
: > "$OUT/summary.txt"
for run in $(seq 1 "$RUNS"); do
  start=$(date +%s)
  (cd "$BUILD" && ctest -LE "$LABELS_EXCLUDE" -j"$JOBS" --output-on-failure) > "$OUT/run-$run.log" 2>&1
  rc=$?
  line="run $run/$RUNS: $(grep -E '[0-9]+% tests passed' "$OUT/run-$run.log" || echo 'no ctest summary') \
($(( $(date +%s) - start )) s, load average $(cut -d' ' -f1-3 /proc/loadavg))"
  if [ $rc -ne 0 ]; then
    failed_runs=$((failed_runs + 1))
    line+=$'\n'"$(sed -n '/The following tests FAILED/,$p' "$OUT/run-$run.log" | grep -E '^\s+[0-9]+ - ')"
  fi
  echo "$line" | tee -a "$OUT/summary.txt"
done
stop_load
echo "loaded-suite: $failed_runs of $RUNS runs had a failure (logs in $OUT)" | tee -a "$OUT/summary.txt"
[ $failed_runs -eq 0 ]
