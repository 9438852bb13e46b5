#!/usr/bin/env bash
# One device call: correctness first (check.sh), then the side-by-side benchmark (bench.sh).
cd "$(dirname "$0")/../.."
bash tools/device/check.sh "$@" 2>&1 | grep -vE "^graph replay|^\[       OK" 
bash tools/device/bench.sh "$@"
