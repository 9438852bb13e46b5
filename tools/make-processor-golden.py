#!/usr/bin/env python3
"""Golden files for fovea's image preprocessing, made by transformers' Qwen3-VL image processor.

Run where torch, torchvision, Pillow and transformers are installed (the GPU machine has them):
    python3 tools/make-processor-golden.py --synthetic tests/data/processor
    python3 tools/make-processor-golden.py --photos data/photos --out data/processor-photos

--synthetic DIR: writes small synthetic images of odd sizes and modes (RGB, L, LA, RGBA, P with and
without transparency; PNG, BMP, GIF with two frames, baseline and progressive JPEG, greyscale JPEG;
upscaled, downscaled, unresized, aspect 25:1) into DIR/images, deterministic from a seed, and the
processor's outputs for them into DIR/golden.safetensors + DIR/cases.json. These are small and are
committed; CI compares fovea against them.

--photos DIR --out OUT: the same for real photographs (Debian's mate-backgrounds, fetched with
tools/fetch-photos.sh; never committed), each at a budget of 200704 pixels, and one 4K photograph
at the shipped budget (min 65536, max 16777216) in OUT/full/.

The processor is built as the hub's preprocessor_config.json describes it (docs/encoder.md §Preprocessing config: patch 16,
merge 2, temporal 2, mean = std = 0.5, size {shortest_edge, longest_edge}); the class is
transformers' default (torchvision backend) and is printed. Images go in as PIL images opened from
the files, as a user's code passes them. pixel_values are stored as the uint8 levels they come from
(x * 127.5 + 127.5, checked to be integers, as F16), grid_thw as F32.
"""
import argparse
import json
import os

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file

SEED = 20261129


def processor(min_pixels, max_pixels):
    cls = getattr(transformers, "Qwen2VLImageProcessorFast", None) or transformers.Qwen2VLImageProcessor
    return cls(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=16, temporal_patch_size=2,
               merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def textured(rng, w, h, c):
    """Smooth waves + noise + saturated rectangles: every resize path and the clamp get exercised."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = [128 + 100 * np.sin(x / (5.0 + 3 * k) + k) * np.cos(y / (7.0 + 2 * k) - k) for k in range(c)]
    a = np.stack(planes, -1) + rng.normal(0, 25, (h, w, c))
    for _ in range(4):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        a[y0:y0 + max(1, h // 5), x0:x0 + max(1, w // 5)] = rng.choice([0, 255], size=c)
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def make_images(d):
    """(name, file, min_pixels, max_pixels) for each synthetic case; the files are written into d."""
    rng = np.random.default_rng(SEED)
    os.makedirs(d, exist_ok=True)
    cases = []

    def add(name, img, ext, mn=4096, mx=16384, **save):
        f = os.path.join(d, f"{name}.{ext}")
        img.save(f, **save)
        cases.append((name, f, mn, mx))

    add("rgb-67x45-up", Image.fromarray(textured(rng, 67, 45, 3)), "png", mn=16384, mx=65536)
    add("gray-301x97", Image.fromarray(textured(rng, 301, 97, 1)[..., 0], "L"), "png")
    la = textured(rng, 90, 61, 2)
    add("la-90x61", Image.fromarray(la, "LA"), "png")
    rgba = np.concatenate([textured(rng, 150, 150, 3), np.tile(np.linspace(0, 255, 150).astype(np.uint8), (150, 1))[..., None]], -1)
    rgba[::7, ::5, 3] = rng.integers(0, 256, rgba[::7, ::5, 3].shape)
    add("rgba-150x150", Image.fromarray(rgba, "RGBA"), "png")
    add("rgb-201x133", Image.fromarray(textured(rng, 201, 133, 3)), "bmp")
    add("rgb-128x96-noresize", Image.fromarray(textured(rng, 128, 96, 3)), "png")
    add("wide-1000x40", Image.fromarray(textured(rng, 1000, 40, 3)), "png")
    pal = Image.fromarray(textured(rng, 96, 64, 3)).quantize(colors=200, method=Image.Quantize.MEDIANCUT)
    add("palette-96x64", pal, "png")
    f1 = Image.fromarray(textured(rng, 120, 80, 3)).quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    f2 = Image.fromarray(textured(rng, 120, 80, 3)).quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    add("anim-120x80", f1, "gif", save_all=True, append_images=[f2], duration=100, loop=0)
    tp = Image.fromarray(textured(rng, 70, 50, 3)).quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    add("transparent-70x50", tp, "gif", transparency=0)
    add("rgb-333x222", Image.fromarray(textured(rng, 333, 222, 3)), "jpg", quality=90)
    add("progressive-160x120", Image.fromarray(textured(rng, 160, 120, 3)), "jpg", quality=85, progressive=True)
    add("gray-100x80", Image.fromarray(textured(rng, 100, 80, 1)[..., 0], "L"), "jpg", quality=90)
    return cases


PHOTOS = ["Elephants_5640x3172.jpg", "Storm.jpg", "FreshFlower.jpg", "LadyBird.jpg",
          "Arc-Colors-Transparent-Wallpaper.png", "Gulp.png"]


def run_cases(cases, out_dir, root):
    os.makedirs(out_dir, exist_ok=True)
    tensors, meta = {}, []
    for name, path, mn, mx in cases:
        img = Image.open(path)
        mode, size = img.mode, img.size
        proc = processor(mn, mx)
        out = proc(images=[img], return_tensors="pt")
        pv, grid = out["pixel_values"].to(torch.float64), out["image_grid_thw"][0]
        levels = pv * 127.5 + 127.5
        off = (levels - levels.round()).abs().max().item()
        if off > 1e-3:
            raise SystemExit(f"{name}: pixel_values are not uint8 levels (off by {off}); the golden format assumes they are")
        tensors[f"{name}.pixels"] = levels.round().to(torch.float16).contiguous()
        tensors[f"{name}.grid_thw"] = grid.to(torch.float32).contiguous()
        meta.append({"name": name, "file": os.path.relpath(path, root), "mode": mode, "size": list(size),
                     "min_pixels": mn, "max_pixels": mx, "grid_thw": grid.tolist(),
                     "lossless": not path.lower().endswith((".jpg", ".jpeg"))})
        print(f"{name:36s} {mode:5s} {size[0]:5d}x{size[1]:<5d} -> grid {grid.tolist()} rows {pv.shape[0]}")
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    doc = {"processor": f"{type(proc).__module__}.{type(proc).__name__}", "transformers": transformers.__version__,
           "torch": torch.__version__, "cases": meta}
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print("processor:", doc["processor"], "| wrote", out_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="", help="folder for the synthetic images and their golden files")
    ap.add_argument("--photos", default="", help="folder of mate-backgrounds photographs")
    ap.add_argument("--out", default="data/processor-photos", help="with --photos: output folder")
    a = ap.parse_args()
    root = os.getcwd()
    if a.synthetic:
        run_cases(make_images(os.path.join(a.synthetic, "images")), a.synthetic, root)
    if a.photos:
        cases = [(os.path.splitext(p)[0], os.path.join(a.photos, p), 65536, 200704) for p in PHOTOS
                 if os.path.exists(os.path.join(a.photos, p))]
        run_cases(cases, a.out, root)
        full = os.path.join(a.photos, "Elephants_3840x2160.jpg")
        if os.path.exists(full):
            run_cases([("Elephants_3840x2160-full", full, 65536, 16777216)], os.path.join(a.out, "full"), root)


if __name__ == "__main__":
    main()
