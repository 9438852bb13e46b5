#!/usr/bin/env python3
"""The encoder-cache files fovea writes, read the way vLLM reads them, against transformers (issue 13).

    python3 tools/ec-cache-vllm.py --model CHECKPOINT --cache DIR [--max-pixels N] IMAGE...

    python3 tools/ec-cache-vllm.py --model CHECKPOINT --cache DIR --via-chat http://HOST:PORT IMAGE...

For each image file (cached by `fovea encode CHECKPOINT IMAGE... --ec-storage-path DIR`, keys
--uuid-from sha256, the default; or, with --via-chat, by a running `fovea serve CHECKPOINT
--ec-storage-path DIR`, to which the images are first posted as vLLM's EPD proxy posts them: one
POST /v1/chat/completions holding every image as a data URL whose "uuid" is the sha256 of that URL
string, the reply's ec_transfer_params checked for each image's key, grid and position, and the
file then looked up under that key):
  - the file is loaded as vLLM's ECExampleConnector loads it:
    safetensors.torch.load_file(DIR/<sha256>/encoder_cache.safetensors, device="cuda")["ec_cache"];
  - it is split as vLLM's Qwen3-VL model splits it: torch.split(x, [O, O * k], dim=-1), then the
    deepstack part .view(N, k, O).permute(1, 0, 2);
  - transformers' image processor (Qwen2VLImageProcessor, as the checkpoint's
    preprocessor_config.json sets it, on the PIL image) and Qwen3VLVisionModel (the checkpoint's
    weights; fp32 with TF32 off as the reference, and BF16) give the same image's outputs.
Per part: rel L2 of fovea's file and of transformers BF16 against the fp32 reference, and their
ratio; the grid and the shape must match exactly. Exit 1 if any ratio passes --max-ratio (1.5,
the encoder conformance test's bound) or any shape or grid differs.
"""
import argparse
import base64
import hashlib
import json
import os
import sys
import urllib.request

import torch
import transformers
from PIL import Image
from safetensors.torch import load_file
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def outputs(model, pixels, grid):
    """The merger's and each deepstack merger's output of one forward (hooks: API-version proof)."""
    got = {}
    hooks = [model.merger.register_forward_hook(lambda m, i, o: got.__setitem__(0, first(o).float()))]
    for k, dm in enumerate(model.deepstack_merger_list):
        hooks.append(dm.register_forward_hook(lambda m, i, o, k=k: got.__setitem__(k + 1, first(o).float())))
    with torch.no_grad():
        model(pixels, grid_thw=grid)
    for h in hooks:
        h.remove()
    return [got[k] for k in sorted(got)]


MIME = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp", ".gif": "image/gif"}


def data_url(path):
    with open(path, "rb") as f:
        payload = base64.b64encode(f.read()).decode()
    return f"data:{MIME[os.path.splitext(path)[1].lower()]};base64,{payload}"


def post_as_proxy(server, paths):
    """One encode-instance request as vLLM's EPD proxy sends it; returns {path: key} and the reply's
    ec_transfer_params (entries checked against the keys and positions)."""
    urls = [data_url(p) for p in paths]
    keys = [hashlib.sha256(u.encode()).hexdigest() for u in urls]
    parts = [{"type": "image_url", "image_url": {"url": u}, "uuid": k} for u, k in zip(urls, keys)]
    body = json.dumps({"model": None, "messages": [{"role": "user", "content": parts}], "stream": False}).encode()
    req = urllib.request.Request(server.rstrip("/") + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "x-request-id": "conformance:0:000000"})
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    params = reply.get("ec_transfer_params") or {}
    for i, k in enumerate(keys):
        if k not in params or i not in params[k].get("item_indices", []):
            raise SystemExit(f"ec-cache-vllm: the reply has no entry for {paths[i]} (key {k[:12]}...) at position {i}")
    return dict(zip(paths, keys)), params


def rel_l2(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--min-pixels", type=int, default=0, help="0: the checkpoint's")
    ap.add_argument("--max-pixels", type=int, default=0, help="0: the checkpoint's")
    ap.add_argument("--max-ratio", type=float, default=1.5)
    ap.add_argument("--via-chat", metavar="URL",
                    help="a fovea serve writing DIR: post the images to its POST /v1/chat/completions first")
    ap.add_argument("images", nargs="+")
    a = ap.parse_args()
    with open(os.path.join(a.model, "config.json")) as f:
        vc = dict(json.load(f)["vision_config"])
    vc.pop("model_type", None)
    pp = {}
    if os.path.exists(os.path.join(a.model, "preprocessor_config.json")):
        with open(os.path.join(a.model, "preprocessor_config.json")) as f:
            pp = json.load(f)
    size = dict(pp.get("size") or {"shortest_edge": 65536, "longest_edge": 16777216})
    if a.min_pixels:
        size["shortest_edge"] = a.min_pixels
    if a.max_pixels:
        size["longest_edge"] = a.max_pixels
    proc = transformers.Qwen2VLImageProcessor(
        size=size, patch_size=vc.get("patch_size", 16), temporal_patch_size=vc.get("temporal_patch_size", 2),
        merge_size=vc.get("spatial_merge_size", 2), image_mean=pp.get("image_mean", [0.5] * 3),
        image_std=pp.get("image_std", [0.5] * 3))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**vc)).to(torch.float32).eval()
    state = {k.split("model.visual.", 1)[-1]: v.float() for k, v in load_file(os.path.join(a.model, "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    model = model.cuda()
    model_bf16 = Qwen3VLVisionModel(Qwen3VLVisionConfig(**vc)).to(torch.bfloat16).eval()
    model_bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=True)
    model_bf16 = model_bf16.cuda()
    O = vc["out_hidden_size"]
    k = len(vc.get("deepstack_visual_indexes", []))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, processor {type(proc).__name__}, "
          f"out_hidden {O}, deepstack {k}")
    bad = 0
    chat_keys, params = post_as_proxy(a.via_chat, a.images) if a.via_chat else ({}, {})
    for path in a.images:
        with open(path, "rb") as f:
            key = chat_keys.get(path) or hashlib.sha256(f.read()).hexdigest()
        file = os.path.join(a.cache, key, "encoder_cache.safetensors")
        x = load_file(file, device="cuda")["ec_cache"]  # as ECExampleConnector loads it
        merged, multiscale = torch.split(x, [O, O * k], dim=-1)  # as vLLM's Qwen3-VL splits it
        parts = [merged] + list(multiscale.reshape(x.shape[0], k, O).permute(1, 0, 2).unbind(0))
        enc = proc(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        grid = enc["image_grid_thw"].cuda()
        ref = outputs(model, enc["pixel_values"].cuda().float(), grid)
        hf16 = outputs(model_bf16, enc["pixel_values"].cuda().to(torch.bfloat16), grid)
        tokens = int(grid.prod().item()) // 4
        shape_ok = x.dtype == torch.bfloat16 and tuple(x.shape) == (tokens, O * (1 + k))
        if params:  # the grid the proxy would put in the image_embeds part sizes the consumer's placeholder
            shape_ok = shape_ok and params[key]["metadata"]["image_grid_thw"] == grid.tolist()[0]
        print(f"{os.path.basename(path)}: key {key[:12]}..., ec_cache {x.dtype} {tuple(x.shape)}, "
              f"grid {grid.tolist()[0]}, {tokens} tokens: {'shape ok' if shape_ok else 'SHAPE MISMATCH'}")
        bad += not shape_ok
        for p, (ours, want, theirs) in enumerate(zip(parts, ref, hf16)):
            if ours.shape != want.shape:
                print(f"   part {p}: shape {tuple(ours.shape)} against {tuple(want.shape)}")
                bad += 1
                continue
            e, e16 = rel_l2(ours, want), rel_l2(theirs, want)
            ratio = e / e16
            ok = ratio <= a.max_ratio and torch.isfinite(ours.float()).all().item()
            bad += not ok
            name = "merged" if p == 0 else f"deepstack {p - 1}"
            print(f"   {name:<12} fovea rel L2 {e:.3e} | transformers BF16 {e16:.3e} | ratio {ratio:.2f} {'ok' if ok else 'FAIL'}")
    print("ec-cache-vllm:", "all parts within bounds" if not bad else f"{bad} failure(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
