#!/usr/bin/env bash
# The GPU test suite, on a machine with a Hopper GPU (H100, H200), after a CUDA build:
#   scripts/gpu-tests.sh [FOVEA]
#  1. `fovea info` and any library the binary cannot find;
#  2. the GPU test binaries of the same build (test-fp8-device, test-attention-gpu, test-encoder-gpu;
#     the ctest label `gpu` runs the same tests one process each: ctest --test-dir build -L gpu);
#  3. compute-sanitizer memcheck on a small attention case (FP8 and BF16);
#  4. the SASS check: every FP8 flash-kernel instance multiplies with QGMMA (FP8 wgmma), every BF16
#     one with HGMMA (tools/sass-mix.py --check on cuobjdump's disassembly);
#  5. the Python package on the GPU with the build's libfovea_attn.so, where $PY has torch and
#     transformers: python/tests/test_torch_gpu.py (the torch ops against fp64 and the emulation,
#     opcheck, torch.compile, CUDA-graph replays, transformers' vision tower) and
#     python/tests/test_vllm_double.py (the vLLM plugin inside a double of vLLM: loader, graphs,
#     fallbacks, plugin loading, the fused path).
# Exit 0 when every part passes. Environment: FOVEA (default build/fovea), FOVEA_BUILD (default the
# binary's folder), CUDNN_LIB (cuDNN 9.15+ for the CUDNN backend's tests; "torch" for the wheel's), OUT,
# GTEST_ARGS (extra flags for each test binary, e.g. --gtest_filter=*Fp8*), GPU_TESTS (the test
# binaries to run; default those three and any other test-*-gpu of the build), PARTS (default
# "tests memcheck sass python").
set -uo pipefail
source "$(dirname "$0")/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
gpu_setup "${1:-}"
PARTS=${PARTS:-tests memcheck sass python}
failed=()

gpu_state
"$FOVEA" info 2>&1 | tee "$OUT/info.txt" | head -12
missing=$(ldd "$FOVEA" | grep "not found")
[ -z "$missing" ] || { echo "libraries not found:"; echo "$missing"; failed+=(libraries); }

if [[ $PARTS == *tests* ]]; then
  # The GPU test binaries: GPU_TESTS, or these three and any other test-*-gpu the build has.
  tests=${GPU_TESTS:-$( { echo test-fp8-device test-attention-gpu test-encoder-gpu
                          ls "$FOVEA_BUILD"/tests/test-*-gpu "$FOVEA_BUILD"/test-*-gpu 2>/dev/null | xargs -rn1 basename
                        } | tr ' ' '\n' | awk 'NF && !seen[$0]++' | tr '\n' ' ')}
  for t in $tests; do
    say "$t"
    bin=$(test_bin $t) || { echo "   no $t in $FOVEA_BUILD (a build without CUDA?)"; failed+=("$t (missing)"); continue; }
    # shellcheck disable=SC2086  # GTEST_ARGS is a list of flags
    timeout 900 "$bin" ${GTEST_ARGS:-} > "$OUT/$t.txt" 2>&1
    rc=$?
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/$t.txt"
    grep -E -A6 "Failure$" "$OUT/$t.txt" | head -30
    [ $rc = 0 ] || { echo "   $t exit code $rc (log: $OUT/$t.txt)"; failed+=("$t"); }
  done
fi

if [[ $PARTS == *memcheck* ]]; then
  say "compute-sanitizer memcheck: test-attention-gpu --gtest_filter=*Small*"
  if ! sanitizer=$(cuda_tool compute-sanitizer); then
    echo "   compute-sanitizer not found (it comes with the CUDA toolkit)"; failed+=(memcheck)
  elif bin=$(test_bin test-attention-gpu); then
    timeout 600 "$sanitizer" --tool memcheck --error-exitcode 1 "$bin" --gtest_filter='*Small*' > "$OUT/memcheck.txt" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) " "$OUT/memcheck.txt"
    [ $rc = 0 ] || failed+=(memcheck)
  else
    failed+=("memcheck (no test-attention-gpu)")
  fi
fi

if [[ $PARTS == *sass* ]]; then
  say "SASS: the flash kernels' matrix instructions (QGMMA for FP8, HGMMA for BF16)"
  if cuobjdump=$(cuda_tool cuobjdump); then
    "$cuobjdump" --dump-sass "$FOVEA" 2>/dev/null | $PY tools/sass-mix.py --check || failed+=(sass)
  else
    echo "   cuobjdump not found (it comes with the CUDA toolkit)"; failed+=(sass)
  fi
fi

if [[ $PARTS == *python* ]]; then
  say "python: fovea.torch, fovea.transformers (test_torch_gpu.py), fovea.vllm (test_vllm_double.py)"
  lib=$FOVEA_BUILD/libfovea_attn.so
  if [ ! -e "$lib" ]; then
    echo "   no $lib in the build"; failed+=("python (no libfovea_attn.so)")
  elif ! $PY -c "import torch, transformers" 2>/dev/null; then
    echo "   $PY has no torch or transformers"; failed+=("python (no torch)")
  else
    # Each file in a process of its own: the vLLM double replaces the `vllm` modules it imports.
    for t in test_torch_gpu test_vllm_double; do
      FOVEA_ATTN_LIB=$lib PYTHONPATH=$FOVEA_ROOT/python${PYTHONPATH:+:$PYTHONPATH} timeout 1200 \
        $PY -m unittest -v "$FOVEA_ROOT/python/tests/$t.py" > "$OUT/$t.txt" 2>&1
      rc=$?
      echo "   $t:"
      grep -E "^(FAIL|ERROR):|^Ran |^OK|^FAILED|rel |vs fp32|outside torch" "$OUT/$t.txt" | head -40
      [ $rc = 0 ] || failed+=("python $t")
    done
  fi
fi

if [ ${#failed[@]} -eq 0 ]; then echo "gpu-tests: all passed (logs in $OUT)"; exit 0; fi
echo "gpu-tests: FAILED: ${failed[*]} (logs in $OUT)"
exit 1
