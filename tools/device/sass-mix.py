#!/usr/bin/env python3
"""Static instruction mix of the flash kernels in a binary (cuobjdump --dump-sass), one line per
kernel instance: the opcodes that matter for the softmax's issue budget, and the total.

    cuobjdump --dump-sass .device-bin/fovea | python3 tools/device/sass-mix.py [--match flash_fwd]
"""
import argparse
import collections
import re
import sys

WATCH = ["QGMMA", "HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "HADD2", "HFMA2", "HMUL2", "SHFL",
         "PRMT", "LOP3", "IMAD", "STL", "LDL", "BAR", "SYNCS"]


def kernel_name(mangled):
    m = re.search(r"flash_fwd_kernelILb([01])ELi(\d+)ELi(\d)E", mangled)
    return f"{'fp8' if m.group(1) == '1' else 'bf16'} hd{m.group(2)} wg{m.group(3)}" if m else mangled[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--match", default="flash_fwd")
    a = ap.parse_args()
    counts, name = {}, None
    for line in sys.stdin:
        f = re.search(r"Function : (\S+)", line)
        if f:
            name = f.group(1) if a.match in f.group(1) else None
            if name:
                counts[name] = collections.Counter()
            continue
        if not name:
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?", line)
        if ins:
            counts[name][ins.group(1)] += 1
            counts[name]["total"] += 1
    print("| kernel | " + " | ".join(WATCH) + " | total |")
    print("|---|" + "---|" * (len(WATCH) + 1))
    for n, c in sorted(counts.items(), key=lambda kv: kernel_name(kv[0])):
        print(f"| {kernel_name(n)} | " + " | ".join(str(c[w]) for w in WATCH) + f" | {c['total']} |")


if __name__ == "__main__":
    main()
