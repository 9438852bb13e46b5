#!/usr/bin/env python3
"""`fovea serve` with and without encoder CUDA graphs, side by side in one run, on images of mixed sizes.

Python standard library only; on a GPU machine:

    python3 bench/serve-graphs.py                                  # build/fovea, synthetic:qwen3-vl-8b
    python3 bench/serve-graphs.py --fovea build/fovea --model /models/Qwen3-VL-8B --dtype fp8 \\
        --sizes 640x480,1280x720,1920x1080 --config '{"cudagraph_mm_encoder": true}'

For each server variant in turn (eager: no graphs; graphs: --compilation-config CONFIG), the script
starts `FOVEA serve MODEL --port 0`, then measures:
  ready     seconds from the start to the first 200 of /health (the graphs' capture included);
  captures  graphs the server says it captured (its start-up line);
  GPU MiB   the server's GPU memory once ready (nvidia-smi; "-" where it cannot say);
  first     ms of the first request of each size, one at a time: the latency the first user of a
            new batch shape sees (an eager server plans that shape then; a graph server replays);
  second    ms of a second request of each size, one at a time, after the first of every size;
  forward   the mean of the server's own forward time (its replies' timings_ms.forward: GPU events from
            the upload to the copy back) in the first and the second pass;
  load      --requests requests at --concurrency clients, cycling through the sizes (one image each):
            images/s, p50 and p99 ms;
  replays / eager   from /metrics: forwards replayed through a graph, and run eagerly beside them;
  vs eager  the largest relative L2 distance between the two servers' embeddings of each size's first
            request (with numpy; "-" without).
One line per variant, and --json FILE with the same numbers. Each server is stopped with SIGTERM.
"""
import argparse
import base64
import concurrent.futures
import http.client
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("serve_load", os.path.join(HERE, "serve-load.py"))
serve_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_load)

DEFAULT_SIZES = "640x480,1280x720,1024x1024,1920x1080,800x1200,512x384"
DEFAULT_CONFIG = '{"cudagraph_mm_encoder": true}'


def start(args, extra, log):
    """The server process and its base URL, once it prints where it listens (or None if it died)."""
    cmd = [args.fovea, "serve", args.model, "--port", "0", "--mm-encoder-attn-dtype", args.dtype] + extra
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = t0 + args.start_timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            return proc, None, t0
        log.flush()
        with open(log.name, encoding="utf-8", errors="replace") as f:
            m = re.search(r"listening on (http://\S+)", f.read())
        if m:
            return proc, m.group(1), t0
        time.sleep(0.1)
    proc.kill()
    return proc, None, t0


def wait_healthy(server, t0, timeout):
    while time.perf_counter() - t0 < timeout:
        try:
            if server.request("GET", "/health")[0] == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.05)
    return None


def gpu_memory_mib(pid):
    """GPU memory the process holds (nvidia-smi), or None where nvidia-smi cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1])
    return None


def post(server, body, keep=None):
    """(status, ms) of one POST /v1/encode; the reply's body appended to `keep` if given."""
    status, reply, head_ms, body_ms = serve_load.request_timed(server, "/v1/encode", body,
                                                                 {"Content-Type": "application/json"})
    if keep is not None:
        keep.append(reply)
    return status, head_ms + body_ms


def mean_forward(replies):
    values = [t["forward"] for r in replies for t in serve_load.per_image_timings(r)]
    return round(sum(values) / len(values), 1) if values else None


def embeddings(reply):
    """The reply's visual tokens as float32 (numpy), or None without numpy."""
    try:
        import numpy as np
    except ImportError:
        return None
    bits = np.frombuffer(base64.b64decode(json.loads(reply)["data"][0]["embeddings"]), dtype="<u2")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def max_rel_l2(a, b):
    """The largest relative L2 distance between two variants' replies, size by size (None without numpy)."""
    worst = 0.0
    for x, y in zip(a, b):
        ex, ey = embeddings(x), embeddings(y)
        if ex is None:
            return None
        if ex.shape != ey.shape:
            return float("inf")
        worst = max(worst, float(((ex - ey).astype("float64") ** 2).sum() ** 0.5 / ((ey.astype("float64") ** 2).sum() ** 0.5)))
    return worst


def run_variant(args, name, extra, bodies):
    with tempfile.NamedTemporaryFile("w+", prefix=f"serve-graphs-{name}-", suffix=".log", delete=False) as log:
        proc, url, t0 = start(args, extra, log)
        try:
            if not url:
                log.flush()
                sys.exit(f"serve-graphs: {name}: the server did not start; its log:\n" + open(log.name).read()[-4000:])
            server = serve_load.Server(url, args.timeout)
            ready = wait_healthy(server, t0, args.start_timeout)
            if ready is None:
                sys.exit(f"serve-graphs: {name}: /health never answered 200 (log {log.name})")
            with open(log.name, encoding="utf-8", errors="replace") as f:
                text = f.read()
            captures = sum(int(n) for n in re.findall(r"(\d+) encoder CUDA graphs captured", text))
            gpu_mib = gpu_memory_mib(proc.pid)
            first, again, replies, seconds = [], [], [], []
            for times, what in ((first, "first"), (again, "second")):
                for size, body in bodies:
                    status, ms = post(server, body, replies if what == "first" else seconds)
                    if status != 200:
                        sys.exit(f"serve-graphs: {name}: the {what} {size} request answered {status}")
                    times.append(ms)
            before = server.metrics()
            order = [bodies[i % len(bodies)][1] for i in range(args.requests)]
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda b: post(server, b), order))
            wall = time.perf_counter() - t
            after = server.metrics()
            ok = sorted(ms for status, ms in results if status == 200)
            delta = lambda k: after.get(k, 0) - before.get(k, 0)
            return replies, {
                "variant": name, "flags": extra, "ready_s": round(ready, 2), "captures": captures, "gpu_mib": gpu_mib,
                "first_ms": {size: round(ms, 1) for (size, _), ms in zip(bodies, first)},
                "first_mean_ms": round(sum(first) / len(first), 1),
                "second_ms": {size: round(ms, 1) for (size, _), ms in zip(bodies, again)},
                "second_mean_ms": round(sum(again) / len(again), 1),
                # The server's own "forward" (GPU events from the pixels' upload to the outputs' copy
                # back, host stalls between launches included), mean over the sizes.
                "first_forward_ms": mean_forward(replies), "second_forward_ms": mean_forward(seconds),
                "errors": len(results) - len(ok), "images_per_s": round(len(ok) / wall, 2),
                "p50_ms": round(serve_load.percentile(ok, 50), 1), "p99_ms": round(serve_load.percentile(ok, 99), 1),
                "replays": int(delta("fovea_encoder_graph_replays_total")),
                "eager": int(delta("fovea_encoder_graph_eager_total")),
                "forwards": int(delta("fovea_encoder_forwards_total")),
            }
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            os.unlink(log.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fovea", default="build/fovea", help="the fovea binary")
    ap.add_argument("--model", default="synthetic:qwen3-vl-8b")
    ap.add_argument("--dtype", default="bf16", help="--mm-encoder-attn-dtype for both servers")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated WxH of the generated PNGs")
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="--compilation-config of the graph server")
    ap.add_argument("--serve-args", default="", help="more flags for both servers (one string, split on spaces)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds a server may take to come up")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if not os.path.exists(args.fovea):
        sys.exit(f"serve-graphs: no fovea binary at {args.fovea} (--fovea)")
    if args.requests < 1 or args.concurrency < 1:
        sys.exit("serve-graphs: --requests and --concurrency must be >= 1")
    bodies = []
    for i, size in enumerate(s.strip() for s in args.sizes.split(",") if s.strip()):
        m = re.fullmatch(r"(\d+)x(\d+)", size)
        if not m:
            sys.exit(f"serve-graphs: --sizes: {size!r} is not WxH")
        png = serve_load.png_bytes(int(m.group(1)), int(m.group(2)), i)
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        bodies.append((size, json.dumps({"images": [url]}).encode()))
    if not bodies:
        sys.exit("serve-graphs: --sizes is empty")
    extra = args.serve_args.split()
    eager_replies, eager = run_variant(args, "eager", extra, bodies)
    graph_replies, graphs = run_variant(args, "graphs", extra + ["--compilation-config", args.config], bodies)
    rows = [eager, graphs]
    # The same image alone in a forward, eagerly and through a graph (padded to its budget): the
    # embeddings differ only by the GEMMs' algorithm choice for a different row count, if at all.
    graphs["vs_eager_rel_l2"] = max_rel_l2(graph_replies, eager_replies)
    print("variant | ready s | captures | GPU MiB | first-request ms (mean; per size) | second ms (mean) | forward ms first / second | images/s | p50 ms | p99 ms | replays | eager | errors")
    for r in rows:
        per = ", ".join(f"{k} {v:.0f}" for k, v in r["first_ms"].items())
        mib = "-" if r["gpu_mib"] is None else str(r["gpu_mib"])
        print(f"{r['variant']:<7} | {r['ready_s']:>7.2f} | {r['captures']:>8} | {mib:>7} | {r['first_mean_ms']:.1f} ({per}) | {r['second_mean_ms']:.1f} | "
              f"{r['first_forward_ms']} / {r['second_forward_ms']} | "
              f"{r['images_per_s']:>8.2f} | {r['p50_ms']:>6.1f} | {r['p99_ms']:>6.1f} | {r['replays']:>7} | {r['eager']:>5} | {r['errors']}")
    d = graphs["vs_eager_rel_l2"]
    print("graphs vs eager, each size's first reply: max relative L2 " + ("- (no numpy)" if d is None else f"{d:.3e}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "sizes": args.sizes, "config": args.config,
                       "requests": args.requests, "concurrency": args.concurrency, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
