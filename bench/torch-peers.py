#!/usr/bin/env python3
"""fovea from PyTorch beside transformers' own attention, one run (docs/python.md):

    python3 bench/torch-peers.py --fovea build/fovea --lib build/libfovea_attn.so --resolutions HD,FullHD,4K
transformers' Qwen3-VL-8B vision tower (random weights, BF16; bench/encoder-peers.py builds it), 3
images per call, median ms of --reps after warm-ups (the compiled modes' include the compilation):
  sdpa eager | sdpa torch.compile | fovea BF16 (eager) | fovea FP8 static (eager, compiled), through
  transformers' attention interface (q, k, v after transformers' RoPE) and fused (fovea.transformers
  .enable(fused=True): the qkv output and the RoPE tables straight to fovea)
beside the fovea command's own encoder (bench encoder: BF16 and FP8 static, CUDA-graph replays).
Then, at each resolution's token count, the op alone: GPU time per call, the host time of a call
(the ctypes layer and the plan cache: what a call costs the CPU), the first call (planning), and the
fused-qkv entry beside the three-view one (what the gather copy costs).
Static scales come from calibrating the same tower (16 forwards at HD, fovea.torch.ScaleBook).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--fovea", default="build/fovea", help="the fovea binary (its own encoder's column)")
p.add_argument("--lib", default=None, help="libfovea_attn.so (default: $FOVEA_ATTN_LIB, else next to --fovea)")
p.add_argument("--resolutions", default="HD,FullHD,4K")
p.add_argument("--images", type=int, default=3)
p.add_argument("--reps", type=int, default=5)
p.add_argument("--no-compile", action="store_true", help="leave the torch.compile modes out")
p.add_argument("--json", default="")
a = p.parse_args()
os.environ.setdefault("FOVEA_ATTN_LIB", a.lib or os.path.join(os.path.dirname(os.path.abspath(a.fovea)), "libfovea_attn.so"))
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))

import torch  # noqa: E402

import fovea.torch as ft  # noqa: E402
import fovea.transformers as ftr  # noqa: E402
from fovea import attention as fa  # noqa: E402

spec = importlib.util.spec_from_file_location("encoder_peers", os.path.join(here, "encoder-peers.py"))
peers = importlib.util.module_from_spec(spec)
sys.argv, argv = sys.argv[:1], sys.argv
spec.loader.exec_module(peers)
sys.argv = argv
torch._dynamo.config.cache_size_limit = 64


def tower_ms(model, grid, warmup=1):
    try:
        return peers.hf_ms(model, grid, a.images, a.reps, warmup=warmup)[0]
    except Exception as e:  # report, keep the other columns
        print(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
        return None


def fovea_cli():
    out = {}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [a.fovea, "bench", "encoder", "synthetic:qwen3-vl-8b", "--resolutions", a.resolutions, "--dtype", "bf16,fp8-static",
           "--images-per-request", str(a.images), "--reps", str(a.reps), "--warmup", "1", "--json", path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        for row in json.load(open(path))["rows"]:
            out[(row["resolution"], row["mode"])] = row["median_ms"]
    else:
        print(r.stdout + r.stderr, file=sys.stderr)
    os.unlink(path)
    return out


def calibrate(model, path):
    ftr.enable(model, fp8="calibrate", scale_path=path, fused=False)
    grid = peers.GRIDS["HD"]
    n = a.images * grid[0] * grid[1] * grid[2]
    thw = torch.tensor([grid] * a.images, device="cuda")
    with torch.no_grad():
        for i in range(16):
            model(torch.rand(n, 1536, device="cuda", dtype=torch.bfloat16) * 2 - 1, grid_thw=thw)
    if not model.fovea_scales.maybe_save():
        raise SystemExit("calibration did not write its file")


def op_costs(tokens_per_image, heads=16, hd=72, calls=50):
    """The op alone at one shape: GPU ms per call, host us per call, first call ms, fused-entry GPU ms."""
    n = tokens_per_image * a.images
    cu = torch.arange(0, n + 1, tokens_per_image, dtype=torch.int32, device="cuda")
    qkv = torch.randn(n, 3, heads, hd, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    descale = torch.full((3,), 0.02, device="cuda")
    ft.clear_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ft.varlen_attention(q, k, v, cu, descale=descale)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3

    def gpu_ms(fn):
        fn()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / calls

    view_ms = gpu_ms(lambda: ft.varlen_attention(q, k, v, cu, descale=descale))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        ft.varlen_attention(q, k, v, cu, descale=descale)
    host_us = (time.perf_counter() - t0) / calls * 1e6  # queued behind the GPU: the host's own time
    torch.cuda.synchronize()

    def host_time(fn):  # the same, for one layer of the call's stack
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        return t

    direct_us = host_time(lambda: ft._run(q, k, v, cu, descale, None, 0.0))  # without torch.library's dispatch
    planned = ft._handle(q.device, True, heads, hd, tuple(range(0, n + 1, tokens_per_image)), 0)
    views = [(x.data_ptr(), x.stride(0), x.stride(1)) for x in (q, k, v)]
    o = torch.empty(n, heads, hd, device="cuda", dtype=torch.bfloat16)
    sc0 = fa.Scales(fixed=descale.data_ptr())
    st = torch.cuda.current_stream().cuda_stream
    abi_us = host_time(lambda: (planned.prepare(*views, scales=sc0, stream=st), planned.attend((o.data_ptr(), heads * hd, hd), st)))
    att = fa.Attention("fp8", heads, hd, device=torch.cuda.current_device())
    att.plan(list(range(0, n + 1, tokens_per_image)))
    out = torch.empty(n, heads, hd, device="cuda", dtype=torch.bfloat16)
    sc = fa.Scales(fixed=descale.data_ptr())
    s = torch.cuda.current_stream().cuda_stream

    def fused():
        att.prepare_fused(qkv.data_ptr(), 3 * heads * hd, scales=sc, stream=s)
        att.attend((out.data_ptr(), heads * hd, hd), s)

    fused_ms = gpu_ms(fused)
    return {"op_gpu_ms": view_ms, "op_host_us": host_us, "op_first_call_ms": first_ms, "op_fused_gpu_ms": fused_ms,
            "op_host_direct_us": direct_us, "op_host_abi_us": abi_us}


def main():
    res = a.resolutions.split(",")
    cli = fovea_cli()
    model = peers.vision_model_8b()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        scales = os.path.join(d, "scales.json")
        calibrate(model, scales)
        for r in res:
            grid = peers.GRIDS[r]
            row = {"resolution": r, "tokens": a.images * grid[0] * grid[1] * grid[2]}
            print(f"{r}: transformers sdpa", file=sys.stderr)
            model.config._attn_implementation = "sdpa"
            row["sdpa_ms"] = tower_ms(model, grid)
            if not a.no_compile:
                torch._dynamo.reset()
                row["sdpa_compile_ms"] = tower_ms(torch.compile(model), grid, warmup=3)
            print(f"{r}: fovea", file=sys.stderr)
            ftr.enable(model, fused=False)
            row["fovea_bf16_ms"] = tower_ms(model, grid)
            ftr.enable(model, fp8="static", scale_path=scales, fused=False)
            row["fovea_fp8_static_ms"] = tower_ms(model, grid)
            row["packed_calls"] = ftr.stats["packed_calls"]
            if not a.no_compile:
                torch._dynamo.reset()
                row["fovea_fp8_static_compile_ms"] = tower_ms(torch.compile(model), grid, warmup=3)
            ftr.enable(model, fp8="static", scale_path=scales, fused=True)
            row["fused_fp8_static_ms"] = tower_ms(model, grid)
            if not a.no_compile:
                torch._dynamo.reset()
                row["fused_fp8_static_compile_ms"] = tower_ms(torch.compile(model), grid, warmup=3)
            ftr.enable(model, fused=False)  # the interface path again for the next resolution's BF16
            row["cli_bf16_ms"], row["cli_fp8_static_ms"] = cli.get((r, "bf16")), cli.get((r, "fp8-static"))
            row.update(op_costs(grid[0] * grid[1] * grid[2]))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    def f(x, fmt="{:.1f}"):
        return fmt.format(x) if x else "-"

    print(f"\n{torch.cuda.get_device_name()} | transformers' Qwen3-VL-8B vision tower | {a.images} images | median ms")
    print("| resolution | tokens | sdpa | sdpa compile | fovea BF16 | fovea FP8 static | FP8 static compile | "
          "FP8 static fused | FP8 fused compile | fovea CLI BF16 | fovea CLI FP8 static | FP8 eager / sdpa eager | "
          "FP8 fused eager / sdpa eager | best FP8 / best sdpa |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sd = min(x for x in (r["sdpa_ms"], r.get("sdpa_compile_ms")) if x)
        f8 = min(x for x in (r["fovea_fp8_static_ms"], r.get("fovea_fp8_static_compile_ms"), r["fused_fp8_static_ms"],
                             r.get("fused_fp8_static_compile_ms")) if x)
        print(f"| {r['resolution']} | {r['tokens']} | {f(r['sdpa_ms'])} | {f(r.get('sdpa_compile_ms'))} | {f(r['fovea_bf16_ms'])} | "
              f"{f(r['fovea_fp8_static_ms'])} | {f(r.get('fovea_fp8_static_compile_ms'))} | {f(r['fused_fp8_static_ms'])} | "
              f"{f(r.get('fused_fp8_static_compile_ms'))} | {f(r['cli_bf16_ms'])} | {f(r['cli_fp8_static_ms'])} | "
              f"{f(r['sdpa_ms'] / r['fovea_fp8_static_ms'], '{:.2f}')}x | {f(r['sdpa_ms'] / r['fused_fp8_static_ms'], '{:.2f}')}x | "
              f"{f(sd / f8, '{:.2f}')}x |")
    print("\nthe op alone, FP8 static, 16 heads, head_dim 72 (per layer):")
    print("| resolution | GPU ms per call (3 views) | fused qkv entry | host us per call: op / without torch.library / "
          "ctypes alone | host / layer (FP8 eager, fused) | first call ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        layer_ms = r["fused_fp8_static_ms"] / 27
        print(f"| {r['resolution']} | {r['op_gpu_ms']:.3f} | {r['op_fused_gpu_ms']:.3f} | {r['op_host_us']:.0f} / "
              f"{r['op_host_direct_us']:.0f} / {r['op_host_abi_us']:.0f} | {100 * r['op_host_us'] / 1e3 / layer_ms:.1f}% | "
              f"{r['op_first_call_ms']:.1f} |")
    if a.json:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
