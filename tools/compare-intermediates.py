#!/usr/bin/env python3
"""fovea's intermediates against transformers', layer by layer: where a conformance miss starts.

    build/fovea encode MODEL IMAGE... --device cpu --dump-dir DIR
    python3 tools/compare-intermediates.py --model MODEL --dump DIR/intermediates.safetensors

MODEL is a checkpoint folder transformers loads (BF16; for an FP8 release, its dequantized twin:
`fovea export-model RELEASE TWIN --fp8-weights none`). The dump holds the pixels fovea's CPU forward
saw (pixel_values, grid_thw) and its intermediates, named as transformers' modules: patch_embed,
blocks.<l>.attn / .mlp (each before its residual add), blocks.<l>, merger, deepstack_merger_list.<k>.
transformers runs the same pixels in fp32 (TF32 off) and in BF16 on --device, its outputs taken by
forward hooks on those modules. For each point, in forward order, the table gives fovea's relative L2
error against transformers fp32 and transformers BF16's own; the first point where fovea's exceeds
--ratio times BF16's is named as the first divergence (exit 1), else exit 0. --self-test perturbs
one block's MLP in the transformers copy and checks that the comparison names that block first.
Needs torch, transformers and safetensors (the GPU machine has them).
"""
import argparse
import copy
import importlib.util
import os
import re
import sys

import torch
from safetensors.torch import load_file


def make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(os.path.dirname(__file__), "make-golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def order_key(name):
    """Forward order: patch_embed, each block's attn, mlp and output (its deepstack merger after it), merger."""
    if name == "patch_embed":
        return (-1, 0)
    if name == "merger":
        return (1 << 30, 0)
    m = re.fullmatch(r"blocks\.(\d+)(\.attn|\.mlp)?", name)
    if m:
        return (int(m.group(1)), {".attn": 0, ".mlp": 1, None: 2}[m.group(2)])
    m = re.fullmatch(r"deepstack_merger_list\.(\d+)", name)
    return (10 ** 6 + int(m.group(1)), 0) if m else None


def hooked_outputs(model, pixels, grid):
    """transformers' outputs of every module order_key names, from one forward."""
    got, hooks = {}, []
    modules = {"patch_embed": model.patch_embed, "merger": model.merger}
    for i, blk in enumerate(model.blocks):
        modules.update({f"blocks.{i}": blk, f"blocks.{i}.attn": blk.attn, f"blocks.{i}.mlp": blk.mlp})
    for k, dm in enumerate(getattr(model, "deepstack_merger_list", [])):
        modules[f"deepstack_merger_list.{k}"] = dm
    for name, mod in modules.items():
        hooks.append(mod.register_forward_hook(
            lambda m, i, o, name=name: got.__setitem__(name, (o[0] if isinstance(o, (tuple, list)) else o).float().cpu())))
    with torch.no_grad():
        model(pixels, grid_thw=grid)
    for h in hooks:
        h.remove()
    return got


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(model, dump, device, ratio, quiet=False):
    """(rows of name, fovea's error, BF16's, over) and the first divergence's name (or None)."""
    pixels, grid = dump["pixel_values"], dump["grid_thw"].round().long()
    model = model.to(device, torch.float32)
    ref = hooked_outputs(model, pixels.to(device), grid.to(device))
    bf = hooked_outputs(copy.deepcopy(model).to(torch.bfloat16), pixels.to(device, torch.bfloat16), grid.to(device))
    rows, first = [], None
    for name in sorted((n for n in dump if order_key(n) is not None and n in ref), key=order_key):
        ours, want = dump[name].reshape(-1), ref[name].reshape(-1)
        if ours.numel() != want.numel():
            sys.exit(f"{name}: fovea dumped {ours.numel()} values, transformers gives {want.numel()}")
        e, e_bf = rel_l2(ours, want), rel_l2(bf[name].reshape(-1), want)
        over = e > ratio * e_bf
        rows.append((name, e, e_bf, over))
        if over and first is None:
            first = name
    if not quiet:
        print(f"{'point':28s} {'fovea vs fp32':>14s} {'bf16 vs fp32':>14s} {'ratio':>8s}")
        for name, e, e_bf, over in rows:
            print(f"{name:28s} {e:14.3e} {e_bf:14.3e} {e / max(e_bf, 1e-30):8.3f}{'  <-- over' if over else ''}")
    return rows, first


def self_test(model, dump, device, ratio):
    _, first = compare(model, dump, device, ratio, quiet=True)
    if first is not None:
        sys.exit(f"self-test: the unperturbed model already diverges at {first}")
    target = len(model.blocks) // 2
    with torch.no_grad():
        w = model.blocks[target].mlp.linear_fc2.weight
        w.mul_(1.05)  # 5% on one block's MLP: far beyond BF16's rounding
    _, first = compare(model, dump, device, ratio, quiet=True)
    if first != f"blocks.{target}.mlp":
        sys.exit(f"self-test: block {target}'s MLP was perturbed, the comparison named {first}")
    print(f"self-test: a 5% change to blocks.{target}.mlp is named as the first divergence; the model as loaded has none")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (BF16) transformers loads")
    ap.add_argument("--dump", required=True, help="intermediates.safetensors from fovea encode --dump-dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ratio", type=float, default=1.5, help="divergence: fovea's error over this times BF16's")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    model = make_golden().load_vision_model(a.model)
    dump = load_file(a.dump)
    if a.self_test:
        return self_test(model, dump, a.device, a.ratio)
    _, first = compare(model, dump, a.device, a.ratio)
    if first is None:
        print(f"no divergence: every point within {a.ratio}x transformers BF16's own error")
        return 0
    print(f"first divergence: {first} (fovea's error over {a.ratio}x transformers BF16's)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
