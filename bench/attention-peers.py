#!/usr/bin/env python3
"""fovea's attention kernels beside torch SDPA (flash and cuDNN backends), same shapes, one run.

Runs on the GPU machine (torch is there):
    python3 bench/attention-peers.py --fovea build/fovea --shapes 8192:72,8192:128 --heads 16
Each shape is one segment of S tokens ("S:hd"), or several segments "S1+S2+S3:hd". torch gets bf16
[B=1, H, S, hd] per segment (one call per segment, summed); fovea gets the packed varlen batch.
TFLOP/s = 4 * sum(S_i^2) * hd * H / time (attention only; fovea's prepare step is reported apart).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def torch_sdpa_ms(seqlens, heads, hd, backend):
    qkv = [torch.randn(3, 1, heads, s, hd, device="cuda", dtype=torch.bfloat16) for s in seqlens]

    def run():
        with sdpa_kernel([backend]):
            for x in qkv:
                F.scaled_dot_product_attention(x[0], x[1], x[2])

    try:
        return median_ms(run)
    except RuntimeError as e:  # a backend that refuses the shape
        print(f"  torch {backend}: {str(e).splitlines()[0]}", file=sys.stderr)
        return None


def fovea_results(binary, seqlens, heads, hd, reps):
    """fovea's rows by key: "bf16" and "fp8" (the FOVEA backend), "cudnn" (the CUDNN backend's BF16).
    The CUDNN backend runs in a call of its own: it needs cuDNN 9.15+ at run time, and where that
    fails its column stays empty and the others are kept."""
    rows = {}
    for backend, dtypes in (("FOVEA", "bf16,fp8"), ("CUDNN", "bf16")):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [binary, "bench", "attention", "--device", "cuda", "--seqlens", ",".join(map(str, seqlens)),
               "--heads", str(heads), "--head-dim", str(hd), "--dtype", dtypes, "--backend", backend,
               "--reps", str(reps), "--json", path]
        out = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(out.stdout + out.stderr)
        if out.returncode == 0:
            with open(path) as f:
                for r in json.load(f)["results"]:
                    rows["cudnn" if r["backend"] == "CUDNN" else r["dtype"]] = r
        os.unlink(path)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fovea", default="build/fovea")
    ap.add_argument("--shapes", default="1024:72,3520:72,8192:72,14400:72,32640:72,1024:128,3520:128,8192:128,32640:128,"
                                        "3520+3520+3520:72")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    rows = []
    for spec in a.shapes.split(","):
        segs, hd = spec.split(":")
        seqlens, hd = [int(s) for s in segs.split("+")], int(hd)
        flops = 4 * sum(s * s for s in seqlens) * hd * a.heads
        tf = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None
        flash = torch_sdpa_ms(seqlens, a.heads, hd, SDPBackend.FLASH_ATTENTION)
        cudnn = torch_sdpa_ms(seqlens, a.heads, hd, SDPBackend.CUDNN_ATTENTION)
        fv = fovea_results(a.fovea, seqlens, a.heads, hd, a.reps) or {}
        best = min([t for t in (flash, cudnn) if t] or [float("nan")])
        row = {"seqlens": seqlens, "head_dim": hd, "heads": a.heads, "flops": flops,
               "torch_flash_ms": flash, "torch_cudnn_ms": cudnn,
               "fovea_bf16_ms": fv.get("bf16", {}).get("attn_ms"), "fovea_fp8_ms": fv.get("fp8", {}).get("attn_ms"),
               "fovea_cudnn_ms": fv.get("cudnn", {}).get("attn_ms"),
               "fovea_fp8_prep_ms": fv.get("fp8", {}).get("prepare_ms"),
               "fovea_fp8_prep_dyn_ms": fv.get("fp8", {}).get("prepare_dynamic_ms"),
               "fovea_bf16_prep_ms": fv.get("bf16", {}).get("prepare_ms"),
               "fovea_bf16_rel_l2": fv.get("bf16", {}).get("rel_l2"), "fovea_fp8_rel_l2": fv.get("fp8", {}).get("rel_l2")}
        row["torch_best_ms"] = best
        rows.append(row)

    def f(x, fmt="{:.0f}"):
        return fmt.format(x) if x is not None else "-"

    print(f"\n{gpu} | heads {a.heads} | TFLOP/s (attention only) and speed-up over torch's best BF16 SDPA")
    print("| segments | hd | torch flash | torch cuDNN | fovea cudnn | fovea bf16 | fovea fp8 | fp8 x best | bf16 x best | fp8+prep ms | fp8+dyn prep ms | best torch ms | fp8 rel_l2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = r["flops"]
        tf = lambda ms: fl / (ms * 1e-3) / 1e12 if ms else None
        b = r["torch_best_ms"]
        fp8, bf = r["fovea_fp8_ms"], r["fovea_bf16_ms"]
        segs = "+".join(map(str, r["seqlens"]))
        print(f"| {segs} | {r['head_dim']} | {f(tf(r['torch_flash_ms']))} | {f(tf(r['torch_cudnn_ms']))} | {f(tf(r['fovea_cudnn_ms']))} | "
              f"{f(tf(bf))} | {f(tf(fp8))} | {f(b / fp8 if fp8 else None, '{:.2f}')} | {f(b / bf if bf else None, '{:.2f}')} | "
              f"{f(fp8 + r['fovea_fp8_prep_ms'] if fp8 else None, '{:.3f}')} | "
              f"{f(fp8 + r['fovea_fp8_prep_dyn_ms'] if fp8 else None, '{:.3f}')} | {f(b, '{:.3f}')} | "
              f"{f(r['fovea_fp8_rel_l2'], '{:.2e}')} |")
    if a.json:
        with open(a.json, "w") as f_:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f_, indent=1)


if __name__ == "__main__":
    main()
