#!/usr/bin/env python3
"""Helpers of bench/serve-matrix.sh (the side-by-side serve matrix) and bench/ab.sh; standard library, plus Pillow for `images`.

    serve-matrix.py images  --photos DIR --out DIR --budget PIXELS [--count N]
        N photographs cropped to 16:9 and resized to the frame of PIXELS pixels (1920x1080 for 2073600,
        3840x2160 for 8294400), written as JPEG (quality 90) into DIR; DIR/images.json records the size
        and the grid fovea's smart_resize gives them at that budget (docs/encoder.md §smart_resize).
        Without photographs (or without Pillow's JPEG support) it writes generated images.
    serve-matrix.py probe   --url URL --image FILE
        One POST /v1/encode of FILE; prints the grid_thw and num_tokens the server answered.
    serve-matrix.py record  --out FILE [--load JSON ...] [KEY=VALUE ...]
        One server's result: the serve-load.py JSON of each level merged with KEY=VALUE facts (values
        parsed as JSON where they are JSON: numbers, null, lists).
    serve-matrix.py bound   --out FILE --images JSON --bench JSON [--bench JSON ...]
        The GPU bound from `fovea bench encoder` runs: images/s per mode and images per forward, and
        that figure scaled to the load's token count per image (linearly) where the grids differ.
    serve-matrix.py summary DIR
        The tables of every run-*.json and bound-*.json in DIR.
"""
import argparse
import base64
import glob
import http.client
import json
import math
import os
import re
import sys
import time
import urllib.parse

PATCH, MERGE = 16, 2
FACTOR = PATCH * MERGE
MIN_PIXELS = 65536
# The photographs of tools/fetch-photos.sh (mate-backgrounds) used first (detailed ones); the rest of the folder after them.
PREFERRED = ["Blinds.jpg", "Dune.jpg", "Elephants.jpg", "Elephants_3840x2160.jpg", "Elephants_5640x3172.jpg",
             "RainDrops.jpg", "Storm.jpg", "TwoWings.jpg"]


def smart_resize(h, w, min_pixels, max_pixels, factor=FACTOR):
    """fovea's image::smart_resize (docs/encoder.md), Python's round being half-to-even like std::nearbyint."""
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb = math.ceil(h * beta / factor) * factor
        wb = math.ceil(w * beta / factor) * factor
    return hb, wb


def frame(budget):
    """The 16:9 frame of `budget` pixels (even sides)."""
    h = int(math.sqrt(budget * 9 / 16)) // 2 * 2
    return h * 16 // 9 // 2 * 2, h


def cmd_images(a):
    from PIL import Image, ImageOps

    w, h = frame(a.budget)
    os.makedirs(a.out, exist_ok=True)
    names = []
    if a.photos and os.path.isdir(a.photos):
        have = sorted(f for f in os.listdir(a.photos) if f.lower().endswith((".jpg", ".jpeg", ".png", ".webp")))
        names = [f for f in PREFERRED if f in have] + [f for f in have if f not in PREFERRED]
    files, source = [], []
    for i in range(a.count):
        path = os.path.join(a.out, f"img{i:02d}-{w}x{h}.jpg")
        if names:
            src = names[i % len(names)]
            img = ImageOps.fit(Image.open(os.path.join(a.photos, src)).convert("RGB"), (w, h), getattr(Image, "Resampling", Image).BICUBIC)
            if i >= len(names):  # more images than photographs: mirror the repeats so no two files are alike
                img = ImageOps.mirror(img)
        else:
            src = "generated"
            noise = Image.effect_noise((w, h), 40 + 5 * i).convert("RGB")
            grad = Image.linear_gradient("L").resize((w, h)).convert("RGB")
            img = Image.blend(noise, grad, 0.5)
        img.save(path, quality=90)
        files.append(path)
        source.append(src)
    gh, gw = (v // PATCH for v in smart_resize(h, w, MIN_PIXELS, a.budget))
    doc = {"budget": a.budget, "size": [w, h], "count": a.count, "grid_thw": [1, gh, gw], "patches": gh * gw,
           "tokens": gh * gw // (MERGE * MERGE), "files": files, "sources": source,
           "bytes": sum(os.path.getsize(f) for f in files)}
    with open(os.path.join(a.out, "images.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"   images: {a.count} x {w}x{h} JPEG ({doc['bytes'] / a.count / 1e6:.1f} MB each; from "
          f"{'photographs' if names else 'generated noise'}) -> grid {doc['grid_thw']} at budget {a.budget}: "
          f"{doc['tokens']} visual tokens per image")


def cmd_probe(a):
    u = urllib.parse.urlparse(a.url)
    with open(a.image, "rb") as f:
        body = json.dumps({"images": ["data:image/jpeg;base64," + base64.b64encode(f.read()).decode()]}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", "/v1/encode", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    reply = r.read()
    conn.close()
    ms = (time.perf_counter() - t0) * 1000
    g = re.search(rb'"grid_thw":\[(\d+),(\d+),(\d+)\]', reply)
    n = re.search(rb'"num_tokens":(\d+)', reply)
    if r.status != 200 or not g or not n:
        sys.exit(f"   probe: {r.status} {reply[:300].decode(errors='replace')}")
    print(f"   probe: the server answered grid_thw [{g.group(1).decode()}, {g.group(2).decode()}, {g.group(3).decode()}], "
          f"{n.group(1).decode()} tokens, {len(reply) / 1e6:.1f} MB reply in {ms:.0f} ms (first request)")


def value(text):
    try:
        return json.loads(text)
    except ValueError:
        return text


def cmd_record(a):
    doc = {}
    for kv in a.facts:
        k, _, v = kv.partition("=")
        doc[k] = value(v)
    levels = []
    for path in a.load or []:
        if os.path.exists(path):
            with open(path) as f:
                d = json.load(f)
            levels += d.get("results", [])
            doc.setdefault("load", {k: v for k, v in d.items() if k != "results"})
    doc["levels"] = levels
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


def cmd_bound(a):
    with open(a.images) as f:
        img = json.load(f)
    rows = []
    for path in a.bench:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            d = json.load(f)
        for r in d.get("rows", []):
            patches = r["tokens"] / r["images"]  # bench encoder's "tokens" are patches (sum of t*h*w)
            ips = r["images"] * 1000 / r["median_ms"]
            rows.append({"resolution": r["resolution"], "mode": r["mode"], "images_per_forward": r["images"],
                         "bench_tokens_per_image": patches / 4, "median_ms": r["median_ms"], "images_per_s": ips,
                         "load_tokens_per_image": img["tokens"],
                         "images_per_s_at_load_tokens": ips * (patches / 4) / img["tokens"]})
    with open(a.out, "w") as f:
        json.dump({"budget": img["budget"], "size": img["size"], "gpu": a.gpu, "rows": rows}, f, indent=1)


def fmt(v, spec=".1f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def cmd_summary(a):
    runs = []
    for path in sorted(glob.glob(os.path.join(a.dir, "run-*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    bounds = []
    for path in sorted(glob.glob(os.path.join(a.dir, "bound-*.json"))):
        with open(path) as f:
            bounds.append(json.load(f))
    order = {"fovea": 0, "hf-peer": 1}
    runs.sort(key=lambda r: (r.get("budget", 0), order.get(r.get("server"), 9), str(r.get("dtype"))))
    print("\n== summary: serve matrix" + (f" ({runs[0].get('gpu')})" if runs and runs[0].get("gpu") else ""))
    print("| budget | server | dtype | tok/img | c | req | err | images/s | p50 ms | p99 ms | img/fwd | fwd busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        for lv in r["levels"]:
            err = sum(lv["errors"].values())
            print(f"| {r.get('budget')} | {r.get('server')} | {r.get('dtype')} | {r.get('tokens_per_image')} | "
                  f"{lv['concurrency']} | {lv['requests']} | {err} | {fmt(lv['images_per_s'])} | {fmt(lv['p50_ms'], '.0f')} | "
                  f"{fmt(lv['p99_ms'], '.0f')} | {fmt(lv['images_per_forward'], '.2f')} | {fmt(100 * lv['forward_busy'], '.0f')}% |")
    phased = [(r, lv) for r in runs for lv in r["levels"] if lv.get("server_phase_mean_ms")]
    if phased:
        print("\n| budget | server | dtype | c | client procs | server ms per request: read / wait / parse / decode / encoder / reply / write | client ms: latency / to head / body |")
        print("|---|---|---|---|---|---|---|")
        for r, lv in phased:
            ph, cl = lv["server_phase_mean_ms"], lv.get("client_mean_ms", {})
            print(f"| {r.get('budget')} | {r.get('server')} | {r.get('dtype')} | {lv['concurrency']} | {lv.get('client_processes', 1)} | "
                  + " / ".join(fmt(ph.get(k)) for k in ("read", "wait", "parse", "decode", "encoder", "reply", "write")) + " | "
                  + " / ".join(fmt(cl.get(k)) for k in ("latency", "to_head", "read_body")) + " |")
    print("\n| budget | server | dtype | ready s | peak RSS GB | GPU MiB (process) | GPU MiB (device, over baseline) | SIGTERM exit | levels done |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        rss = r.get("peak_rss_kb")
        done = ",".join(str(lv["concurrency"]) for lv in r["levels"]) or "-"
        print(f"| {r.get('budget')} | {r.get('server')} | {r.get('dtype')} | {fmt(r.get('ready_s'), '.0f')} | "
              f"{fmt(rss / 1e6 if isinstance(rss, (int, float)) else None, '.1f')} | {fmt(r.get('gpu_process_peak_mib'), '.0f')} | "
              f"{fmt(r.get('gpu_device_peak_over_baseline_mib'), '.0f')} | {r.get('exit_code')} | {done} |")
    if any(b["rows"] for b in bounds):
        print("\n| budget | GPU bound: bench encoder | mode | images/fwd | tok/img (bench) | median ms | images/s | images/s at the load's tok/img |")
        print("|---|---|---|---|---|---|---|---|")
        for b in bounds:
            for r in b["rows"]:
                print(f"| {b['budget']} | {r['resolution']} | {r['mode']} | {r['images_per_forward']} | {r['bench_tokens_per_image']:.0f} | "
                      f"{r['median_ms']:.1f} | {r['images_per_s']:.2f} | {r['images_per_s_at_load_tokens']:.2f} "
                      f"({r['load_tokens_per_image']}) |")
    # One line per server and budget: images/s at each level, beside the best GPU bound of its dtype.
    best = {}
    for b in bounds:
        for r in b["rows"]:
            key = (b["budget"], "bf16" if r["mode"] == "bf16" else "fp8")
            best[key] = max(best.get(key, 0), r["images_per_s_at_load_tokens"])
    if runs:
        print("\n| budget | server | images/s by concurrency | p50 ms by concurrency | best images/s / GPU bound |")
        print("|---|---|---|---|---|")
        for r in runs:
            lv = r["levels"]
            if not lv:
                continue
            bound = best.get((r.get("budget"), "bf16" if r.get("dtype") == "bf16" else "fp8"))
            top = max(x["images_per_s"] for x in lv)
            levels = "/".join(str(x["concurrency"]) for x in lv)
            print(f"| {r.get('budget')} | {r.get('server')} {r.get('dtype')} | {levels}: "
                  f"{' / '.join(fmt(x['images_per_s']) for x in lv)} | {' / '.join(fmt(x['p50_ms'], '.0f') for x in lv)} | "
                  f"{fmt(top / bound if bound else None, '.2f')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("images")
    p.add_argument("--photos", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--count", type=int, default=8)
    p = sub.add_parser("probe")
    p.add_argument("--url", required=True)
    p.add_argument("--image", required=True)
    p = sub.add_parser("record")
    p.add_argument("--out", required=True)
    p.add_argument("--load", action="append")
    p.add_argument("facts", nargs="*", metavar="KEY=VALUE")
    p = sub.add_parser("bound")
    p.add_argument("--out", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--bench", action="append", required=True)
    p.add_argument("--gpu", default="")
    p = sub.add_parser("summary")
    p.add_argument("dir")
    a = ap.parse_args()
    {"images": cmd_images, "probe": cmd_probe, "record": cmd_record, "bound": cmd_bound, "summary": cmd_summary}[a.cmd](a)


if __name__ == "__main__":
    main()
