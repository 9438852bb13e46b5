#!/usr/bin/env python3
"""Two `fovea serve` processes behind HAProxy (issue 17; docs/deploy.md): standard parts, loopback only.

    python3 tests/deploy/haproxy-test.py --fovea build/fovea [--haproxy /usr/sbin/haproxy] [--balance leastconn]

Starts backends A and B (`fovea serve synthetic:tiny --device cpu --drain-seconds 2`) and HAProxy
with the configuration docs/deploy.md gives (health checks on GET /ready, L7 retries with
redispatch), then shows, each through HAProxy with concurrent clients:
  1. spread: requests are answered by both backends (their /metrics counters both grow);
  2. drain: SIGTERM on A in the middle of a load: A's /ready turns 503 at once, HAProxy stops
     sending to it, A finishes what it holds and exits 0; no request fails;
  3. kill: A again (restarted on its port), then SIGKILL on B in the middle of a load: every request
     is answered 200, those B held or was sent retried on A by HAProxy (POST /v1/encode is
     idempotent: the same inputs give the same outputs, and with a uuid the same cache file).
Every reply is checked: 200, one item, the grid of the image sent. Exit code 1 on any failure.
Python standard library only.
"""
import argparse
import base64
import http.client
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib


def png(width, height, seed):
    rng = random.Random(seed)
    rows = b"".join(b"\0" + bytes(rng.randrange(256) for _ in range(width * 3)) for _ in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def metric(port, name):
    _, text = request(port, "GET", "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


class Backend:
    def __init__(self, fovea, port, log):
        self.port, self.log = port, log
        self.proc = subprocess.Popen([fovea, "serve", "synthetic:tiny", "--device", "cpu", "--port", str(port),
                                      "--max-pixels", "65536", "--drain-seconds", "2"],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for _ in range(600):
            if self.proc.poll() is not None:
                sys.exit(f"haproxy-test: backend on {port} exited at startup:\n" + open(log).read())
            if "listening on" in open(log).read():
                return
            time.sleep(0.05)
        sys.exit(f"haproxy-test: backend on {port} did not start")


CONFIG = """global
    maxconn 256
    # A request must fit in one buffer to be retried at layer 7: the test's bodies are ~20 KB.
    tune.bufsize 262144
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response junk-response response-timeout 503
    # Wait for the whole body before choosing a server: the request is then in the buffer, whole,
    # for a retry on another server.
    option http-buffer-request
frontend encode
    bind 127.0.0.1:{front}
    default_backend fovea
backend fovea
    balance {balance}
    option httpchk GET /ready
    http-check expect status 200
    default-server inter 100ms fall 1 rise 2
    server a 127.0.0.1:{a} check
    server b 127.0.0.1:{b} check
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fovea", default="build/fovea")
    ap.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy")
    ap.add_argument("--balance", default="roundrobin", choices=("roundrobin", "leastconn"))
    a = ap.parse_args()
    if not os.access(a.haproxy, os.X_OK):
        print(f"haproxy-test: FAIL: no haproxy at {a.haproxy} (Debian's haproxy; scripts/setup.sh installs it)")
        return 1
    tmp = tempfile.mkdtemp(prefix="fovea-haproxy.")
    pa, pb, front = free_port(), free_port(), free_port()
    images = [png(64 + 16 * (i % 4), 48 + 16 * (i % 3), i) for i in range(8)]
    bodies = [json.dumps({"images": ["data:image/png;base64," + base64.b64encode(p).decode()]}).encode() for p in images]
    failures = []
    procs = []

    def check(cond, what):
        print(f"haproxy-test | {what} | {'ok' if cond else 'FAIL'}", flush=True)
        if not cond:
            failures.append(what)

    def load(n, concurrency, during=None):
        """n requests through HAProxy from `concurrency` threads; calls during() once n/3 are answered.
        Returns the statuses that were not a good 200."""
        bad, done, lock = [], [0], threading.Lock()
        todo = list(range(n))

        def client():
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                try:
                    status, body = request(front, "POST", "/v1/encode", bodies[i % len(bodies)])
                    good = status == 200 and len(json.loads(body)["data"]) == 1
                except (OSError, http.client.HTTPException, ValueError) as e:
                    status, body, good = type(e).__name__, b"", False
                with lock:
                    if not good:
                        bad.append(f"{status} {body[:200]!r}")
                    done[0] += 1

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        if during:
            while done[0] < n // 3 and any(t.is_alive() for t in threads):
                time.sleep(0.005)
            during()
        for t in threads:
            t.join()
        return bad

    try:
        A = Backend(a.fovea, pa, os.path.join(tmp, "a.log"))
        B = Backend(a.fovea, pb, os.path.join(tmp, "b.log"))
        procs += [A.proc, B.proc]
        cfg = os.path.join(tmp, "haproxy.cfg")
        open(cfg, "w").write(CONFIG.format(front=front, a=pa, b=pb, balance=a.balance))
        hap = subprocess.Popen([a.haproxy, "-db", "-f", cfg], stdout=open(os.path.join(tmp, "haproxy.log"), "w"),
                               stderr=subprocess.STDOUT)
        procs.append(hap)
        for _ in range(200):
            try:
                if request(front, "POST", "/v1/encode", bodies[0])[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        time.sleep(0.5)  # both servers seen up (rise 2 x 100 ms)

        # 1. spread
        before = (metric(pa, "fovea_inputs_encoded_total"), metric(pb, "fovea_inputs_encoded_total"))
        bad = load(40, 4)
        got = (metric(pa, "fovea_inputs_encoded_total") - before[0], metric(pb, "fovea_inputs_encoded_total") - before[1])
        check(not bad, f"spread: 40 requests, {len(bad)} failed {bad[:2]}")
        check(got[0] > 0 and got[1] > 0 and got[0] + got[1] == 40, f"spread: A encoded {got[0]:.0f}, B {got[1]:.0f}")

        # 2. drain A with SIGTERM mid-load
        ready_503 = []

        def sigterm_a():
            A.proc.send_signal(signal.SIGTERM)
            t = time.monotonic()
            while time.monotonic() - t < 1 and request(pa, "GET", "/ready")[0] != 503:
                time.sleep(0.002)
            ready_503.append(request(pa, "GET", "/ready")[0])

        bad = load(60, 6, sigterm_a)
        check(ready_503 == [503], f"drain: A's /ready within 1 s of SIGTERM: {ready_503}")
        check(not bad, f"drain: 60 requests while A drained, {len(bad)} failed {bad[:2]}")
        try:
            rc = A.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = "still running"
        check(rc == 0, f"drain: A exited with {rc}")
        check("serving on for" in open(A.log).read(), "drain: A logged its drain")

        # 3. kill B mid-load, with A back on its port
        A = Backend(a.fovea, pa, os.path.join(tmp, "a2.log"))
        procs.append(A.proc)
        time.sleep(0.5)  # HAProxy sees A up again (rise 2 x 100 ms)
        a_before = metric(pa, "fovea_inputs_encoded_total")
        bad = load(60, 6, lambda: B.proc.send_signal(signal.SIGKILL))
        check(not bad, f"kill: 60 requests, B killed mid-load, {len(bad)} failed {bad[:2]}")
        check(metric(pa, "fovea_inputs_encoded_total") - a_before > 0, "kill: A served after B died")
        check(B.proc.wait(timeout=10) == -signal.SIGKILL, "kill: B was killed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failures:
        print(f"haproxy-test: {len(failures)} check(s) failed; logs in {tmp}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print("haproxy-test: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
