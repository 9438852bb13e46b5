#!/usr/bin/env python3
"""Golden files for fovea's video preprocessing from transformers' Qwen3VLVideoProcessor.

On the GPU machine (transformers, torch, OpenCV there; no PyAV or torchcodec, so the clips are decoded
with OpenCV's FFmpeg and those frames are handed to the processor with their metadata):
    python3 tools/make-video-golden.py --clips tests/data/video --out tests/data/video
For each clip and each config (the class defaults; the Qwen3-VL checkpoints' video budget): the
frame indices the processor samples, pixel_values_videos, video_grid_thw, the timestamps of each
temporal patch (Qwen3VLProcessor's rule), and the sampled frames as OpenCV decoded them (uint8), so
the test compares fovea's preprocessing on the same frames exactly and its own decode against them.
Writes golden.safetensors and cases.json.
"""
import argparse
import json
import os

import cv2
import numpy as np
import torch
from safetensors.torch import save_file
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

CONFIGS = {"default": {}, "checkpoint": {"size": {"shortest_edge": 4096, "longest_edge": 25165824}}}


def read_clip(path):
    cap = cv2.VideoCapture(path)
    fps = cap.get(cv2.CAP_PROP_FPS)
    frames = []
    while True:
        ok, f = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(f, cv2.COLOR_BGR2RGB))
    return np.stack(frames), fps


def timestamps(indices, fps, merge):
    try:  # transformers' own rule, where it can be called without a tokenizer
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        return [float(t) for t in Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, merge)], "transformers"
    except Exception as e:  # noqa: BLE001
        print("  timestamps: transformers' rule not callable:", repr(e))
        idx = list(indices)
        if len(idx) % merge:
            idx += [idx[-1]] * (merge - len(idx) % merge)
        t = [i / fps for i in idx]
        return [(t[k] + t[k + merge - 1]) / 2 for k in range(0, len(t), merge)], "formula"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clips", default="tests/data/video")
    ap.add_argument("--out", default="tests/data/video")
    a = ap.parse_args()
    tensors, cases = {}, []
    for name in sorted(os.listdir(a.clips)):
        if not name.endswith((".mp4", ".webm", ".mkv", ".avi")):
            continue
        frames, fps = read_clip(os.path.join(a.clips, name))
        T = len(frames)
        for cname, kw in CONFIGS.items():
            proc = Qwen3VLVideoProcessor(**kw)
            meta = VideoMetadata(total_num_frames=T, fps=fps, width=frames.shape[2], height=frames.shape[1],
                                 frames_indices=list(range(T)))
            idx = [int(i) for i in proc.sample_frames(meta)]
            sampled = frames[idx]
            out = proc(videos=[torch.from_numpy(sampled).permute(0, 3, 1, 2)], do_sample_frames=False, return_tensors="pt")
            px, grid = out["pixel_values_videos"].float(), out["video_grid_thw"][0].tolist()
            ts, ts_from = timestamps(idx, fps, proc.temporal_patch_size)
            key = f"{name}.{cname}"
            tensors[key + ".pixel_values"] = px.contiguous()
            tensors[key + ".frames"] = torch.from_numpy(np.ascontiguousarray(sampled))
            cases.append({"key": key, "clip": name, "config": cname, "size": {k: getattr(proc.size, k, None) if not isinstance(proc.size, dict) else proc.size.get(k)
                                                                       for k in ("shortest_edge", "longest_edge")},
                          "total_frames": T, "fps": fps, "indices": idx, "grid_thw": grid, "timestamps": ts,
                          "timestamps_from": ts_from, "height": int(frames.shape[1]), "width": int(frames.shape[2])})
            print(f"{key}: {T} frames at {fps} fps -> indices {idx}, grid {grid}, timestamps {ts} ({ts_from})")
    os.makedirs(a.out, exist_ok=True)
    save_file(tensors, os.path.join(a.out, "golden.safetensors"))
    import transformers
    with open(os.path.join(a.out, "cases.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "opencv": cv2.__version__, "cases": cases}, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
