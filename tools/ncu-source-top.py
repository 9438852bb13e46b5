#!/usr/bin/env python3
"""The SASS lines of one kernel with the most warp-stall samples, and the samples summed by opcode,
and the instructions executed summed by opcode, from Nsight Compute's source page as CSV (a report
made with --section SourceCounters):

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > src.csv
    python3 tools/ncu-source-top.py src.csv [--top 25]

Columns are found by name (ncu versions differ); the stall-reason columns, where the CSV has them,
give each line's two largest reasons. Prints the file's first lines when it finds no sample column.
"""
import argparse
import collections
import csv
import io
import re
import sys


def number(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    text = open(a.csv, errors="replace").read()
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if '"Source"' in l or l.startswith("# Address") or '"Address"' in l), None)
    if start is None:
        print("ncu-source-top: no header row in", a.csv)
        print("\n".join(lines[:8]))
        return 1
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    cols = rows[0].keys() if rows else []
    samples = next((c for c in cols if "Sampling" in c and "All" in c), None) or next((c for c in cols if "Sampling" in c), None)
    source = next((c for c in cols if c.strip() == "Source"), None)
    executed = next((c for c in cols if c.startswith("Instructions Executed")), None)
    reasons = [c for c in cols if re.search(r"stall", c, re.I) and c != samples and "Sampling" not in c]
    if not samples or not source:
        print("ncu-source-top: columns not found; header:", list(cols)[:20])
        print("\n".join(lines[:5]))
        return 1
    data = [(number(r[samples]) or 0.0, r) for r in rows]
    total = sum(s for s, _ in data) or 1.0
    by_op, ex_op = collections.Counter(), collections.Counter()
    for s, r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[source].strip()).split(" ")[0].split(".")[0]
        by_op[op] += s
        ex_op[op] += number(r.get(executed, 0)) or 0.0 if executed else 0.0
    print(f"   warp-stall samples: {int(total)}; by opcode (share of samples):")
    print("     " + ", ".join(f"{op} {100 * s / total:.1f}%" for op, s in by_op.most_common(14)))
    if executed:  # to set against the per-pipe counts (which pipe an opcode issues to)
        print("   warp instructions executed by opcode:")
        print("     " + ", ".join(f"{op} {int(n):,}" for op, n in ex_op.most_common(16)))
    print(f"   top {a.top} SASS lines (share of samples, executed, largest stall reasons):")
    for s, r in sorted(data, key=lambda x: -x[0])[: a.top]:
        why = sorted(((number(r[c]) or 0.0, c) for c in reasons), reverse=True)[:2]
        why_s = ", ".join(f"{re.sub(r'(?i).*stall(ed)?_?', '', c)[:22]} {int(v)}" for v, c in why if v > 0)
        ex = r.get(executed, "") if executed else ""
        print(f"     {100 * s / total:5.1f}%  {ex:>10}  {r[source].strip()[:70]:70}  {why_s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
