#!/usr/bin/env bash
# Builds the fovea-attn wheel of the Python package (python/) carrying libfovea_attn.so from a build
# folder, so `pip install dist/fovea_attn-*.whl` needs no FOVEA_ATTN_LIB (docs/python.md §Install):
#   scripts/python-wheel.sh [BUILD] [OUTDIR]        defaults: build, dist
# The wheel is tagged for the library it holds (scripts/wheel-tag.py reads the library):
#   py3-none-manylinux_2_<M>_<arch>   M: the highest GLIBC_2.M symbol version the library needs;
#                                     arch: the ELF header's machine (x86_64, aarch64)
#   version 0.1.0+cu<XY>              a CUDA build: the toolkit CMake configured BUILD with (checked
#                                     against the library's NEEDED libcudart.so.X); a CPU-only library
#                                     gets no local version (its wheel runs the CPU reference only)
# Nothing is downloaded: the wheel is built by setuptools' PEP 517 backend (build_meta) without pip,
# then retagged by scripts/wheel-tag.py (standard library). PYTHON picks the interpreter; by default
# the first of python3 and /usr/bin/python3 with setuptools >= 61 and a bdist_wheel (the `wheel`
# package, or setuptools >= 70.1): Debian's python3-setuptools and python3-wheel.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath -m -- "${1:-build}")
out=$(realpath -m -- "${2:-dist}")
lib=$(readlink -f -- "$build/libfovea_attn.so") || true
[ -f "$lib" ] || { echo "python-wheel: no $build/libfovea_attn.so (build fovea with CMake first)"; exit 1; }

can_build='import setuptools, importlib.util as u, sys
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
sys.exit(not (v >= (61, 0) and (v >= (70, 1) or u.find_spec("wheel"))))'
py=
for cand in ${PYTHON:+"$PYTHON"} python3 /usr/bin/python3; do
  if command -v "$cand" >/dev/null && "$cand" -c "$can_build" 2>/dev/null; then py=$cand; break; fi
  [ -n "${PYTHON:-}" ] && break  # an interpreter named by PYTHON is the only one tried
done
[ -n "$py" ] || { echo "python-wheel: no ${PYTHON:-python3} with setuptools >= 61 and wheel (apt-get install python3-setuptools python3-wheel)"; exit 1; }

read -r plat local < <("$py" "$root/scripts/wheel-tag.py" tags "$lib" --build "$build")
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/python/pyproject.toml")
[ -n "$version" ] || { echo "python-wheel: no version in python/pyproject.toml"; exit 1; }
[ "$local" = - ] || version="$version+$local"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r "$root/python/fovea" "$root/python/pyproject.toml" "$root/python/README.md" "$stage/"
rm -rf "$stage/fovea/_lib" && find "$stage/fovea" -name __pycache__ -prune -exec rm -rf {} +
sed -i "s/^version = \".*\"$/version = \"$version\"/" "$stage/pyproject.toml"
mkdir -p "$stage/fovea/_lib" "$out"
cp "$lib" "$stage/fovea/_lib/libfovea_attn.so.1"
(cd "$stage" && "$py" -c 'import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))' \
   "$stage/whl" >"$stage/log" 2>&1) || { cat "$stage/log"; echo "python-wheel: the wheel build failed"; exit 1; }
built=$(tail -n 1 "$stage/log")
"$py" "$root/scripts/wheel-tag.py" retag "$stage/whl/$built" "$plat" >/dev/null
whl=$(cd "$stage/whl" && ls fovea_attn-*.whl)
mv -f "$stage/whl/$whl" "$out/$whl"
"$py" "$root/scripts/wheel-tag.py" check "$out/$whl" --build "$build" >&2
echo "$out/$whl"
