#!/usr/bin/env python3
"""Load test for `fovea serve`: POST /v1/encode at several concurrencies, report throughput and latency.

Python standard library only. Images come from a folder (--images DIR: .jpg/.jpeg/.png/.webp/.bmp/.gif) or
are generated as PNGs (--generate N --size WxH). For each concurrency, that many client threads send
--requests requests in total (each with --images-per-request images, in rotation) and the script
prints one line:

    serve-load | concurrency C | requests R | errors E | images/s | tokens/s | p50 ms | p99 ms | images/forward | forward busy

images/s counts images answered with 200; tokens/s and images/forward come from the server's /metrics
(counter deltas over the level, so run it against a server nobody else is using). BF16 vs FP8 is two
server runs, e.g. on a GPU machine:

    build/fovea serve synthetic:qwen3-vl-8b --port 8000 --mm-encoder-attn-dtype bf16 &
    python3 bench/serve-load.py --url http://127.0.0.1:8000 --images data/photos --concurrency 1,4,16 --json bf16.json
    (stop it, start it again with --mm-encoder-attn-dtype fp8, run again with --json fp8.json)

On a CPU, against synthetic:tiny:

    build/fovea serve synthetic:tiny --device cpu --port 8000 --max-pixels 65536 &
    python3 bench/serve-load.py --generate 8 --size 320x240 --concurrency 1,4,16 --requests 200
"""
import argparse
import base64
import http.client
import json
import os
import random
import re
import struct
import sys
import threading
import time
import urllib.parse
import zlib


def png_bytes(width, height, seed):
    """An RGB PNG: a gradient with noise (so it neither compresses to nothing nor is pure noise)."""
    rng = random.Random(seed)
    rows = []
    for y in range(height):
        row = bytearray([0])  # filter type 0
        for x in range(width):
            n = rng.randrange(48)
            row += bytes(((x * 255 // width + n) % 256, (y * 255 // height + n) % 256, ((x + y) // 2 + n) % 256))
        rows.append(bytes(row))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
            + chunk(b"IEND", b""))


MIME = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".bmp": "image/bmp", ".gif": "image/gif", ".webp": "image/webp"}


def load_images(args):
    """Data URLs of the images to send."""
    if args.images:
        files = sorted(f for f in os.listdir(args.images) if os.path.splitext(f)[1].lower() in MIME)
        if not files:
            sys.exit(f"serve-load: no .jpg/.jpeg/.png/.webp/.bmp/.gif files in {args.images}")
        out = []
        for f in files:
            with open(os.path.join(args.images, f), "rb") as fh:
                out.append(f"data:{MIME[os.path.splitext(f)[1].lower()]};base64," + base64.b64encode(fh.read()).decode())
        return out
    w, h = (int(v) for v in args.size.lower().split("x"))
    return ["data:image/png;base64," + base64.b64encode(png_bytes(w, h, seed)).decode() for seed in range(args.generate)]


class Server:
    def __init__(self, url, timeout):
        u = urllib.parse.urlparse(url)
        if u.scheme != "http" or not u.hostname:
            sys.exit(f"serve-load: --url must be http://HOST:PORT, not {url}")
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout

    def request(self, method, path, body=None, headers=None):
        """(status, body bytes); a new connection per request keeps the clients independent."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def metrics(self):
        status, text = self.request("GET", "/metrics")
        if status != 200:
            sys.exit(f"serve-load: GET /metrics answered {status}")
        values = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


def percentile(sorted_values, p):
    """Nearest-rank percentile of an ascending list (p in [0, 100])."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(p / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


# {"decode": ..., "preprocess": ..., "queue": ..., "forward": ...} of one image in a JSON reply.
PER_IMAGE_TIMINGS = re.compile(rb'"timings_ms":(\{"decode":[^{}]*\})')


def run_level(server, bodies, headers, concurrency, total, images_per_request):
    """Sends `total` requests from `concurrency` threads; returns the level's statistics."""
    lock = threading.Lock()
    next_request = [0]
    latencies, errors, stages = [], {}, {}

    def client():
        while True:
            with lock:
                i = next_request[0]
                if i >= total:
                    return
                next_request[0] += 1
            t0 = time.perf_counter()
            try:
                status, body = server.request("POST", "/v1/encode", bodies[i % len(bodies)], headers)
            except (OSError, http.client.HTTPException) as e:
                status, body = type(e).__name__, b""
            ms = (time.perf_counter() - t0) * 1000
            per_image = []  # the server's own per-image stage times (JSON replies)
            if status == 200 and body[:1] == b"{":
                # Only the small timing objects are parsed: json.loads of a whole reply (megabytes of
                # base64 per image) holds the GIL for tens of ms, and the clients' threads would then
                # measure Python, not the server. A reply without its images' timings is an error.
                per_image = [json.loads(m.group(1)) for m in PER_IMAGE_TIMINGS.finditer(body)]
                if len(per_image) != images_per_request:
                    status = f"reply with {len(per_image)} image timings, not {images_per_request}"
            with lock:
                for t in per_image:
                    for stage, v in t.items():
                        stages.setdefault(stage, []).append(v)
                if status == 200:
                    latencies.append(ms)
                else:
                    errors[str(status)] = errors.get(str(status), 0) + 1
                    if sum(errors.values()) == 1:  # show the first error's reply once
                        print(f"serve-load: first error: {status} {body[:300].decode(errors='replace')}", file=sys.stderr)

    before = server.metrics()
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = server.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("fovea_tokens_encoded_total", "fovea_images_encoded_total", "fovea_encoder_forwards_total",
              "fovea_encoder_forward_seconds_total")}
    latencies.sort()
    images = len(latencies) * images_per_request
    return {
        "concurrency": concurrency,
        "requests": total,
        "errors": errors,
        "wall_s": wall,
        "images_per_s": images / wall,
        "tokens_per_s": delta["fovea_tokens_encoded_total"] / wall,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "images_per_forward": (delta["fovea_images_encoded_total"] / delta["fovea_encoder_forwards_total"]
                               if delta["fovea_encoder_forwards_total"] else float("nan")),
        # The encoder worker's share of the wall time in forwards (upload, forward, download).
        "forward_busy": delta["fovea_encoder_forward_seconds_total"] / wall,
        "server_stage_mean_ms": {k: sum(v) / len(v) for k, v in stages.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--images", help="folder of images to send (default: generated PNGs)")
    ap.add_argument("--generate", type=int, default=8, help="generated images (without --images)")
    ap.add_argument("--size", default="640x480", help="size of generated images, WxH")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=100, help="requests per concurrency level")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent first, not measured")
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--encoding", choices=("base64", "float"), default="base64")
    ap.add_argument("--octet-stream", action="store_true",
                    help="ask for safetensors replies (BF16 tensors; F32 with --encoding float)")
    ap.add_argument("--timeout", type=float, default=600, help="client socket timeout, seconds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.requests < 1 or args.images_per_request < 1:
        sys.exit("serve-load: --concurrency, --requests and --images-per-request must be >= 1")

    server = Server(args.url, args.timeout)
    status, models = server.request("GET", "/v1/models")
    if status != 200:
        sys.exit(f"serve-load: GET /v1/models answered {status}")
    model = json.loads(models)["data"][0]["id"]
    images = load_images(args)
    k = args.images_per_request
    bodies = [json.dumps({"images": [images[(i + m) % len(images)] for m in range(k)], "encoding": args.encoding}).encode()
              for i in range(len(images))]
    headers = {"Content-Type": "application/json"}
    if args.octet_stream:
        headers["Accept"] = "application/octet-stream"

    for i in range(args.warmup):
        status, body = server.request("POST", "/v1/encode", bodies[i % len(bodies)], headers)
        if status != 200:
            sys.exit(f"serve-load: warm-up request answered {status}: {body[:300].decode(errors='replace')}")

    replies = f"safetensors {'f32' if args.encoding == 'float' else 'bf16'}" if args.octet_stream else args.encoding
    print(f"serve-load | {args.url} | model {model} | {len(images)} images, {k} per request | {replies} replies")
    print("serve-load | concurrency | requests | errors | images/s | tokens/s | p50 ms | p99 ms | images/forward | forward busy")
    results = []
    for c in levels:
        r = run_level(server, bodies, headers, c, args.requests, k)
        results.append(r)
        print(f"serve-load | {c:>11} | {r['requests']:>8} | {sum(r['errors'].values()):>6} | {r['images_per_s']:>8.1f} | "
              f"{r['tokens_per_s']:>8.0f} | {r['p50_ms']:>6.1f} | {r['p99_ms']:>6.1f} | {r['images_per_forward']:>14.2f} | {100 * r['forward_busy']:>11.0f}%",
              flush=True)
        if r["server_stage_mean_ms"]:
            print("serve-load |   server, mean ms per image: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in r["server_stage_mean_ms"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "model": model, "images": len(images), "images_per_request": k,
                       "encoding": args.encoding, "octet_stream": args.octet_stream, "results": results}, f, indent=2)
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
