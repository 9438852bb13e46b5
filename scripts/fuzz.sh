#!/usr/bin/env bash
# Runs every libFuzzer harness of a FOVEA_FUZZ=ON build for a bounded time each, and fails if any of
# them finds a crash, a hang (-timeout), an out-of-memory (-rss_limit_mb) or a leak.
#   scripts/fuzz.sh BUILD_DIR [SECONDS_PER_HARNESS]      (scripts/sanitize.sh calls it on build-san)
# Each harness starts from a scratch copy of its seed corpus fuzz/corpus/<name>/ plus its regression
# inputs tests/fuzz-regressions/<name>/ (the committed folders are never written to). Harnesses run
# FOVEA_FUZZ_JOBS at a time (default: the number of cores), each on one core. A failing input is kept
# under BUILD_DIR/fuzz-artifacts/<name>/, the log under BUILD_DIR/fuzz-logs/<name>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: scripts/fuzz.sh BUILD_DIR [SECONDS_PER_HARNESS]}
seconds=${2:-30}
jobs=${FOVEA_FUZZ_JOBS:-$(nproc)}

cache="$build/CMakeCache.txt"
[ -f "$cache" ] || { echo "fuzz: $build is not a CMake build folder" >&2; exit 1; }
grep -q '^FOVEA_FUZZ:BOOL=ON' "$cache" || { echo "fuzz: $build was not configured with -DFOVEA_FUZZ=ON" >&2; exit 1; }
# The harness names: fuzz/CMakeLists.txt records them in the cache variable FOVEA_FUZZERS.
IFS=';' read -r -a names <<< "$(sed -n 's/^FOVEA_FUZZERS:INTERNAL=//p' "$cache")"
if [ ${#names[@]} -eq 0 ]; then
  echo "fuzz: no harness is registered in fuzz/CMakeLists.txt (fovea_fuzzer(<name>)): nothing was fuzzed" >&2
  exit 1
fi

# Sanitizer settings for the fuzzers (libFuzzer itself turns a report into a saved input).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:check_initialization_order=1:strict_init_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$build/fuzz-logs" "$build/fuzz-artifacts"

# One harness: scratch corpus, bounded run, verdict line in $work/<name>.verdict.
run_one() {
  local name=$1 bin="$build/fuzz/fuzz-$1" corpus="$work/corpus-$1" art="$build/fuzz-artifacts/$1"
  local log="$build/fuzz-logs/$1.log"
  mkdir -p "$corpus" "$art"
  rm -f "$art"/crash-* "$art"/timeout-* "$art"/oom-* "$art"/leak-* "$art"/slow-unit-*
  for d in "fuzz/corpus/$name" "tests/fuzz-regressions/$name"; do
    [ -d "$d" ] && find "$d" -maxdepth 1 -type f -exec cp -t "$corpus" {} +
  done
  if [ ! -x "$bin" ]; then
    echo "$name|missing|0|0|$bin was not built" > "$work/$name.verdict"
    return
  fi
  local rc=0 dict=()
  case "$name" in  # the JSON parsers get the JSON dictionary (escapes weighted: fuzz/dict/json.dict)
    encode-request|chat-request|json-bounded|model-config|preprocessor-config|scale-file|shard-index)
      dict=(-dict=fuzz/dict/json.dict) ;;
    stream-layout)  # start codes, parameter sets' NAL headers, profiles (fuzz/dict/stream-layout.dict)
      dict=(-dict=fuzz/dict/stream-layout.dict) ;;
  esac
  "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 "${dict[@]}" \
      -artifact_prefix="$art/" "$corpus" > "$log" 2>&1 || rc=$?
  local execs units
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  units=$(find "$corpus" -type f | wc -l)
  local found
  found=$(find "$art" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | head -1)
  if [ "$rc" -eq 0 ] && [ -z "$found" ]; then
    echo "$name|ok|${execs:-0}|$units|" > "$work/$name.verdict"
  else
    local kind
    kind=$(basename "${found:-exit-$rc}" | cut -d- -f1)
    echo "$name|$kind|${execs:-0}|$units|${found:-no input saved (exit $rc)}" > "$work/$name.verdict"
  fi
}

echo "fuzz: ${#names[@]} harness(es) x ${seconds} s, $jobs at a time: ${names[*]}"
start=$(date +%s)
running=0
for name in "${names[@]}"; do
  run_one "$name" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

failed=()
printf '%-24s | %-8s | %12s | %6s\n' harness result executions corpus
for name in "${names[@]}"; do
  IFS='|' read -r n result execs units input < "$work/$name.verdict"
  printf '%-24s | %-8s | %12s | %6s\n' "$n" "$result" "$execs" "$units"
  [ "$result" = ok ] || failed+=("$n|$result|$input")
done
for f in "${failed[@]}"; do
  IFS='|' read -r n result input <<< "$f"
  echo
  echo "fuzz-$n: $result; input: $input"
  echo "  log: $build/fuzz-logs/$n.log, its last lines:"
  tail -n 30 "$build/fuzz-logs/$n.log" | sed 's/^/    /'
  if [ -f "$input" ]; then
    echo "  reproduce: $build/fuzz/fuzz-$n '$input'"
    echo "  once fixed, keep it as a regression input: cp '$input' tests/fuzz-regressions/$n/"
  fi
done
echo "fuzz: $(( $(date +%s) - start )) s, ${#failed[@]} of ${#names[@]} harness(es) failed"
[ ${#failed[@]} -eq 0 ]
