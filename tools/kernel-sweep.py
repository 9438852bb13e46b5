#!/usr/bin/env python3
"""FP8 attention TFLOP/s of several fovea builds (e.g. from tools/kernel-variants.sh) and tile-row
choices (FOVEA_FLASH_WARPGROUPS: auto, 2 or 3 consumer warpgroups) on the same shapes, one table.
Needs a Hopper GPU.

    python3 tools/kernel-sweep.py --bins build/fovea,build/variants/notc --wgs auto,2,3
    python3 tools/kernel-sweep.py --variant old=/tmp/old/fovea --variant grid=build/fovea:FOVEA_FLASH_PERSISTENT=0 \
        --variant new=build/fovea --rounds 3
Shapes are "S1+S2:hd" (a packed batch of segments). TFLOP/s = 4 * sum(S^2) * hd * H / attention time.
A variant is LABEL=BINARY[:VAR=VALUE,...] (environment for that binary). With --rounds N every
(shape, build) cell runs N times, the builds taking turns within each round so that drift spreads
over all of them; a cell is the median, with the range beside it when N > 1.
A binary named "before" is run with the planner's choice only (a build without the runtime switch).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(binary, seqlens, hd, heads, dtype, reps, wg, extra_env=None):
    env = dict(os.environ)
    env.pop("FOVEA_FLASH_WARPGROUPS", None)
    env.update(extra_env or {})
    if wg != "auto":
        env["FOVEA_FLASH_WARPGROUPS"] = wg
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [binary, "bench", "attention", "--device", "cuda", "--seqlens", ",".join(map(str, seqlens)), "--heads",
           str(heads), "--head-dim", str(hd), "--dtype", dtype, "--reps", str(reps), "--check", "0", "--json", path]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        return None
    r = json.load(open(path))["results"][0]
    os.unlink(path)
    return r


def parse_variant(spec):
    label, _, rest = spec.partition("=")
    binary, _, envs = rest.partition(":")
    if not label or not binary:
        sys.exit(f"kernel-sweep: a variant is LABEL=BINARY[:VAR=VALUE,...], got {spec!r}")
    env = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
    return label, binary, env


def cell(values):
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    return f"{statistics.median(got):.0f}" + (f" ({min(got):.0f}-{max(got):.0f})" if len(got) > 1 else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bins", default="build/fovea", help="comma list of fovea binaries")
    ap.add_argument("--variant", action="append", default=[], help="LABEL=BINARY[:VAR=VALUE,...] (repeatable)")
    ap.add_argument("--wgs", default="auto")
    ap.add_argument("--shapes", default="1024:72,3520+3520+3520:72,8192:72,32640:72,8192:128,16384:128")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtype", default="fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = []
    for spec in a.shapes.split(","):
        segs, hd = spec.split(":")
        shapes.append(([int(s) for s in segs.split("+")], int(hd)))
    builds = [parse_variant(v) for v in a.variant] or [(os.path.basename(b), b, {}) for b in a.bins.split(",")]
    runs = [(label, b, env, wg) for label, b, env in builds for wg in a.wgs.split(",")
            if wg == "auto" or os.path.basename(b) != "before"]  # a "before" build has no runtime choice
    rows, tf = [], {}
    for rnd in range(a.rounds):
        for si, (seqlens, hd) in enumerate(shapes):
            for ri, (label, b, env, wg) in enumerate(runs):
                r = run(b, seqlens, hd, a.heads, a.dtype, a.reps, wg, env)
                flops = 4 * sum(s * s for s in seqlens) * hd * a.heads
                t = flops / (r["attn_ms"] * 1e-3) / 1e12 if r else None
                rows.append({"build": label, "bin": b, "env": env, "wg": wg, "round": rnd, "seqlens": seqlens,
                             "hd": hd, "result": r, "tflops": t})
                tf.setdefault((ri, si), []).append(t)
    print(f"{a.dtype} attention TFLOP/s, {a.heads} heads, median of {a.rounds} round(s) (range)")
    print("| build | tiles | " + " | ".join("+".join(map(str, s)) + f" hd{hd}" for s, hd in shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for ri, (label, b, env, wg) in enumerate(runs):
        print(f"| {label} | {wg} | " + " | ".join(cell(tf[(ri, si)]) for si in range(len(shapes))) + " |", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
