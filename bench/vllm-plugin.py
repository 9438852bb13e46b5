#!/usr/bin/env python3
"""fovea's vLLM plugin beside fovea.transformers, one run (docs/python.md §vLLM):

    python3 bench/vllm-plugin.py --lib build/libfovea_attn.so --resolutions HD,4K

The Qwen3-VL-8B vision attention (27 layers, hidden 1152, 16 heads of 72, random weights, BF16,
FP8 static scales), IMAGES images per call, median ms of --reps for the 27 attention modules
(the qkv projection, attention, the output projection) on the same inputs:
  vllm fused      vLLM's Qwen2_5_VisionAttention (as the vLLM double in python/tests/vllm_stub has it)
                  with the plugin's fused forward: the qkv output and vLLM's RoPE tables to fovea
  vllm interface  the same modules with their own forward: q, k, v split, RoPE in torch, copies,
                  then the plugin's MMEncoderAttention
  transformers    transformers' Qwen3VLVisionAttention with fovea.transformers' fused forward
The plugin's fused path is the one vLLM serves with; it should be within a few percent of
fovea.transformers' (the same op on the same shapes). The double stands in for vLLM, which cannot be
installed here: the modules are the double's, written from vLLM's source.
"""
import argparse
import os
import statistics
import sys
import tempfile

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--lib", default=None, help="libfovea_attn.so (default: $FOVEA_ATTN_LIB, else build/libfovea_attn.so)")
p.add_argument("--resolutions", default="HD,4K", help="of HD, FullHD, QHD, 4K")
p.add_argument("--images", type=int, default=3)
p.add_argument("--reps", type=int, default=20)
p.add_argument("--layers", type=int, default=27)
a = p.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("FOVEA_ATTN_LIB", a.lib or os.path.join(here, "..", "build", "libfovea_attn.so"))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, os.path.join(here, "..", "python", "tests", "vllm_stub"))

import torch  # noqa: E402
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention  # noqa: E402

import fovea.torch as ft  # noqa: E402
import fovea.transformers as ftr  # noqa: E402
import fovea.vllm as fv  # noqa: E402
import vllm  # noqa: E402  (the double)
from fovea import attention as fa  # noqa: E402

GRIDS = {"HD": (1, 44, 80), "FullHD": (1, 68, 120), "QHD": (1, 90, 160), "4K": (1, 136, 240)}
HIDDEN, HEADS, HD = 1152, 16, 72


def median_ms(fn):
    fn()
    times = []
    for _ in range(a.reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def rope_tables(grid, images):
    """vLLM's tables (float32 [tokens, 36]: row angles then column angles) and transformers' ([tokens, 72])."""
    t, h, w = grid
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD // 2, 2, dtype=torch.float32, device="cuda") / (HD // 2)))
    hp = torch.arange(h, device="cuda").repeat_interleave(w).float()
    wp = torch.arange(w, device="cuda").repeat(h).float()
    freqs = torch.cat([hp[:, None] * inv, wp[:, None] * inv], -1).repeat(t * images, 1)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    return (cos, sin), (torch.cat([cos, cos], -1).bfloat16(), torch.cat([sin, sin], -1).bfloat16())


def main():
    with tempfile.TemporaryDirectory() as d:
        scales = os.path.join(d, "scales.json")
        fa.write_scale_file(scales, [[0.02, 0.03, 0.02]] * a.layers)
        vllm.reset()
        fv.register()
        vllm.set_config(vllm.MultiModalConfig(mm_encoder_attn_dtype="fp8", mm_encoder_fp8_scale_path=scales))
        from vllm.model_executor.models import qwen2_5_vl

        class Tower(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.ModuleList()
                for i in range(a.layers):
                    b = torch.nn.Module()
                    b.attn = qwen2_5_vl.Qwen2_5_VisionAttention(HIDDEN, HEADS, HIDDEN, prefix=f"visual.blocks.{i}.attn")
                    self.blocks.append(b)

        ours = vllm.build_model(Tower)
        cfg = Qwen3VLVisionConfig(depth=a.layers, hidden_size=HIDDEN, num_heads=HEADS, intermediate_size=4304)
        cfg._attn_implementation = "sdpa"
        theirs = [Qwen3VLVisionAttention(cfg).cuda().bfloat16().eval() for _ in range(a.layers)]
        book = ft.ScaleBook(a.layers, "static", scales, device="cuda")
        for i, m in enumerate(theirs):
            m.fovea_layer = i
            object.__setattr__(m, "fovea_scales", book)
        rows = []
        for res in a.resolutions.split(","):
            grid = GRIDS[res]
            per = grid[0] * grid[1] * grid[2]
            n = per * a.images
            cu = torch.arange(0, n + 1, per, dtype=torch.int32, device="cuda")
            ft.remember_offsets(cu, cu.tolist())
            (vcos, vsin), (tcos, tsin) = rope_tables(grid, a.images)
            x = torch.randn(n, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
            fused_fwd = qwen2_5_vl.Qwen2_5_VisionAttention.forward
            with torch.no_grad():
                def vllm_run():
                    for b in ours.blocks:
                        b.attn(x, cu, vcos, vsin)
                fused = median_ms(vllm_run)
                qwen2_5_vl.Qwen2_5_VisionAttention.forward = qwen2_5_vl.ORIGINAL_FORWARD
                try:
                    interface = median_ms(vllm_run)
                finally:
                    qwen2_5_vl.Qwen2_5_VisionAttention.forward = fused_fwd
                x2 = x[:, 0]
                hf = median_ms(lambda: [ftr.fused_forward(m, x2, cu, position_embeddings=(tcos, tsin)) for m in theirs])
            rows.append((res, n, fused, interface, hf))
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}, {a.images} images, {a.layers} attention modules, FP8 static, median of {a.reps} (ms)")
    print("| resolution | tokens | vllm fused | vllm interface | transformers fused | vllm fused / transformers |")
    print("|---|---|---|---|---|---|")
    for res, n, fused, interface, hf in rows:
        print(f"| {res} | {n} | {fused:.2f} | {interface:.2f} | {hf:.2f} | {fused / hf:.3f} |")


if __name__ == "__main__":
    main()
