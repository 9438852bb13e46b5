#!/usr/bin/env bash
# Builds a wheel of the Python package (python/) that carries libfovea_attn.so from a build folder,
# so `pip install dist/fovea-*.whl` needs no FOVEA_ATTN_LIB (docs/python.md):
#   scripts/python-wheel.sh [BUILD] [OUTDIR]        defaults: build, dist
# The wheel is tagged py3-none-any but holds a library for this machine's architecture and the CUDA
# it was built with. PYTHON picks the interpreter (default python3; it needs pip and setuptools).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
out=$(realpath -m -- "${2:-dist}")
lib=$(readlink -f -- "$build/libfovea_attn.so") || true
[ -f "$lib" ] || { echo "python-wheel: no $build/libfovea_attn.so (build fovea with CMake first)"; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r "$root/python/fovea" "$root/python/pyproject.toml" "$root/python/README.md" "$stage/"
mkdir -p "$stage/fovea/_lib"
cp "$lib" "$stage/fovea/_lib/libfovea_attn.so.1"
"${PYTHON:-python3}" -m pip wheel --no-deps --no-build-isolation -q -w "$out" "$stage"
ls "$out"/fovea-*.whl
