#!/usr/bin/env python3
"""Load test for `fovea serve` (POST /v1/encode or /v1/chat/completions) at several concurrencies: throughput, latency.

Python standard library only. Images come from a folder (--images DIR: .jpg/.jpeg/.png/.webp/.bmp/.gif) or
are generated as PNGs (--generate N --size WxH). For each concurrency, that many client threads send
--requests requests in total (each with --images-per-request images, in rotation) and the script
prints one line:

    serve-load | concurrency C | requests R | errors E | images/s | tokens/s | p50 ms | p99 ms | images/forward | forward busy

The client threads of a level are spread over processes (--processes; by default one per 4 threads),
so that one GIL-bound Python process reading megabytes of reply is not what is measured. Below each
line: the server's mean ms per image (decode, preprocess, queue, forward), per request by phase (from
/metrics: read, wait, parse, decode, encoder, reply, write), and the client's mean latency, time to
the reply's head and time reading its body.

With --videos DIR (.mp4/.webm/.mkv/.avi/.mov clips), every --video-every-th request sends one clip
(a "videos" item) instead of its images, and a line per level gives the clips answered per second.

images/s counts images answered with 200; tokens/s and images/forward come from the server's /metrics
(counter deltas over the level, so run it against a server nobody else is using). BF16 vs FP8 is two
server runs, e.g. on a GPU machine:

    build/fovea serve synthetic:qwen3-vl-8b --port 8000 --mm-encoder-attn-dtype bf16 &
    python3 bench/serve-load.py --url http://127.0.0.1:8000 --images data/photos --concurrency 1,4,16 --json bf16.json
    (stop it, start it again with --mm-encoder-attn-dtype fp8, run again with --json fp8.json)

On a CPU, against synthetic:tiny:

    build/fovea serve synthetic:tiny --device cpu --port 8000 --max-pixels 65536 &
    python3 bench/serve-load.py --generate 8 --size 320x240 --concurrency 1,4,16 --requests 200

--endpoint chat sends vLLM's encode-instance request instead, POST /v1/chat/completions (the server
needs --ec-storage-path): {"model", "messages": [{"role": "user", "content": [--images-per-request
image_url parts]}], "stream": false}. Its reply carries no embeddings and no per-image timings, so
the per-image line is left out; usage.prompt_tokens (mean per request) and the /metrics phases are
printed instead. A request counts as answered only if it is a 200 whose ec_transfer_params has one
entry per key of the request, each with the item_indices of that key's parts; anything else is an
error. The table, the JSON and their fields are those of encode mode, with "endpoint" recorded, so
the two endpoints compare side by side against one server started with --ec-storage-path:

    build/fovea serve synthetic:tiny --device cpu --port 8000 --ec-storage-path /dev/shm/ec --ec-storage-max-bytes 1000000000 &
    python3 bench/serve-load.py --endpoint encode --generate 8 --size 320x240 --concurrency 1,4 --json encode.json
    python3 bench/serve-load.py --endpoint chat --generate 8 --size 320x240 --concurrency 1,4 --json chat.json

Keys (--unique-keys): a server with an encoder cache encodes an image only once per key (the part's
"uuid", else the sha256 of its URL), so a load that cycles through a few images would measure cache
hits after its first round. With --unique-keys every image part carries a "uuid" of its own
(load-<pid>-<time>-<level>-<request>-<part>), and every request is really encoded and written. Its
default: on with --endpoint chat; in encode mode, on when the server has an encoder cache (its
/metrics export fovea_ec_cache_bytes) and off otherwise, where a key changes nothing and the bodies
stay the bare data URLs they always were (which other servers, e.g. bench/hf-serve-peer.py, take).
--no-unique-keys measures cache hits on purpose. Each level's encoder-cache hits, misses and writes
(from /metrics) are printed. Unique keys write one file per image: bound the folder with
--ec-storage-max-bytes (an 8B-model image at the FullHD budget is ~67 MB) or empty it afterwards.
"""
import argparse
import base64
import hashlib
import http.client
import json
import multiprocessing
import os
import random
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


VIDEO_MIME = {".mp4": "video/mp4", ".mov": "video/quicktime", ".webm": "video/webm", ".mkv": "video/x-matroska", ".avi": "video/x-msvideo"}


def load_clips(folder):
    """Data URLs of the clips in a folder."""
    files = sorted(f for f in os.listdir(folder) if os.path.splitext(f)[1].lower() in VIDEO_MIME)
    if not files:
        sys.exit(f"serve-load: no .mp4/.mov/.webm/.mkv/.avi files in {folder}")
    out = []
    for f in files:
        with open(os.path.join(folder, f), "rb") as fh:
            out.append(f"data:{VIDEO_MIME[os.path.splitext(f)[1].lower()]};base64," + base64.b64encode(fh.read()).decode())
    return out


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


# The per-image stage times in a JSON reply: {"decode": ..., "preprocess": ..., "queue": ..., "forward": ...}.
TIMINGS_KEY = b'"timings_ms":{"decode":'


def per_image_timings(body):
    """Only the small timing objects are parsed: json.loads of a whole reply (megabytes of base64 per
    image) holds the GIL for tens of ms, and the clients' threads would then measure Python, not the
    server. bytes.find skips the base64 at memory speed (a regex scan of it is several times slower)."""
    out, i = [], body.find(TIMINGS_KEY)
    while i >= 0:
        j = body.index(b"}", i)
        out.append(json.loads(body[i + len(b'"timings_ms":'):j + 1]))
        i = body.find(TIMINGS_KEY, j)
    return out


def request_timed(server, path, body, headers):
    """(status, reply body, ms to the reply's head, ms reading its body) on a new connection."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=server.timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        t1 = time.perf_counter()
        data = r.read()
        return r.status, data, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
    finally:
        conn.close()


ENDPOINTS = {"encode": "/v1/encode", "chat": "/v1/chat/completions"}
# Stands for a part's uuid in a body made once; '@' occurs neither in base64 nor in the JSON around it.
KEY_MARK = "@KEY@"
# In every key of this run: keys differ from an earlier run's, whose files may still be in the folder.
RUN_ID = f"{os.getpid()}-{int(time.time())}"


class Body:
    """One request's body, made once (json.dumps of megabytes of base64 is slow), with a slot for the
    uuid of each part when keys are unique: a request only joins the pieces with its own keys."""

    def __init__(self, payload, urls, images, clips):
        self.pieces = json.dumps(payload).encode().split(f'"{KEY_MARK}"'.encode())
        self.counts = (images, clips)
        self.size = len(urls)
        # The key the server gives a part without a uuid: the sha256 of its URL string (vLLM's proxy's rule).
        self.hashes = [hashlib.sha256(u.encode()).hexdigest() for u in urls]

    def fill(self, keys):
        """The body's bytes with these keys in its uuid slots (a body without slots ignores them)."""
        out = [self.pieces[0]]
        for key, piece in zip(keys, self.pieces[1:]):
            out += [b'"' + key.encode() + b'"', piece]
        return b"".join(out)


def part(kind, url, unique):
    """An OpenAI content part {"type": "image_url", "image_url": {"url": ...}}, with a uuid slot if unique."""
    p = {"type": kind, kind: {"url": url}}
    if unique:
        p["uuid"] = KEY_MARK
    return p


def request_keys(body, tag, i, unique):
    """The keys of request i of a level (tag): uuids of its own with unique keys (a safe folder name:
    [A-Za-z0-9._-]), else those the server derives from the URLs."""
    if unique:
        return [f"load-{RUN_ID}-{tag}-{i}-{m}" for m in range(body.size)]
    return body.hashes


def check_chat_reply(reply, keys):
    """(None, usage.prompt_tokens) for a chat reply whose ec_transfer_params has one entry per key of
    the request, each with its parts' item_indices and a [t, h, w] grid; else (what is wrong, 0)."""
    want = {}
    for index, key in enumerate(keys):
        want.setdefault(key, []).append(index)
    try:
        doc = json.loads(reply)  # small: a chat reply carries no embeddings
        params, tokens = doc["ec_transfer_params"], doc["usage"]["prompt_tokens"]
        if not isinstance(params, dict) or set(params) != set(want):
            return f"ec_transfer_params has {len(params)} keys, not the request's {len(want)}", 0
        for key, indices in want.items():
            meta = params[key]["metadata"]
            grid = meta.get("image_grid_thw") or meta["video_grid_thw"]  # a clip: its grid and timestamps
            if params[key]["item_indices"] != indices or len(grid) != 3 or min(grid) < 1:
                return f"ec_transfer_params[{key!r}] is {json.dumps(params[key])[:160]}, not item_indices {indices}", 0
        if not isinstance(tokens, int) or tokens < 1:
            return f"usage.prompt_tokens is {tokens!r}", 0
        return None, tokens
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"reply without ec_transfer_params or usage ({type(e).__name__}: {e})", 0


# What the clients of one process share; set in the parent before the client processes are forked.
_LEVEL = {}


def clients(indices, concurrency, tag):
    """Sends the requests `indices` (into the bodies) of level `tag` from `concurrency` threads; their raw results."""
    server, bodies, headers, path, unique = (_LEVEL[k] for k in ("server", "bodies", "headers", "path", "unique"))
    chat = path == ENDPOINTS["chat"]
    lock = threading.Lock()
    todo = list(reversed(indices))
    out = {"latencies": [], "head_ms": [], "read_ms": [], "errors": {}, "stages": {}, "first_error": None, "images": 0,
           "clips": 0, "prompt_tokens": []}

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            body = bodies[i % len(bodies)]
            images, clips = body.counts
            keys = request_keys(body, tag, i, unique)
            data = body.fill(keys)  # before the clock starts: the client's copying is not the server's time
            t0 = time.perf_counter()
            head_ms = read_ms = 0.0
            try:
                status, reply, head_ms, read_ms = request_timed(server, path, data, headers)
            except (OSError, http.client.HTTPException) as e:
                status, reply = type(e).__name__, b""
            ms = (time.perf_counter() - t0) * 1000
            per_image, problem, tokens = [], None, 0  # the server's own per-image stage times (JSON encode replies)
            if status == 200 and chat:
                problem, tokens = check_chat_reply(reply, keys)
                if problem:  # a 200 that does not list the request's keys is a failed request
                    status = "bad ec_transfer_params"
            elif status == 200 and reply[:1] == b"{":
                per_image = per_image_timings(reply)
                if len(per_image) != images + clips:  # a reply without its items' timings is an error
                    status = f"reply with {len(per_image)} item timings, not {images + clips}"
            with lock:
                for t in per_image:
                    for stage, v in t.items():
                        out["stages"].setdefault(stage, []).append(v)
                if status == 200:
                    out["images"] += images
                    out["clips"] += clips
                    out["latencies"].append(ms)
                    out["head_ms"].append(head_ms)
                    out["read_ms"].append(read_ms)
                    if chat:
                        out["prompt_tokens"].append(tokens)
                else:
                    out["errors"][str(status)] = out["errors"].get(str(status), 0) + 1
                    if out["first_error"] is None:
                        out["first_error"] = f"{status} {problem or reply[:300].decode(errors='replace')}"

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


PHASES = ("read", "wait", "parse", "decode", "encoder", "reply", "write")
EC_COUNTERS = ("hits", "misses", "writes")


def run_level(server, pool, processes, concurrency, total, tag):
    """Sends `total` requests from `concurrency` threads spread over up to `processes` processes
    (the pool's); returns the level's statistics. tag names the level in the requests' keys."""
    p = max(1, min(processes, concurrency))
    shares = [(list(range(k, total, p)), concurrency // p + (1 if k < concurrency % p else 0), tag) for k in range(p)]
    before = server.metrics()
    start = time.perf_counter()
    parts = pool.starmap(clients, shares) if pool and p > 1 else [clients(*shares[0])]
    wall = time.perf_counter() - start
    after = server.metrics()
    merged = {"latencies": [], "head_ms": [], "read_ms": [], "errors": {}, "stages": {}, "images": 0, "clips": 0,
              "prompt_tokens": []}
    for share in parts:
        merged["images"] += share["images"]
        merged["clips"] += share["clips"]
        for k in ("latencies", "head_ms", "read_ms", "prompt_tokens"):
            merged[k] += share[k]
        for k, n in share["errors"].items():
            merged["errors"][k] = merged["errors"].get(k, 0) + n
        for k, v in share["stages"].items():
            merged["stages"].setdefault(k, []).extend(v)
    first_error = next((share["first_error"] for share in parts if share["first_error"]), None)
    if first_error:  # show one error's reply
        print(f"serve-load: first error: {first_error}", file=sys.stderr)
    names = ["fovea_tokens_encoded_total", "fovea_inputs_encoded_total", "fovea_encoder_forwards_total",
             "fovea_encoder_forward_seconds_total", "fovea_request_duration_seconds_count"]
    names += [f'fovea_encode_phase_seconds_total{{phase="{ph}"}}' for ph in PHASES]
    names += [f"fovea_ec_cache_{k}_total" for k in EC_COUNTERS]
    # Images and clips encoded: fovea_inputs_encoded_total, or from servers before its rename (and the
    # peer) fovea_images_encoded_total, which counted the same.
    inputs = "fovea_inputs_encoded_total" if "fovea_inputs_encoded_total" in after else "fovea_images_encoded_total"
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in names}
    delta["fovea_inputs_encoded_total"] = after.get(inputs, 0) - before.get(inputs, 0)
    latencies = sorted(merged["latencies"])
    images = merged["images"]
    handled = delta["fovea_request_duration_seconds_count"]
    mean = lambda v: sum(v) / len(v) if v else float("nan")
    return {
        "endpoint": _LEVEL["path"],
        "concurrency": concurrency,
        "client_processes": p,
        "requests": total,
        "errors": merged["errors"],
        "wall_s": wall,
        "images_per_s": images / wall,
        "clips_per_s": merged["clips"] / wall,
        "tokens_per_s": delta["fovea_tokens_encoded_total"] / wall,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "images_per_forward": (delta["fovea_inputs_encoded_total"] / delta["fovea_encoder_forwards_total"]
                               if delta["fovea_encoder_forwards_total"] else float("nan")),
        # The encoder worker's share of the wall time in forwards (upload, forward, download).
        "forward_busy": delta["fovea_encoder_forward_seconds_total"] / wall,
        "server_stage_mean_ms": {k: mean(v) for k, v in merged["stages"].items()},
        # Where a request's time went, mean ms: the server's phases (from /metrics; empty from a server
        # without them), and the client's view: request sent to reply head, reply body read.
        "server_phase_mean_ms": ({ph: 1000 * delta[f'fovea_encode_phase_seconds_total{{phase="{ph}"}}'] / handled
                                  for ph in PHASES} if handled else {}),
        "client_mean_ms": {"latency": mean(merged["latencies"]), "to_head": mean(merged["head_ms"]),
                           "read_body": mean(merged["read_ms"])},
        # Chat replies only: usage.prompt_tokens, the visual tokens of a request (cache hits included).
        "prompt_tokens_per_request": mean(merged["prompt_tokens"]) if merged["prompt_tokens"] else None,
        # The encoder cache over the level (a server without one: None): hits mean images not encoded.
        "ec_cache": ({k: delta[f"fovea_ec_cache_{k}_total"] for k in EC_COUNTERS} | {"bytes": after["fovea_ec_cache_bytes"]}
                     if "fovea_ec_cache_bytes" in after else None),
    }


def make_bodies(args, images, clips, model, unique):
    """The bodies the requests cycle through: one per image (its --images-per-request images from it
    on), and with --videos a clip's body after every --video-every - 1 of them."""
    k = args.images_per_request
    bodies = []
    for i in range(len(images)):
        urls = [images[(i + m) % len(images)] for m in range(k)]
        if args.endpoint == "chat":  # what vLLM's EPD proxy sends an encode instance
            payload = {"model": model, "messages": [{"role": "user", "content": [part("image_url", u, unique) for u in urls]}],
                       "stream": False}
        elif unique:
            payload = {"images": [part("image_url", u, True) for u in urls], "encoding": args.encoding}
        else:  # the bare data URLs this script always sent
            payload = {"images": urls, "encoding": args.encoding}
        if args.deepstack and args.endpoint == "encode":
            payload["return_deepstack"] = True
        bodies.append(Body(payload, urls, k, 0))
    if not clips:
        return bodies
    if args.video_every < 1:
        sys.exit("serve-load: --video-every must be >= 1")
    def clip_payload(c):
        if args.endpoint == "chat":  # alone in its request, as the proxy sends a clip
            return {"model": model, "messages": [{"role": "user", "content": [part("video_url", c, unique)]}], "stream": False}
        return {"videos": [part("video_url", c, True) if unique else c], "encoding": args.encoding}

    clip_bodies = [Body(clip_payload(c), [c], 0, 1) for c in clips]
    n = max(len(bodies), len(clips) * (args.video_every - 1))
    mixed = []  # a clip's body after every video_every - 1 image bodies, cycling through both
    for i in range(n + len(clips)):
        if i % args.video_every == args.video_every - 1 or args.video_every == 1:
            mixed.append(clip_bodies[(i // args.video_every) % len(clips)])
        else:
            mixed.append(bodies[i % len(bodies)])
    return mixed


def warm_up(server, args, bodies, headers, path, unique):
    """Sends --warmup requests, unmeasured; exits on the first that fails (a server without
    --ec-storage-path answers a chat request 400, saying so)."""
    for i in range(args.warmup):
        body = bodies[i % len(bodies)]
        keys = request_keys(body, "warmup", i, unique)
        status, reply = server.request("POST", path, body.fill(keys), headers)
        problem = check_chat_reply(reply, keys)[0] if status == 200 and args.endpoint == "chat" else None
        if status != 200 or problem:
            sys.exit(f"serve-load: warm-up request answered {status}: {problem or reply[:300].decode(errors='replace')}")


def print_level(r, args, clips):
    """The level's row of the table and the lines below it."""
    c = r["concurrency"]
    print(f"serve-load | {c:>11} | {r['requests']:>8} | {sum(r['errors'].values()):>6} | {r['images_per_s']:>8.1f} | "
          f"{r['tokens_per_s']:>8.0f} | {r['p50_ms']:>6.1f} | {r['p99_ms']:>6.1f} | {r['images_per_forward']:>14.2f} | {100 * r['forward_busy']:>11.0f}%",
          flush=True)
    if clips:
        print(f"serve-load |   clips/s {r['clips_per_s']:.2f} (one request in {args.video_every} sends a clip)", flush=True)
    if r["server_stage_mean_ms"]:
        print("serve-load |   server, mean ms per image: " +
              ", ".join(f"{k} {v:.1f}" for k, v in r["server_stage_mean_ms"].items()), flush=True)
    elif r["prompt_tokens_per_request"] is not None:  # a chat reply has no per-image times: what it has
        print(f"serve-load |   server, per image: not in chat replies; usage.prompt_tokens {r['prompt_tokens_per_request']:.0f} "
              "per request", flush=True)
    if r["server_phase_mean_ms"]:
        print("serve-load |   server, mean ms per request: " +
              ", ".join(f"{k} {v:.1f}" for k, v in r["server_phase_mean_ms"].items()), flush=True)
    if r["ec_cache"]:
        e = r["ec_cache"]
        print(f"serve-load |   encoder cache: {e['hits']:.0f} hits, {e['misses']:.0f} misses, {e['writes']:.0f} writes; "
              f"{e['bytes'] / 1e6:.1f} MB of fovea's files in the folder", flush=True)
    print(f"serve-load |   client ({r['client_processes']} processes), mean ms: " +
          ", ".join(f"{k} {v:.1f}" for k, v in r["client_mean_ms"].items()), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="encode",
                    help="encode: POST /v1/encode; chat: POST /v1/chat/completions, vLLM's encode instance "
                         "(the server needs --ec-storage-path)")
    ap.add_argument("--unique-keys", action=argparse.BooleanOptionalAction, default=None,
                    help="a uuid of its own for every image part, so that a server with an encoder cache encodes "
                         "every request (default: on with --endpoint chat; with encode, on when the server has an "
                         "encoder cache)")
    ap.add_argument("--images", help="folder of images to send (default: generated PNGs)")
    ap.add_argument("--generate", type=int, default=8, help="generated images (without --images)")
    ap.add_argument("--size", default="640x480", help="size of generated images, WxH")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=100, help="requests per concurrency level")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent first, not measured")
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--encoding", choices=("base64", "float"), default="base64")
    ap.add_argument("--deepstack", action="store_true",
                    help="POST /v1/encode asks for the deepstack outputs too (\"return_deepstack\": true): 4x the "
                         "bytes per image out of the GPU, as the encoder cache's files hold")
    ap.add_argument("--octet-stream", action="store_true",
                    help="ask for safetensors replies (BF16 tensors; F32 with --encoding float)")
    ap.add_argument("--timeout", type=float, default=600, help="client socket timeout, seconds")
    ap.add_argument("--processes", type=int, default=0,
                    help="client processes the threads of a level are spread over (0: one per 4 threads, at most "
                         "8): one Python process reading many megabyte replies is GIL-bound and would measure itself")
    ap.add_argument("--videos", help="folder of video clips; one is sent alone every --video-every-th request")
    ap.add_argument("--video-every", type=int, default=4, help="with --videos: one request in this many sends a clip")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.requests < 1 or args.images_per_request < 1 or args.processes < 0:
        sys.exit("serve-load: --concurrency, --requests and --images-per-request must be >= 1, --processes >= 0")
    if args.endpoint == "chat" and (args.octet_stream or args.encoding != "base64"):
        # The encode instance answers a small JSON chat.completion (no embeddings).
        sys.exit("serve-load: --endpoint chat takes no --octet-stream or --encoding")

    server = Server(args.url, args.timeout)
    status, models = server.request("GET", "/v1/models")
    if status != 200:
        sys.exit(f"serve-load: GET /v1/models answered {status}")
    model = json.loads(models)["data"][0]["id"]
    has_cache = "fovea_ec_cache_bytes" in server.metrics()
    unique = args.unique_keys if args.unique_keys is not None else (args.endpoint == "chat" or has_cache)
    path = ENDPOINTS[args.endpoint]
    images = load_images(args)
    k = args.images_per_request
    clips = load_clips(args.videos) if args.videos else []
    bodies = make_bodies(args, images, clips, model, unique)
    headers = {"Content-Type": "application/json"}
    if args.octet_stream:
        headers["Accept"] = "application/octet-stream"

    warm_up(server, args, bodies, headers, path, unique)

    _LEVEL.update(server=server, bodies=bodies, headers=headers, path=path, unique=unique)
    processes = args.processes or min(8, (max(levels) + 3) // 4)
    # Forked now, after the bodies are made: the client processes share them and wait for work.
    pool = multiprocessing.get_context("fork").Pool(processes) if processes > 1 else None

    if args.endpoint == "chat":
        replies = "chat.completion"
    else:
        replies = f"safetensors {'f32' if args.encoding == 'float' else 'bf16'}" if args.octet_stream else args.encoding
    keys = " | a uuid per image part" if unique else " | keys repeat: encoder-cache hits" if has_cache else ""
    print(f"serve-load | {args.url} | POST {path} | model {model} | {len(images)} images, {k} per request | {replies} replies"
          + keys + (f" | {len(clips)} clips, one request in {args.video_every}" if clips else ""))
    print("serve-load | concurrency | requests | errors | images/s | tokens/s | p50 ms | p99 ms | images/forward | forward busy")
    results = []
    for n, c in enumerate(levels):
        r = run_level(server, pool, args.processes or min(8, (c + 3) // 4), c, args.requests, f"L{n}")
        results.append(r)
        print_level(r, args, clips)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "endpoint": path, "unique_keys": unique, "model": model, "images": len(images),
                       "images_per_request": k, "clips": len(clips), "video_every": args.video_every if clips else 0,
                       "encoding": args.encoding if args.endpoint == "encode" else None,
                       "octet_stream": args.octet_stream, "results": results}, f, indent=2)
    if pool:
        pool.close()
        pool.join()
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
