#!/usr/bin/env bash
# Builds `fovea` binaries that differ only in compile-time switches of the flash kernel, for A/B runs on
# the GPU machine (tools/device/kernel-ab.sh, kernel-sweep.py), into .device-bin/variants/NAME. Run after
# tools/device/stage.sh (it reuses build/'s objects: only flash-fwd.cu and prepare.cu are compiled again
# per variant, each with the variant's flags).
#   tools/device/kernel-variants.sh mufu-only=-DFOVEA_FP8_FMA_EXP_MASK_2WG=0 \
#       half3="-DFOVEA_FP8_FMA_EXP_MASK_3WG=0xAAAA"
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device-bin/variants
cd build
compile_cmd() {  # the build's own nvcc line for one source, writing "$obj"
  ninja -t commands "CMakeFiles/fovea_core.dir/src/attention/cuda/$1.o" | tail -1 |
    sed "s| -MD -MT [^ ]* -MF [^ ]*||; s| -o [^ ]*$1.o| -o \"\$obj\"|"
}
compile_flash=$(compile_cmd flash-fwd.cu)
compile_prepare=$(compile_cmd prepare.cu)
link=$(ninja -t commands fovea | tail -1 | sed 's|^: && ||; s| && :$||; s| -o fovea | -o "$bin" |; s| libfovea_core.a | "$lib" |')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  lib=$tmp/libfovea_core.a bin=../.device-bin/variants/$name
  obj=$tmp/flash-fwd.cu.o; eval "$compile_flash $flags -Xptxas -v" 2> "$tmp/ptxas.txt"
  obj=$tmp/prepare.cu.o; eval "$compile_prepare $flags -Xptxas -v" 2>> "$tmp/ptxas.txt"
  echo "== $name ($flags): spills"
  grep -E "spill" "$tmp/ptxas.txt" | sort | uniq -c
  cp libfovea_core.a "$lib"
  (cd "$tmp" && ar r libfovea_core.a flash-fwd.cu.o prepare.cu.o)
  eval "$link"
done
ls -la ../.device-bin/variants
