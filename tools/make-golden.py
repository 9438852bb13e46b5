#!/usr/bin/env python3
"""Golden files for fovea's Qwen3-VL vision encoder conformance tests, made by Hugging Face transformers.

Run where torch and transformers are installed (the GPU machine has them; the CPU is used, in fp32,
so no TF32 or GPU kernel choice enters the reference):
    python3 tools/make-golden.py --out tests/data
Writes tests/data/qwen3vl-tiny/{config.json, model.safetensors, golden.safetensors}: a tiny config of
the real architecture (3 blocks, 2 deepstack taps, head_dim 16) with deterministic random weights
rounded to bf16 (stored bf16, as released checkpoints are), random pixel inputs for three images
(one of them two frames: two attention segments), and transformers' fp32 outputs: the final merger
output, every deepstack output, and the hidden states after embedding, after block 0 and before
the merger.

With --model DIR (a checkpoint folder, e.g. from `fovea export-model synthetic:qwen3-vl-8b DIR`) it
instead loads those weights, runs transformers in fp32 (TF32 off) and in BF16 on --device, and
writes DIR-named golden files whose "<output>.bf16" tensors are transformers' own BF16 outputs, so
`fovea check-golden DIR FILE --require-ratio 1.5` can hold fovea's error to 1.5x transformers BF16's
(issue #4's criterion). tools/conformance.sh runs it on the full 8B architecture and makes
tests/data/qwen3vl-8b-2blocks/golden.safetensors (--grids 1x8x8,2x4x4) with it; with --video CLIP
the clip's frames, through transformers' video processor, come first in that batch
(tests/data/qwen3vl-8b-2blocks/golden-video.safetensors: tests/data/video/bt709.mp4 packed with a
1x4x4 image).
"""
import argparse
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

TINY = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
            num_position_embeddings=64, deepstack_visual_indexes=[0, 2], patch_size=16,
            temporal_patch_size=2, spatial_merge_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh")
GRIDS = [[1, 4, 6], [1, 6, 4], [2, 4, 4]]


def init_weights(model, gen):
    """U(-1, 1) scaled so activations stay O(1), like fovea's synthetic models; rounded to bf16."""
    for name, p in model.named_parameters():
        u = torch.rand(p.shape, generator=gen, dtype=torch.float32) * 2 - 1
        if "norm" in name:
            v = 1 + 0.1 * u if name.endswith("weight") else 0.05 * u
        elif name.endswith("bias"):
            v = 0.02 * u
        elif name == "pos_embed.weight":
            v = 0.5 * u
        else:
            v = u * (3.0 / (p.numel() // p.shape[0])) ** 0.5
        with torch.no_grad():
            p.copy_(v.to(torch.bfloat16).to(torch.float32))


def first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def capture_outputs(model, pixels, grid):
    """The final merger and deepstack outputs of one forward, through hooks (API-version proof)."""
    got = {}
    hooks = [model.merger.register_forward_hook(lambda m, i, o: got.__setitem__("merged", first_tensor(o).clone()))]
    for k, dm in enumerate(getattr(model, "deepstack_merger_list", [])):
        hooks.append(dm.register_forward_hook(lambda m, i, o, k=k: got.__setitem__(f"deepstack.{k}", first_tensor(o).clone())))
    with torch.no_grad():
        model(pixels, grid_thw=grid)
    for h in hooks:
        h.remove()
    return {k: v.float().cpu().contiguous() for k, v in got.items()}


def video_pixels(path):
    """A clip through transformers' Qwen3VLVideoProcessor with the Qwen3-VL checkpoints' video budget,
    frames decoded by OpenCV: (pixel_values_videos, its grid)."""
    import cv2
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    cap, frames = cv2.VideoCapture(path), []
    fps = cap.get(cv2.CAP_PROP_FPS)
    while True:
        ok, f = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(f, cv2.COLOR_BGR2RGB))
    proc = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824})
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames[0].shape[1], height=frames[0].shape[0],
                         frames_indices=list(range(len(frames))))
    idx = [int(i) for i in proc.sample_frames(meta)]
    clip = torch.from_numpy(__import__("numpy").stack([frames[i] for i in idx])).permute(0, 3, 1, 2)
    out = proc(videos=[clip], do_sample_frames=False, return_tensors="pt")
    print(f"video {path}: {len(frames)} frames at {fps} fps, sampled {idx}, grid {out['video_grid_thw'][0].tolist()}")
    return out["pixel_values_videos"].float(), [int(x) for x in out["video_grid_thw"][0]]


def load_vision_model(folder):
    """transformers' Qwen3VLVisionModel, fp32, from a checkpoint folder as `fovea export-model` writes
    it (config.json's vision_config, model.safetensors under "model.visual."; BF16, no FP8 tensors).
    TF32 off, so no GPU kernel choice enters the reference."""
    from safetensors.torch import load_file
    with open(os.path.join(folder, "config.json")) as f:
        vc = dict(json.load(f)["vision_config"])
    vc.pop("model_type", None)
    model = Qwen3VLVisionModel(Qwen3VLVisionConfig(**vc)).to(torch.float32).eval()
    state = {k.split("model.visual.", 1)[-1]: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return model


def from_checkpoint(a):
    model = load_vision_model(a.model)
    grids = [[int(x) for x in g.split("x")] for g in a.grids.split(",")] if a.grids else []
    gen = torch.Generator().manual_seed(20261129)
    n = sum(t * h * w for t, h, w in grids)
    pixels = (torch.rand(n, 3 * 2 * 16 * 16, generator=gen) * 2 - 1).to(torch.bfloat16).to(torch.float32)
    if a.video:  # a real clip first, packed with the random images: pixel_values_videos as the processor gives them
        vpx, vgrid = video_pixels(a.video)
        pixels, grids = torch.cat([vpx, pixels]), [vgrid] + grids
    grid = torch.tensor(grids, dtype=torch.int64)
    model = model.to(a.device)
    golden = {"pixel_values": pixels.contiguous(), "grid_thw": grid.to(torch.float32)}
    golden.update(capture_outputs(model, pixels.to(a.device), grid.to(a.device)))
    bf = capture_outputs(model.to(torch.bfloat16), pixels.to(a.device, torch.bfloat16), grid.to(a.device))
    golden.update({k + ".bf16": v for k, v in bf.items()})
    path = os.path.join(a.out, a.name + ".safetensors")
    save_file(golden, path, metadata={"transformers": transformers.__version__, "torch": torch.__version__, "model": a.model})
    for k, v in sorted(golden.items()):
        print(f"{k:16s} {tuple(v.shape)} norm {v.norm().item():.4f}")
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data")
    ap.add_argument("--model", default="", help="checkpoint folder to load instead of the tiny random model")
    ap.add_argument("--grids", default="1x44x80,1x16x16", help="with --model: t x h x w per image")
    ap.add_argument("--name", default="golden-model", help="with --model: output file name (no extension)")
    ap.add_argument("--device", default="cuda", help="with --model: where transformers runs")
    ap.add_argument("--video", default="", help="with --model: a clip whose processed frames come first in the batch")
    a = ap.parse_args()
    if a.model:
        return from_checkpoint(a)
    gen = torch.Generator().manual_seed(20261129)
    cfg = Qwen3VLVisionConfig(**TINY)
    try:
        cfg._attn_implementation = "eager"
    except Exception:
        pass
    model = Qwen3VLVisionModel(cfg).to(torch.float32).eval()
    init_weights(model, gen)
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = (torch.rand(n, 3 * 2 * 16 * 16, generator=gen) * 2 - 1).to(torch.bfloat16).to(torch.float32)
    grid = torch.tensor(GRIDS, dtype=torch.int64)

    got = {}
    hooks = [
        model.blocks[0].register_forward_pre_hook(
            lambda m, args, kwargs: got.__setitem__("embed", (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True),
        model.blocks[0].register_forward_hook(lambda m, i, o: got.__setitem__("block0", first_tensor(o).clone())),
        model.merger.register_forward_pre_hook(
            lambda m, args, kwargs: got.__setitem__("last_hidden", (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True),
        model.merger.register_forward_hook(lambda m, i, o: got.__setitem__("merged", first_tensor(o).clone())),
    ]
    for k, dm in enumerate(model.deepstack_merger_list):
        hooks.append(dm.register_forward_hook(lambda m, i, o, k=k: got.__setitem__(f"deepstack.{k}", first_tensor(o).clone())))
    with torch.no_grad():
        model(pixels, grid_thw=grid)
    for h in hooks:
        h.remove()

    d = os.path.join(a.out, "qwen3vl-tiny")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_vl", "vision_config": dict(TINY, model_type="qwen3_vl")}, f, indent=1)
    save_file({"model.visual." + k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    golden = {"pixel_values": pixels.contiguous(), "grid_thw": grid.to(torch.float32)}
    golden.update({k: v.to(torch.float32).contiguous() for k, v in got.items()})
    save_file(golden, os.path.join(d, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    for k, v in sorted(golden.items()):
        print(f"{k:14s} {tuple(v.shape)} norm {v.norm().item():.4f}")
    print("state_dict keys:", len(model.state_dict()), "first:", list(model.state_dict())[:3])


if __name__ == "__main__":
    main()
