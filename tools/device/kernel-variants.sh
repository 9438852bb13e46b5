#!/usr/bin/env bash
# Builds `fovea` binaries that differ only in compile-time switches of the flash kernel, for A/B runs on
# the GPU machine (tools/device/kernel-ab.sh, kernel-sweep.py), into .device-bin/variants/NAME. Run after
# tools/device/stage.sh (it reuses build/'s objects: only flash-fwd.cu is compiled again per variant).
#   tools/device/kernel-variants.sh mufu-only=-DFOVEA_FP8_FMA_EXP_MASK_2WG=0 \
#       half3="-DFOVEA_FP8_FMA_EXP_MASK_3WG=0xAAAA"
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .device-bin/variants
cd build
compile=$(ninja -t commands CMakeFiles/fovea_core.dir/src/attention/cuda/flash-fwd.cu.o | tail -1 |
          sed 's| -MD -MT [^ ]* -MF [^ ]*||; s| -o [^ ]*flash-fwd.cu.o| -o "$obj"|')
link=$(ninja -t commands fovea | tail -1 | sed 's|^: && ||; s| && :$||; s| -o fovea | -o "$bin" |; s| libfovea_core.a | "$lib" |')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  obj=$tmp/flash-fwd.cu.o lib=$tmp/libfovea_core.a bin=../.device-bin/variants/$name
  eval "$compile $flags -Xptxas -v" 2> "$tmp/ptxas.txt"
  echo "== $name ($flags): spills"
  grep -E "spill" "$tmp/ptxas.txt" | sort | uniq -c
  cp libfovea_core.a "$lib"
  (cd "$tmp" && ar r libfovea_core.a flash-fwd.cu.o)
  eval "$link"
done
ls -la ../.device-bin/variants
