#!/usr/bin/env bash
# Registers and spills of every CUDA kernel instance, from ptxas (`-Xptxas -v`), one line each:
# compiles each .cu of the build once more with the build's own nvcc line (objects go to a temporary
# folder; the build is not touched). Needs a configured CUDA build: BUILD, default build/.
#   tools/ptxas-report.sh            # all sources
#   tools/ptxas-report.sh flash-fwd  # sources whose path contains "flash-fwd"
set -euo pipefail
cd "${BUILD:-$(dirname "$0")/../build}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for target in $(ninja -t targets all | grep -oE '^[^:]*\.cu\.o' | grep -- "${1:-.}" | sort -u); do
  cmd=$(ninja -t commands "$target" | tail -1 | sed "s| -MD -MT [^ ]* -MF [^ ]*||; s| -o [^ ]*\.cu\.o| -o $tmp/x.o|")
  eval "$cmd -Xptxas -v" 2>&1 | python3 -c '
import re, subprocess, sys
src = sys.argv[1]
name = None
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(\S+). for", line)
    if m:
        name = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
        name = re.sub(r"\(.*\)$", "", name.replace("(anonymous namespace)::", "").replace("void ", "", 1))
        continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name: spill = (m.group(1), m.group(2))
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        print(f"{src:24} {m.group(1):>4} regs  spill st/ld {spill[0]:>4}/{spill[1]:<4} {name}")
        name = None
' "$(basename "${target%.o}")"
done
