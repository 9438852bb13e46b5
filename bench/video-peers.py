#!/usr/bin/env python3
"""A video clip end to end (decode, preprocess, encoder forward): fovea beside transformers, one run.

On the GPU machine (torch, transformers and OpenCV are there):
    python3 bench/video-peers.py --fovea build/fovea --clip clip.mp4 --reps 3
Both take the clip through Qwen3-VL's video path at the Qwen3-VL checkpoints' video budget
(video_preprocessor_config.json: size 4096..25165824 pixels over all sampled frames, 2 frames a
second) and the Qwen3-VL-8B vision architecture with random weights (timings do not depend on them):
- fovea: `fovea bench mm-processor` on a folder holding the clip (FFmpeg decode of every frame, the
  sampled ones converted to RGB and resized as they come, patchify, the encoder's CUDA-graph forward),
  BF16 and FP8 attention, medians of --reps after one warm-up;
- transformers: OpenCV decodes the clip (every frame grabbed, the sampled ones converted: the same
  frames fovea samples), Qwen3VLVideoProcessor preprocesses them (on the CPU, its default, and on the
  GPU with device="cuda"), Qwen3VLVisionModel runs in BF16 (sdpa) on the GPU; medians of --reps after
  one warm-up. The grids of the two are checked equal.
Prints one table, writes --json.
"""
import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import cv2
import numpy as np
import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

BUDGET = {"shortest_edge": 4096, "longest_edge": 25165824}


def fovea_rows(fovea, clip, reps):
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(clip, os.path.join(d, os.path.basename(clip)))
        for dt in ("bf16", "fp8"):
            path = os.path.join(d, f"{dt}.json")
            cmd = [fovea, "bench", "mm-processor", "--model", "synthetic:qwen3-vl-8b", "--dataset-name", "folder",
                   "--dataset-path", d, "--num-prompts", str(reps), "--num-warmups", "1", "--mm-encoder-attn-dtype", dt,
                   "--video-min-pixels", str(BUDGET["shortest_edge"]), "--video-max-pixels", str(BUDGET["longest_edge"]),
                   "--output-json", path]
            out = subprocess.run(cmd, capture_output=True, text=True)
            sys.stderr.write(out.stdout + out.stderr)
            if out.returncode != 0:
                sys.exit(f"video-peers: {' '.join(cmd)} failed ({out.returncode})")
            doc = json.load(open(path))
            st = doc["stages"]
            item = doc["per_request"][-1]["items"][0]
            rows[f"fovea {dt}"] = {"decode": st["decode"]["median_ms"], "preprocess": st["preprocess"]["median_ms"],
                                   "forward": st["encoder forward"]["median_ms"], "total": st["total"]["median_ms"],
                                   "grid": item["grid_thw"], "tokens": item["tokens"]}
    return rows


def hf_decode(clip, proc):
    """(sampled RGB frames [n, h, w, 3], indices, fps): every frame grabbed, the sampled ones retrieved."""
    cap = cv2.VideoCapture(clip)
    total, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), cap.get(cv2.CAP_PROP_FPS)
    w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    meta = VideoMetadata(total_num_frames=total, fps=fps, width=w, height=h, frames_indices=list(range(total)))
    idx = [int(i) for i in proc.sample_frames(meta)]
    want, frames, k = set(idx), {}, 0
    while cap.grab():
        if k in want:
            ok, f = cap.retrieve()
            frames[k] = cv2.cvtColor(f, cv2.COLOR_BGR2RGB)
        k += 1
    missing = [i for i in idx if i not in frames]
    if missing:
        sys.exit(f"video-peers: OpenCV gave {k} frames of {total}; missing sampled frames {missing[:5]}")
    return np.stack([frames[i] for i in idx]), idx, fps


def median_ms(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fovea", default="build/fovea")
    ap.add_argument("--clip", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = fovea_rows(a.fovea, a.clip, a.reps)

    proc = Qwen3VLVideoProcessor(size=BUDGET)
    decoded = {}

    def decode():
        decoded["frames"], decoded["idx"], decoded["fps"] = hf_decode(a.clip, proc)

    dec_ms = median_ms(decode, a.reps)
    video = torch.from_numpy(decoded["frames"]).permute(0, 3, 1, 2)
    out = {}

    def pre(device):
        def f():
            kw = {"device": device} if device else {}
            out["px"] = proc(videos=[video], do_sample_frames=False, return_tensors="pt", **kw)
        return f

    pre_ms = {"cpu": median_ms(pre(None), a.reps)}
    try:  # the fast processor's device= (torchvision on the GPU); a version without it keeps the CPU row only
        pre_ms["cuda"] = median_ms(pre("cuda"), a.reps)
    except Exception as e:  # noqa: BLE001
        print(f"video-peers: preprocessing on cuda failed: {e!r}", file=sys.stderr)
    px = out["px"]["pixel_values_videos"].to("cuda", torch.bfloat16)
    grid = out["px"]["video_grid_thw"].to("cuda")
    model = importlib.import_module("encoder-peers").vision_model_8b()  # this script's folder is on sys.path

    def forward():
        with torch.no_grad():
            model(px, grid_thw=grid)

    fwd_ms = median_ms(forward, a.reps)
    g = [int(x) for x in grid[0].tolist()]
    tokens = g[0] * g[1] * g[2] // 4
    for dev in pre_ms:
        rows[f"transformers bf16 (preprocess on {dev})"] = {"decode": dec_ms, "preprocess": pre_ms[dev], "forward": fwd_ms,
                                                            "total": dec_ms + pre_ms[dev] + fwd_ms, "grid": g, "tokens": tokens}
    fg = rows["fovea bf16"]["grid"]
    print(f"video-peers | {a.clip} | {len(decoded['idx'])} frames sampled at {decoded['fps']:.3g} fps | grid {g} "
          f"(fovea {fg}: {'same' if list(fg) == g else 'DIFFERENT'}) | {tokens} tokens | median ms of {a.reps}")
    print("video-peers | path | decode | preprocess | forward | total")
    for name, r in rows.items():
        print(f"video-peers | {name} | {r['decode']:.1f} | {r['preprocess']:.1f} | {r['forward']:.1f} | {r['total']:.1f}")
    if a.json:
        json.dump({"clip": a.clip, "indices": decoded["idx"], "grid": g, "rows": rows}, open(a.json, "w"), indent=1)
    return 0 if list(fg) == g else 1


if __name__ == "__main__":
    sys.exit(main())
