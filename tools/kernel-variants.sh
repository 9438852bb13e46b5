#!/usr/bin/env bash
# Builds `fovea` binaries that differ only in compile-time switches of the FOVEA attention kernels
# (flash-fwd.cu and prepare.cu compiled again with extra flags, everything else reused from a CUDA
# build), for A/B runs with tools/kernel-sweep.py or bench/ab.sh:
#   tools/kernel-variants.sh NAME=FLAGS [NAME=FLAGS ...]
#   tools/kernel-variants.sh p2=-DFOVEA_FP8_POLY_EXP_PAIRS=0x0101u notc=-DFOVEA_FP8_TC_ROW_SUM=0
#   python3 tools/kernel-sweep.py --bins build/fovea,build/variants/p2,build/variants/notc --wgs auto,2,3
# Each variant is written to $VARIANTS/NAME (default build/variants/NAME), and ptxas's spill lines are
# printed for it. BUILD (default build) is a configured and built CUDA build folder (Ninja); it is
# read, not changed, except for the variants folder when that lies inside it. SOURCE (default the
# build's own source tree) compiles the two kernels from another checkout instead, e.g. an earlier
# commit's for a "before" binary:  git worktree add /tmp/before HEAD~3; SOURCE=/tmp/before tools/kernel-variants.sh before=
set -euo pipefail
case "${1:-}" in -h|--help|"") awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
BUILD=$(realpath -- "${BUILD:-$(dirname "$0")/../build}")
VARIANTS=$(realpath -m -- "${VARIANTS:-$BUILD/variants}")
mkdir -p "$VARIANTS"
cd "$BUILD"
# compile_cmd SOURCE: the build's own nvcc line for src/attention/cuda/SOURCE, writing "$obj".
compile_cmd() {
  local target
  target=$(ninja -t targets all | grep -oE "^[^:]*/src/attention/cuda/$1\.o" | head -1)
  [ -n "$target" ] || { echo "kernel-variants: no object for $1 in $BUILD (a build without CUDA?)" >&2; exit 1; }
  ninja -t commands "$target" | tail -1 | sed "s| -MD -MT [^ ]* -MF [^ ]*||; s| -o [^ ]*$1\.o| -o \"\$obj\"|"
}
compile_flash=$(compile_cmd flash-fwd.cu)
compile_prepare=$(compile_cmd prepare.cu)
if [ -n "${SOURCE:-}" ]; then  # the build's source root in the compile lines -> SOURCE
  root=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' CMakeCache.txt)
  SOURCE=$(realpath -- "$SOURCE")
  compile_flash=${compile_flash//$root\//$SOURCE\/}
  compile_prepare=${compile_prepare//$root\//$SOURCE\/}
fi
link=$(ninja -t commands fovea | tail -1 | sed 's|^: && ||; s| && :$||; s| -o fovea | -o "$bin" |; s| libfovea_core.a | "$lib" |')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  lib=$tmp/libfovea_core.a bin=$VARIANTS/$name
  obj=$tmp/flash-fwd.cu.o; eval "$compile_flash $flags -Xptxas -v" 2> "$tmp/ptxas.txt"
  obj=$tmp/prepare.cu.o; eval "$compile_prepare $flags -Xptxas -v" 2>> "$tmp/ptxas.txt"
  echo "== $name ($flags): spills"
  grep -E "spill" "$tmp/ptxas.txt" | sort | uniq -c
  cp libfovea_core.a "$lib"
  (cd "$tmp" && ar r libfovea_core.a flash-fwd.cu.o prepare.cu.o)
  eval "$link"
done
ls -la "$VARIANTS"
