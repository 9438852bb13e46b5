#!/usr/bin/env python3
"""The peer of `fovea serve`: the same POST /v1/encode, written as a user would with Hugging Face transformers.

A plain Python service: the standard library's ThreadingHTTPServer (one thread per connection) decodes
the images with PIL and runs transformers' Qwen3-VL image processor in the handler threads; one
batching thread takes every image queued (up to --max-batch-tokens visual tokens; an image is never
split, one larger than the limit runs alone), concatenates pixel_values and grid_thw, runs one forward
of transformers' Qwen3VLVisionModel (bf16, attn_implementation "sdpa", eval, torch.inference_mode),
and hands each image its rows of the merged embeddings. The model is the Qwen3-VL-8B vision tower
(27 blocks, hidden 1152, 16 heads, intermediate 4304, out 4096, deepstack taps 8/16/24) with RANDOM
weights (transformers' init), like fovea's synthetic:qwen3-vl-8b: timings do not depend on the values.

It answers what bench/serve-load.py uses, so the same client drives both side by side:

    POST /v1/encode  {"images": [data URL | base64 | {"type": "image_url", "image_url": {"url": ...}}],
                      "encoding": "base64" (default) | "float", "return_deepstack": false, "model": ...}
                     -> fovea's reply layout: {"object": "list", "model", "encoding", "dtype", "data": [{"index",
                        "grid_thw", "num_tokens", "hidden_size", "embeddings" (bf16 little-endian bytes in
                        base64, [num_tokens, hidden_size] row-major), "timings_ms": {"decode", "preprocess",
                        "queue", "forward"}, "batch": {"images", "tokens"}}], "timings_ms": {"total"}}
    GET  /health, /ready, /v1/models
    GET  /metrics    Prometheus text under fovea's metric names (fovea_inputs_encoded_total and its old
                     name fovea_images_encoded_total,
                     fovea_tokens_encoded_total, fovea_encoder_forwards_total,
                     fovea_encoder_forward_seconds_total: this peer's own forwards, timed from the pixels'
                     upload to the outputs back on the host), so serve-load's images/forward and forward
                     busy mean the same for both.

--max-pixels / --min-pixels are fovea's resize budget: the processor's size {"shortest_edge": min,
"longest_edge": max} (docs/encoder.md §Preprocessing config; fovea's --max-pixels wins over the checkpoint's
longest_edge the same way). On the GPU machine:

    python3 bench/hf-serve-peer.py --port 8001 --max-pixels 2073600 &       # prints "... listening on http://..."
    python3 bench/serve-load.py --url http://127.0.0.1:8001 --images data/photos --concurrency 1,4,16

SIGTERM / SIGINT: stops accepting, finishes the requests in flight, exits 0.
"""
import argparse
import base64
import binascii
import collections
import io
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from PIL import Image, UnidentifiedImageError

# transformers' Qwen3VLVisionConfig fields for Qwen3-VL-8B (fovea's synthetic:qwen3-vl-8b, src/model/qwen3vl/config.cpp).
VISION_8B = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 4096,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
}


def build_model(args):
    """The vision tower with random weights, bf16 on args.device, sdpa attention, eval mode."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    fields = dict(VISION_8B, **json.loads(args.config_overrides or "{}"))
    config = Qwen3VLVisionConfig(**fields)
    config._attn_implementation = "sdpa"  # (transformers' default where torch has SDPA; set, not assumed)
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(config).to(args.device, torch.bfloat16).eval()
    return model


def build_processor(args):
    """transformers' Qwen2-VL image processor as Qwen3-VL's preprocessor_config.json sets it up."""
    import transformers

    cls = getattr(transformers, "Qwen2VLImageProcessorFast", None) or transformers.Qwen2VLImageProcessor
    return cls(size={"shortest_edge": args.min_pixels, "longest_edge": args.max_pixels}, patch_size=16,
               temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def vision_outputs(out):
    """(merged, [deepstack...]) from the vision model's return value: a BaseModelOutputWithDeepstackFeatures
    (pooler_output = the merger's output) in newer transformers, a (merged, deepstack list) tuple in older ones."""
    merged = getattr(out, "pooler_output", None)
    if merged is not None:
        return merged, list(getattr(out, "deepstack_features", None) or [])
    return out[0], list(out[1]) if len(out) > 1 else []


class ApiError(Exception):
    def __init__(self, status, code, message):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # (path, code) -> count
        self.in_flight = 0
        self.images = self.tokens = self.forwards = self.failed_forwards = 0
        self.forward_seconds = 0.0

    def text(self, queue_depth, model_name, device):
        with self.lock:
            lines = [f'fovea_requests_total{{path="{p}",code="{c}"}} {n}' for (p, c), n in sorted(self.requests.items())]
            lines += [f"fovea_requests_in_flight {self.in_flight}", f"fovea_queue_depth {queue_depth}",
                      f"fovea_inputs_encoded_total {self.images}", f"fovea_images_encoded_total {self.images}",
                      f"fovea_tokens_encoded_total {self.tokens}",
                      f"fovea_encoder_forwards_total {self.forwards}",
                      f"fovea_encoder_failed_forwards_total {self.failed_forwards}",
                      f"fovea_encoder_forward_seconds_total {self.forward_seconds:.6f}",
                      f'fovea_engine_info{{model="{model_name}",device="{device}",backend="transformers-sdpa",dtype="bf16"}} 1']
        return "\n".join(lines) + "\n"


class QueuedImage:
    """One image of one request, from the handler thread to the batching thread and back."""

    def __init__(self, pixels, grid, deepstack):
        self.pixels, self.grid, self.want_deepstack = pixels, grid, deepstack  # [patches, 1536] fp32, [1, 3]
        t, h, w = (int(v) for v in grid[0])
        self.tokens = t * h * w // 4
        self.done = threading.Event()
        self.merged, self.deepstack, self.error = None, [], None
        self.submitted = time.perf_counter()
        self.queue_ms = self.forward_ms = 0.0
        self.batch_images = self.batch_tokens = 0


class Batcher:
    """One thread owns the model: it packs queued images (first come, first served) into one forward."""

    def __init__(self, model, device, max_batch_tokens, metrics):
        self.model, self.device, self.max_batch_tokens, self.metrics = model, device, max_batch_tokens, metrics
        self.queue = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, images):
        with self.cond:
            self.queue.extend(images)
            self.cond.notify()

    def depth(self):
        with self.cond:
            return len(self.queue)

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()

    def take(self):
        with self.cond:
            while not self.queue and not self.stopping:
                self.cond.wait()
            if not self.queue:
                return None
            batch = [self.queue.popleft()]
            tokens = batch[0].tokens
            while self.queue and tokens + self.queue[0].tokens <= self.max_batch_tokens:
                tokens += self.queue[0].tokens
                batch.append(self.queue.popleft())
            return batch

    def run(self):
        while True:
            batch = self.take()
            if batch is None:
                return
            start = time.perf_counter()
            for im in batch:
                im.queue_ms = (start - im.submitted) * 1000
            try:
                with torch.inference_mode():
                    pixels = torch.cat([im.pixels for im in batch]) if len(batch) > 1 else batch[0].pixels
                    pixels = pixels.to(self.device, torch.bfloat16)
                    grid = torch.cat([im.grid for im in batch]).to(self.device)
                    merged, deepstack = vision_outputs(self.model(pixels, grid_thw=grid))
                    rows = [im.tokens for im in batch]
                    merged = merged.to("cpu").split(rows)
                    if any(im.want_deepstack for im in batch):
                        deepstack = [d.to("cpu").split(rows) for d in deepstack]
                    else:
                        deepstack = []
            except Exception as e:  # noqa: BLE001 - a failed forward fails its requests, not the server
                with self.metrics.lock:
                    self.metrics.failed_forwards += 1
                for im in batch:
                    im.error = f"forward failed: {type(e).__name__}: {e}"
                    im.done.set()
                if self.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                continue
            seconds = time.perf_counter() - start
            tokens = sum(rows)
            with self.metrics.lock:
                self.metrics.forwards += 1
                self.metrics.images += len(batch)
                self.metrics.tokens += tokens
                self.metrics.forward_seconds += seconds
            for j, im in enumerate(batch):
                im.merged = merged[j]
                im.deepstack = [d[j] for d in deepstack] if im.want_deepstack else []
                im.forward_ms, im.batch_images, im.batch_tokens = seconds * 1000, len(batch), tokens
                im.done.set()


def image_bytes(entry, where):
    """The encoded image bytes of one "images" entry: a data URL, plain base64, or an image_url content part."""
    if isinstance(entry, dict):
        url = entry.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if entry.get("type", "image_url") != "image_url" or not isinstance(url, str):
            raise ApiError(400, "invalid_request", f'{where}: expected {{"type": "image_url", "image_url": {{"url": ...}}}}')
        entry = url
    if not isinstance(entry, str):
        raise ApiError(400, "invalid_request", f"{where}: expected a string or an image_url object")
    if entry.startswith(("http://", "https://")):
        raise ApiError(400, "invalid_image", f"{where}: remote URLs are not fetched")
    if entry.startswith("data:"):
        head, comma, data = entry.partition(",")
        if not comma or not head.endswith(";base64"):
            raise ApiError(400, "invalid_image", f"{where}: a data URL must be data:<mime>;base64,<data>")
        entry = data
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, "invalid_image", f"{where}: invalid base64: {e}") from None


class Service:
    def __init__(self, args, model, processor):
        self.args, self.processor, self.metrics = args, processor, Metrics()
        self.batcher = Batcher(model, args.device, args.max_batch_tokens, self.metrics)
        self.started = int(time.time())

    def encode(self, body):
        t_start = time.perf_counter()
        try:
            req = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "invalid_json", f"body is not JSON: {e}") from None
        if not isinstance(req, dict):
            raise ApiError(400, "invalid_json", "body must be a JSON object")
        if req.get("model") not in (None, self.args.served_model_name):
            raise ApiError(404, "model_not_found", f"model {str(req['model'])[:64]!r} is not served here")
        images = req.get("images")
        if not isinstance(images, list) or not images:
            raise ApiError(400, "invalid_request", '"images" must be a non-empty list')
        encoding = req.get("encoding", "base64")
        if encoding not in ("base64", "float"):
            raise ApiError(400, "invalid_request", '"encoding" must be "base64" or "float"')
        want_deepstack = bool(req.get("return_deepstack", False))

        work, stages = [], []
        for i, entry in enumerate(images):
            where = f"images[{i}]"
            t0 = time.perf_counter()
            raw = image_bytes(entry, where)
            try:
                img = Image.open(io.BytesIO(raw)).convert("RGB")
            except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
                raise ApiError(400, "invalid_image", f"{where}: {e}") from None
            t1 = time.perf_counter()
            out = self.processor(images=[img], return_tensors="pt")
            t2 = time.perf_counter()
            work.append(QueuedImage(out["pixel_values"], out["image_grid_thw"], want_deepstack))
            stages.append(((t1 - t0) * 1000, (t2 - t1) * 1000))
        self.batcher.submit(work)
        for im in work:
            im.done.wait()
        errors = [im.error for im in work if im.error]
        if errors:
            raise ApiError(500, "encoder_error", errors[0])

        data = []
        for i, (im, (decode_ms, pre_ms)) in enumerate(zip(work, stages)):
            item = {"index": i, "grid_thw": [int(v) for v in im.grid[0]], "num_tokens": im.tokens,
                    "hidden_size": int(im.merged.shape[1])}
            item["embeddings"] = self.rows(im.merged, encoding)
            if want_deepstack:
                item["deepstack"] = [self.rows(d, encoding) for d in im.deepstack]
            item["timings_ms"] = {"decode": round(decode_ms, 3), "preprocess": round(pre_ms, 3),
                                  "queue": round(im.queue_ms, 3), "forward": round(im.forward_ms, 3)}
            item["batch"] = {"images": im.batch_images, "tokens": im.batch_tokens}
            data.append(item)
        reply = {"object": "list", "model": self.args.served_model_name, "encoding": encoding,
                 "dtype": "bf16" if encoding == "base64" else "float32", "data": data,
                 "timings_ms": {"total": round((time.perf_counter() - t_start) * 1000, 3)}}
        # Compact separators: the layout fovea writes (serve-load.py finds "timings_ms":{"decode":...} in it).
        return json.dumps(reply, separators=(",", ":")).encode()

    @staticmethod
    def rows(t, encoding):
        """bf16 rows as base64 of their little-endian bytes, or as floats (the bf16 values widened)."""
        if encoding == "float":
            return t.float().tolist()
        return base64.b64encode(t.contiguous().view(torch.int16).numpy().tobytes()).decode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hf-serve-peer"
    timeout = 60  # idle keep-alive connections and stalled bodies end after this (seconds)
    service = None  # set in main()

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def reply(self, status, body, content_type="application/json", path=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)
        if path:
            with self.service.metrics.lock:
                self.service.metrics.requests[(path, status)] += 1

    def error(self, status, code, message, path=None):
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                                     "code": code}}).encode()
        self.reply(status, body, path=path)

    def do_GET(self):
        s = self.service
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self.reply(200, b'{"status":"ok"}')
        elif path == "/ready":
            self.reply(200, b'{"status":"ready"}')
        elif path == "/v1/models":
            model = {"id": s.args.served_model_name, "object": "model", "created": s.started, "owned_by": "transformers"}
            self.reply(200, json.dumps({"object": "list", "data": [model]}).encode())
        elif path == "/metrics":
            self.reply(200, s.metrics.text(s.batcher.depth(), s.args.served_model_name, s.args.device).encode(),
                       "text/plain; version=0.0.4")
        elif path == "/v1/encode":
            self.error(405, "method_not_allowed", "use POST for /v1/encode")
        else:
            self.error(404, "not_found", f"no such endpoint: {path[:64]}")

    def do_POST(self):
        s = self.service
        path = self.path.split("?", 1)[0]
        if path != "/v1/encode":
            if path in ("/health", "/ready", "/v1/models", "/metrics"):
                self.error(405, "method_not_allowed", f"use GET for {path}")
            else:
                self.error(404, "not_found", f"no such endpoint: {path[:64]}")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.error(411, "length_required", "POST /v1/encode needs a Content-Length", path)
            return
        if int(length) > s.args.max_body_bytes:
            self.error(413, "body_too_large", f"body of {length} bytes is over --max-body-bytes {s.args.max_body_bytes}", path)
            return
        with s.metrics.lock:
            s.metrics.in_flight += 1
        try:
            body = self.rfile.read(int(length))
            out = s.encode(body)
            self.reply(200, out, path=path)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: nobody to answer
            self.close_connection = True
        except ApiError as e:
            self.error(e.status, e.code, e.message, path)
        except Exception as e:  # noqa: BLE001 - one request's failure must not take the server down
            self.error(500, "internal_error", f"{type(e).__name__}: {e}", path)
        finally:
            with s.metrics.lock:
                s.metrics.in_flight -= 1


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # listen backlog (socketserver's default is 5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free one (printed)")
    ap.add_argument("--max-pixels", type=int, default=16777216, help="resize budget: at most this many pixels (fovea's flag)")
    ap.add_argument("--min-pixels", type=int, default=65536, help="resize budget: at least this many pixels")
    ap.add_argument("--max-batch-tokens", type=int, default=16384,
                    help="visual tokens per forward (fovea serve's default); an image is never split")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-body-bytes", type=int, default=64 << 20)
    ap.add_argument("--served-model-name", default="hf:qwen3-vl-8b-vision-random")
    ap.add_argument("--config-overrides", default="",
                    help='JSON merged into the 8B vision config, e.g. \'{"depth": 2}\' for a quick check')
    args = ap.parse_args()
    if args.max_batch_tokens < 1 or not 1 <= args.min_pixels <= args.max_pixels:
        sys.exit("hf-serve-peer: --max-batch-tokens must be >= 1 and 1 <= --min-pixels <= --max-pixels")

    import transformers

    t0 = time.perf_counter()
    model = build_model(args)
    processor = build_processor(args)
    # One small forward first: CUDA context, cuBLAS and the attention kernels initialized before the first request.
    with torch.inference_mode():
        grid = torch.tensor([[1, 32, 32]], device=args.device)
        vision_outputs(model(torch.zeros(1024, 1536, device=args.device, dtype=torch.bfloat16), grid_thw=grid))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    cfg = model.config
    about = (f"transformers {transformers.__version__}, torch {torch.__version__}, {type(model).__name__} "
             f"({cfg.depth} blocks, hidden {cfg.hidden_size}, heads {cfg.num_heads}, out {cfg.out_hidden_size}, "
             f"deepstack {list(cfg.deepstack_visual_indexes)}, {sum(p.numel() for p in model.parameters())} parameters, "
             f"attention {getattr(cfg, '_attn_implementation', '?')}, bf16 on {args.device}), {type(processor).__name__} "
             f"(pixels {args.min_pixels}..{args.max_pixels}), at most {args.max_batch_tokens} tokens per forward; "
             f"ready in {time.perf_counter() - t0:.1f} s")

    Handler.service = Service(args, model, processor)
    httpd = Server((args.host, args.port), Handler)
    stop = threading.Event()

    def on_signal(signum, frame):
        if not stop.is_set():
            stop.set()
            threading.Thread(target=httpd.shutdown, daemon=True).start()  # shutdown() must not run on serve_forever's thread

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host, port = httpd.server_address[:2]
    print(f"hf-serve-peer: listening on http://{host}:{port} | {about}", flush=True)  # the one "ready" line
    httpd.serve_forever()
    # Stopped accepting: let the requests in flight finish (bounded), then the batching thread.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with Handler.service.metrics.lock:
            if Handler.service.metrics.in_flight == 0:
                break
        time.sleep(0.05)
    httpd.server_close()
    Handler.service.batcher.stop()
    print("hf-serve-peer: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
