#!/usr/bin/env python3
"""fovea's GPU encoder beside Hugging Face transformers (BF16, sdpa) on the same shapes, one run.

On the GPU machine (torch and transformers are there):
    python3 bench/encoder-peers.py --fovea build/fovea --resolutions HD,FullHD,QHD,4K --images 3
Both run the Qwen3-VL-8B vision architecture (27 blocks, hidden 1152, 16 heads, head_dim 72) with
random weights (transformers' init; fovea's synthetic:qwen3-vl-8b): timings do not depend on values.
transformers is timed eagerly and under torch.compile (default mode; the stronger peer) with CUDA
events (median of --reps after a warm-up that includes the compilation); fovea as CUDA-graph replays
(median). --no-compile leaves the compiled peer out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

GRIDS = {"HD": (1, 44, 80), "FullHD": (1, 68, 120), "QHD": (1, 90, 160), "4K": (1, 136, 240)}


def vision_model_8b():
    """transformers' Qwen3-VL-8B vision tower (random weights), BF16 with sdpa attention, on the GPU
    (bench/video-peers.py uses it too)."""
    cfg = Qwen3VLVisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                              num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:
        pass
    return Qwen3VLVisionModel(cfg).to("cuda", torch.bfloat16).eval()


def hf_ms(model, grid, images, reps, warmup=1):
    n = images * grid[0] * grid[1] * grid[2]
    px = torch.rand(n, 1536, device="cuda", dtype=torch.bfloat16) * 2 - 1
    thw = torch.tensor([grid] * images, device="cuda", dtype=torch.int64)
    times = []
    with torch.no_grad():
        for _ in range(warmup):
            model(px, grid_thw=thw)
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            model(px, grid_thw=thw)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2], n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fovea", default="build/fovea")
    ap.add_argument("--resolutions", default="HD,FullHD,QHD,4K")
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    a = ap.parse_args()
    res = a.resolutions.split(",")

    # fovea's FOVEA modes, then the CUDNN backend's BF16 in a call of its own (it needs cuDNN 9.15+
    # at run time: where that fails, its column stays empty and the others are kept).
    fv = {}
    for modes in ("bf16,fp8-dynamic,fp8-static,fp8-static+fp8-linears", "cudnn-bf16"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [a.fovea, "bench", "encoder", "synthetic:qwen3-vl-8b", "--resolutions", a.resolutions, "--dtype", modes,
               "--images-per-request", str(a.images), "--reps", str(a.reps), "--warmup", "1", "--json", path]
        out = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(out.stdout + out.stderr)
        if out.returncode == 0:
            for r in json.load(open(path))["rows"]:
                fv[(r["resolution"], r["mode"])] = r["median_ms"]
        os.unlink(path)

    model = vision_model_8b()
    compiled = None if a.no_compile else torch.compile(model)
    rows = []
    for r in res:
        ms, n = hf_ms(model, GRIDS[r], a.images, a.reps)
        cms = None
        if compiled is not None:
            try:  # compiles on the first calls of each new shape: three warm-ups, untimed
                cms, _ = hf_ms(compiled, GRIDS[r], a.images, a.reps, warmup=3)
            except Exception as e:  # report, keep the eager and fovea columns
                print(f"torch.compile at {r}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        rows.append({"resolution": r, "tokens": n, "transformers_bf16_ms": ms, "transformers_compile_bf16_ms": cms,
                     **{f"fovea_{m}_ms": fv.get((r, m)) for m in ("bf16", "cudnn-bf16", "fp8-dynamic", "fp8-static", "fp8-static+fp8-linears")}})

    def f(x, fmt="{:.1f}"):
        return fmt.format(x) if x else "-"

    print(f"\n{torch.cuda.get_device_name()} | Qwen3-VL-8B vision encoder | {a.images} images per request | median ms")
    print("| resolution | tokens | transformers BF16 | transformers compile BF16 | fovea cudnn BF16 | fovea BF16 | fovea FP8 dynamic | "
          "fovea FP8 static | fovea FP8 static + FP8 linears | FP8 static x best transformers | FP8 static x fovea BF16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, c = r["transformers_bf16_ms"], r["transformers_compile_bf16_ms"]
        b, d, s = r["fovea_bf16_ms"], r["fovea_fp8-dynamic_ms"], r["fovea_fp8-static_ms"]
        s8 = r["fovea_fp8-static+fp8-linears_ms"]
        best = min(x for x in (t, c) if x)
        print(f"| {r['resolution']} | {r['tokens']} | {f(t)} | {f(c)} | {f(r['fovea_cudnn-bf16_ms'])} | {f(b)} | {f(d)} | {f(s)} | {f(s8)} | "
              f"{f(best / s if s else None, '{:.2f}')} | {f(b / s if s and b else None, '{:.2f}')} |")
    if a.json:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
