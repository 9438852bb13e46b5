#!/usr/bin/env python3
"""Static instruction mix of the flash kernels in a binary (cuobjdump --dump-sass), one line per
kernel instance: the opcodes that matter for the softmax's issue budget, and the total.

    cuobjdump --dump-sass build/fovea | python3 tools/sass-mix.py [--match flash_fwd] [--check]

--check (scripts/gpu-tests.sh): exit 1 unless every FP8 instance multiplies with QGMMA (FP8 wgmma)
and every BF16 instance with HGMMA and no QGMMA; also when no FP8 or no BF16 instance is found.
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
    ap.add_argument("--check", action="store_true", help="exit 1 unless FP8 kernels use QGMMA and BF16 ones HGMMA")
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
    if a.check:
        return check(counts)
    return 0


def check(counts):
    """FP8 instances multiply with QGMMA, BF16 ones with HGMMA (and never with QGMMA)."""
    bad, seen = [], {"fp8": 0, "bf16": 0}
    for n, c in counts.items():
        kind = kernel_name(n).split(" ")[0]
        if kind not in seen:
            continue
        seen[kind] += 1
        want, other = ("QGMMA", "HGMMA") if kind == "fp8" else ("HGMMA", "QGMMA")
        if c[want] == 0 or (kind == "bf16" and c[other] != 0):
            bad.append(f"{kernel_name(n)}: {want} {c[want]}, {other} {c[other]}")
    if not seen["fp8"] or not seen["bf16"]:
        print(f"sass check: FAILED: found {seen['fp8']} FP8 and {seen['bf16']} BF16 flash-kernel instances "
              "(a build without the sm_90a kernels, or kernel names this script does not know)")
        return 1
    for b in bad:
        print(f"sass check: FAILED: {b}")
    if not bad:
        print(f"sass check: ok: {seen['fp8']} FP8 instances use QGMMA, {seen['bf16']} BF16 instances HGMMA")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
