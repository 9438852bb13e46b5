#!/usr/bin/env python3
"""FP8 attention TFLOP/s of several fovea builds (e.g. from tools/kernel-variants.sh) and tile-row
choices (FOVEA_FLASH_WARPGROUPS: auto, 2 or 3 consumer warpgroups) on the same shapes, one table.
Needs a Hopper GPU.

    python3 tools/kernel-sweep.py --bins build/fovea,build/variants/notc --wgs auto,2,3
Shapes are "S1+S2:hd" (a packed batch of segments). TFLOP/s = 4 * sum(S^2) * hd * H / attention time.
A binary named "before" is run with the planner's choice only (a build without the runtime switch).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(binary, seqlens, hd, heads, dtype, reps, wg):
    env = dict(os.environ)
    env.pop("FOVEA_FLASH_WARPGROUPS", None)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bins", default="build/fovea", help="comma list of fovea binaries")
    ap.add_argument("--wgs", default="auto")
    ap.add_argument("--shapes", default="1024:72,3520+3520+3520:72,8192:72,32640:72,8192:128,16384:128")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtype", default="fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = []
    for spec in a.shapes.split(","):
        segs, hd = spec.split(":")
        shapes.append(([int(s) for s in segs.split("+")], int(hd)))
    print(f"{a.dtype} attention TFLOP/s, {a.heads} heads (prepare ms in brackets)")
    print("| build | tiles | " + " | ".join("+".join(map(str, s)) + f" hd{hd}" for s, hd in shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    rows = []
    for b in a.bins.split(","):
        for wg in a.wgs.split(","):
            if wg != "auto" and os.path.basename(b) == "before":
                continue  # that build has no runtime choice
            cells = []
            for seqlens, hd in shapes:
                r = run(b, seqlens, hd, a.heads, a.dtype, a.reps, wg)
                flops = 4 * sum(s * s for s in seqlens) * hd * a.heads
                tf = flops / (r["attn_ms"] * 1e-3) / 1e12 if r else None
                rows.append({"bin": b, "wg": wg, "seqlens": seqlens, "hd": hd, "result": r, "tflops": tf})
                cells.append(f"{tf:.0f} ({r['prepare_ms']:.3f})" if r else "-")
            print(f"| {os.path.basename(b)} | {wg} | " + " | ".join(cells) + " |", flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
