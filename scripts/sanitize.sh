#!/usr/bin/env bash
# The sanitizer stage of the test command (scripts/test.sh runs it after the normal tests): one clang
# build of the CPU parts with ASan + UBSan and libFuzzer coverage (build-san), the CPU tests under the
# sanitizers, then every fuzz harness for a bounded time (scripts/fuzz.sh).
#   scripts/sanitize.sh                  FOVEA_FUZZ_SECONDS per harness (default 50), 2 at a time
#   FOVEA_FUZZ_SECONDS=0 scripts/sanitize.sh     build and tests only
# Measured on 2 cores (2026-12-01, CPU time / 2 where other work shared the machine): build 11 min
# (20 CPU-min), CPU tests 2.5 min, fuzzing 7 min (14 harnesses x 60 s, 2 at a time; 16 harnesses x
# 50 s since 2026-12-04, the same 7 min).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh  # clang, libclang-rt-14-dev (the sanitizer and libFuzzer runtimes), llvm-14 (symbolizer)
build=${FOVEA_SAN_BUILD:-build-san}
seconds=${FOVEA_FUZZ_SECONDS:-50}

# -O2 with line tables: symbolized reports at near-release speed; no NDEBUG, so asserts stay on.
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only" \
    -DFOVEA_CUDA=OFF -DFOVEA_SANITIZE=ON -DFOVEA_FUZZ=ON
cmake --build "$build" -j "$(nproc)"

# A sanitizer report ends the process with exit code 86, which no fovea error uses (they exit 1), so
# a test that expects a failing command cannot mistake a report for the failure it wanted.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:exitcode=86}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:exitcode=86}
[ -x /usr/lib/llvm-14/bin/llvm-symbolizer ] && export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
ctest --test-dir "$build" -LE "gpu|photos" --output-on-failure -j "$(nproc)"

if [ "$seconds" -gt 0 ]; then
  ASAN_OPTIONS=${ASAN_OPTIONS/:exitcode=86/} UBSAN_OPTIONS=${UBSAN_OPTIONS/:exitcode=86/} \
      scripts/fuzz.sh "$build" "$seconds"
fi
