#!/usr/bin/env python3
"""The hostile-client suite of `fovea serve` (issue 10, point 6): Python standard library only,
loopback only, bounded in connections (at most ~520 at once) and in time (every case has a bound;
the whole suite takes about 25 s against a conforming server, under 3 minutes otherwise).

    python3 tests/hostile/hostile-client.py --fovea build/fovea
    python3 tests/hostile/hostile-client.py --fovea build/fovea --only sigterm,pipelined --json out.json
    python3 tests/hostile/hostile-client.py --legacy      # a server without the new HTTP flags

It starts `fovea serve synthetic:tiny --device cpu --port 0` (four instances: the main one, one with
short deadlines, two for shutdown), reads the "listening on http://HOST:PORT" line, runs every case
and prints `case | expected | observed | ok`. The main instance also serves POST /v1/chat/completions
(vLLM's encode instance): it runs with --ec-storage-path ROOT/cache in the working folder ROOT/cwd,
ROOT a temporary folder the suite creates and removes, so that the chat cases can check what was
written where (a uuid such as "../x" must create nothing, in the cache or beside it); its load-case
encodes carry unique uuids, so that they are encoded, not cache hits. The exit code is 1 if any case
fails: the server died (crash), a case ran past its time bound (hang), a request got no reply (lost
reply), a reply had the wrong status, or the main server's peak RSS (VmHWM in /proc/PID/status, read
at the end) exceeded

    bound = RSS after startup + 2 x --max-body-bytes + --max-decode-bytes + 256 MiB

(a body and one decoded copy of it, the decoded pixels the server admits in flight, and a fixed
allowance for threads, allocator slack and the tiny encoder's activations). 2 is for a problem of
the harness itself (the server did not start, e.g. it rejected one of the flags below).

The server flags (--server-args replaces the limits; the per-instance flags are added to them):
--max-body-bytes, --max-decode-bytes, --max-header-bytes, --max-connections, --max-queue,
--header-timeout, --body-timeout, --keep-alive-timeout (seconds), --min-pixels/--max-pixels.
--legacy leaves out those the pre-issue-10 server does not have.
"""
import argparse
import base64
import hashlib
import itertools
import json
import os
import random
import re
import resource
import shlex
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

HOST = "127.0.0.1"
MiB = 1 << 20

# The limits the suite runs the server with (its spec). The RSS bound is computed from them.
DEFAULT_SERVER_ARGS = ("--max-body-bytes 67108864 --max-decode-bytes 134217728 --max-header-bytes 16384 "
                       "--max-connections 1024 --max-queue 256 --header-timeout 30 --body-timeout 30 "
                       "--keep-alive-timeout 30 --min-pixels 1024 --max-pixels 65536")
NEW_FLAGS = {"--max-decode-bytes", "--max-header-bytes", "--max-connections", "--header-timeout",
             "--body-timeout", "--keep-alive-timeout", "--ec-storage-path"}  # the last: issue 29's chat endpoint
# Per instance, on top of the limits: short deadlines for the deadline cases (the main instance keeps
# its slow clients open for the whole load case), few threads and small forwards for shutdown.
INSTANCE_ARGS = {
    "main": "",
    "deadlines": "--header-timeout 1 --body-timeout 1 --keep-alive-timeout 1",
    "sigterm": "--threads 4 --max-batch-tokens 64",
    "second-signal": "--threads 4 --max-batch-tokens 64",
}


# ---- images -----------------------------------------------------------------------------------------

def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width, height, idat_zlib):
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat_zlib) +
            png_chunk(b"IEND", b""))


def noise_png(width, height, seed):
    rng = random.Random(seed)
    rows = bytearray()
    for y in range(height):
        rows.append(0)
        rows.extend((x * 3 + y + c * 80 + rng.randrange(48)) % 256 for x in range(width) for c in range(3))
    return png(width, height, zlib.compress(bytes(rows), 6))


def zeros_zlib(n):
    """A zlib stream of n zero bytes, built from one repeated deflate block (compressing 805 MB of
    zeros takes 8 s; this takes milliseconds). Each 1 MiB block ends in a full flush, so it is
    byte-aligned and independent of the ones before; adler32 of zeros is (n mod 65521) << 16 | 1."""
    step = MiB
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(step)) + c.flush(zlib.Z_FULL_FLUSH)
    assert block == c.compress(bytes(step)) + c.flush(zlib.Z_FULL_FLUSH)
    tail = c.compress(bytes(n % step)) + c.flush(zlib.Z_FINISH)
    return b"\x78\xda" + block * (n // step) + tail + struct.pack(">I", ((n % 65521) << 16) | 1)


def bomb_png(side=16384):
    """A 16384x16384 RGB PNG of zeros: ~780 KB that decodes to 805 MB."""
    return png(side, side, zeros_zlib(side * (1 + 3 * side)))


def jpeg_oversized_dht():
    """A baseline 8x8 grey JPEG whose DC Huffman table declares 265 codes (10 of 15 bits, 255 of
    16: a valid prefix code, but more codes than there are 8-bit symbols). stb_image 2.27 writes past
    its 256-entry arrays on it; a hardened decoder rejects the table."""
    def seg(marker, payload):
        return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload
    counts = [0] * 16
    counts[14], counts[15] = 10, 255
    dc = seg(0xC4, b"\x00" + bytes(counts) + bytes(i % 256 for i in range(sum(counts))))
    ac_counts = [1] + [0] * 15
    ac = seg(0xC4, b"\x10" + bytes(ac_counts) + b"\x00")
    return (b"\xff\xd8" + seg(0xDB, b"\x00" + bytes([1] * 64)) +
            seg(0xC0, b"\x08" + struct.pack(">HH", 8, 8) + b"\x01" + b"\x01\x11\x00") + dc + ac +
            seg(0xDA, b"\x01\x01\x00\x00\x3f\x00") + bytes(16) + b"\xff\xd9")


def data_url(image, mime="image/png"):
    return "data:%s;base64,%s" % (mime, base64.b64encode(image).decode())


# ---- raw HTTP ----------------------------------------------------------------------------------------

class NoReply(Exception):
    pass


class Reply:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def header(self, name):
        return next((v for k, v in self.headers if k == name.lower()), None)

    def error_code(self):
        try:
            return json.loads(self.body)["error"]["code"]
        except Exception:
            return None

    def describe(self):
        code = self.error_code()
        return "%d %s" % (self.status, code) if code else str(self.status)


class Conn:
    """One client connection with a read buffer; every read is bounded by a deadline."""

    def __init__(self, port, timeout=5.0):
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.buf = b""
        self.eof = False

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data):
        self.sock.sendall(data)

    def _fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoReply("no reply within the deadline")
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(1 << 16)
        except socket.timeout:
            raise NoReply("no reply within the deadline")
        except ConnectionResetError:
            raise NoReply("connection reset")
        if not data:
            self.eof = True
            raise NoReply("connection closed")
        self.buf += data

    def _until(self, sep, deadline, limit=1 << 20):
        while sep not in self.buf:
            if len(self.buf) > limit:
                raise NoReply("reply head over %d bytes" % limit)
            self._fill(deadline)
        head, self.buf = self.buf.split(sep, 1)
        return head

    def _exact(self, n, deadline):
        while len(self.buf) < n:
            self._fill(deadline)
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_reply(self, deadline):
        while True:
            head = self._until(b"\r\n\r\n", deadline)
            lines = head.split(b"\r\n")
            m = re.match(rb"HTTP/1\.[01] (\d{3})", lines[0])
            if not m:
                raise NoReply("not an HTTP reply: %r" % lines[0][:60])
            status = int(m.group(1))
            headers = []
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers.append((k.strip().lower().decode("latin-1"), v.strip().decode("latin-1")))
            if 100 <= status < 200:
                continue
            r = Reply(status, headers, b"")
            if (r.header("transfer-encoding") or "").lower() == "chunked":
                body = b""
                while True:
                    size = int(self._until(b"\r\n", deadline).split(b";")[0], 16)
                    if size == 0:
                        self._until(b"\r\n", deadline)
                        break
                    body += self._exact(size, deadline)
                    self._exact(2, deadline)
                r.body = body
            elif r.header("content-length") is not None:
                r.body = self._exact(int(r.header("content-length")), deadline)
            elif status not in (204, 304):
                try:
                    while True:
                        self._fill(deadline)
                except NoReply:
                    pass
                r.body, self.buf = self.buf, b""
            return r

    def closed_within(self, seconds):
        """True if the server closes (EOF or reset) within the time, discarding what it sends."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._fill(deadline)
            except NoReply as e:
                return str(e) != "no reply within the deadline"
            self.buf = b""


def request(method, path, body=b"", headers=(), close=True):
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: %s" % HOST]
    if body or method == "POST":
        lines += ["Content-Type: application/json", "Content-Length: %d" % len(body)]
    if close:
        lines.append("Connection: close")
    lines += list(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(port, data, seconds, stream=None):
    """Sends data (while reading: a server may answer before the upload ends) and reads one reply.
    stream: an iterator of further chunks sent after data, until the reply arrives."""
    c = Conn(port)
    deadline = time.monotonic() + seconds
    stop = threading.Event()
    sent = [0]

    def sender():
        try:
            c.send(data)
            sent[0] += len(data)
            for chunk in stream or ():
                if stop.is_set():
                    break
                c.send(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass  # the server closed its side; its reply may be waiting

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    try:
        return c.read_reply(deadline), sent[0]
    finally:
        stop.set()
        c.close()
        t.join(1)


def get(port, path, seconds=5.0):
    return exchange(port, request("GET", path), seconds)[0]


def encode_body(images, **extra):
    return json.dumps(dict(images=images, **extra)).encode()


CHAT = "/v1/chat/completions"


def image_part(url, uuid=None):
    """An OpenAI image_url content part; uuid names its encoder cache entry (else the server hashes the URL)."""
    part = dict(type="image_url", image_url=dict(url=url))
    if uuid is not None:
        part["uuid"] = uuid
    return part


def chat_body(parts=None, messages=None, **extra):
    """What vLLM's EPD proxy sends an encode instance: one user message holding the parts (or these messages)."""
    if messages is None:
        messages = [dict(role="user", content=parts)]
    body = dict(model=None, messages=messages, stream=False)
    body.update(extra)  # may replace "stream"
    return json.dumps(body).encode()


# ---- the server ----------------------------------------------------------------------------------------

def parse_flags(text):
    out, tokens = {}, shlex.split(text)
    i = 0
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out[tokens[i]] = tokens[i + 1]
            i += 2
        else:
            out[tokens[i]] = None
            i += 1
    return out


def rss_kib(pid, field):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


STARTED = []  # every server process; those still running when the suite exits are killed
# The temporary folder of the main instance's encoder cache (ROOT/cache) and working folder (ROOT/cwd).
EC_ROOT = None


def kill_started():
    for p in STARTED:
        if p.poll() is None:
            p.kill()
            p.wait()
    if EC_ROOT:  # after the servers: none of them writes there any more
        shutil.rmtree(EC_ROOT, ignore_errors=True)


def make_ec_root():
    """ROOT, with cache/ and cwd/ in it: on /dev/shm where it can be written (a tmpfs, the encoder cache's
    usual home; on a disk, deleting the load case's few thousand cache folders takes seconds), else in
    the system's temporary folder."""
    shm = "/dev/shm"
    root = tempfile.mkdtemp(prefix="fovea-hostile-", dir=shm if os.access(shm, os.W_OK) else None)
    for sub in ("cache", "cwd"):
        os.mkdir(os.path.join(root, sub))
    return root


class Server:
    def __init__(self, opts, instance):
        self.opts = opts
        self.flags = dict(parse_flags(opts.server_args))
        self.flags.update(parse_flags(INSTANCE_ARGS[instance]))
        # The main instance keeps vLLM's encoder cache (and so serves the chat endpoint) in the suite's folder.
        self.cwd = None
        if instance == "main":
            self.flags["--ec-storage-path"] = os.path.join(EC_ROOT, "cache")
            self.cwd = os.path.join(EC_ROOT, "cwd")  # a file written relative to it still lands under EC_ROOT
        if opts.legacy:
            self.flags = {k: v for k, v in self.flags.items() if k not in NEW_FLAGS}
        self.instance = instance
        self.proc = None
        self.port = 0
        self.out = []
        self.start()

    def flag(self, name, default):
        v = self.flags.get(name)
        return float(v) if v is not None else default

    def ec_dir(self):
        """The encoder cache folder (--ec-storage-path), or None (the instance has none)."""
        return self.flags.get("--ec-storage-path")

    def args(self):
        # Absolute: the main instance runs in a folder of its own (a bare name is looked up in PATH).
        fovea = os.path.abspath(self.opts.fovea) if os.sep in self.opts.fovea else self.opts.fovea
        a = [fovea, "serve", self.opts.model, "--device", "cpu", "--host", HOST, "--port", "0"]
        for k, v in self.flags.items():
            a += [k] if v is None else [k, v]
        return a

    def start(self):
        self.err = tempfile.TemporaryFile()
        self.out = []
        self.port = 0
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.PIPE, stderr=self.err, stdin=subprocess.DEVNULL,
                                     cwd=self.cwd)
        STARTED.append(self.proc)
        got = threading.Event()

        def reader():
            for line in self.proc.stdout:
                line = line.decode(errors="replace")
                self.out.append(line)
                m = re.search(r"listening on http://(\S+):(\d+)", line)
                if m and not self.port:
                    self.port = int(m.group(2))
                    got.set()
            got.set()

        threading.Thread(target=reader, daemon=True).start()
        got.wait(60)
        if not self.port:
            self.proc.kill()
            self.proc.wait()
            self.err.seek(0)
            err = self.err.read().decode(errors="replace").strip()
            bad = [f for f in self.flags if f in err]
            hint = ""
            if bad:
                hint = ("\n  It names %s: this fovea does not take that flag (the suite is written for the issue-10 "
                        "server; --legacy leaves out its new flags, --server-args sets them)." % ", ".join(bad))
            print("hostile-client: the %s server did not start (exit %s): %s\n  command: %s%s" % (
                self.instance, self.proc.returncode, err or "(no stderr)", shlex.join(self.args()), hint),
                file=sys.stderr)
            raise SystemExit(2)
        r = get(self.port, "/health", 10)
        self.start_rss_kib = rss_kib(self.proc.pid, "VmRSS")
        if r.status != 200:
            print("hostile-client: /health answered %d right after startup" % r.status, file=sys.stderr)
            raise SystemExit(2)

    def died(self):
        rc = self.proc.poll()
        if rc is None:
            return None
        return "killed by %s" % signal.Signals(-rc).name if rc < 0 else "exited %d" % rc

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_bound_kib(self):
        extra = 2 * self.flag("--max-body-bytes", 64 * MiB) + self.flag("--max-decode-bytes", 0) + 256 * MiB
        return self.start_rss_kib + int(extra) // 1024


# ---- cases ----------------------------------------------------------------------------------------------
# A case is f(ctx) -> (observed, ok). ctx.srv is the server instance, ctx.t the time-scale factor.

CASES = []


def case(name, instance, expected, bound_s):
    def wrap(f):
        CASES.append((name, instance, expected, bound_s, f))
        return f
    return wrap


class Ctx:
    pass


def expect_status(r, statuses, code=None):
    ok = r.status in statuses and (code is None or r.error_code() == code)
    return r.describe(), ok


def bad_request(name, body, status, code, expected=None, path="/v1/encode", instance="main"):
    @case(name, instance, expected or "%d %s" % (status, code), 10)
    def run(ctx):
        r, _ = exchange(ctx.srv.port, request("POST", path, body() if callable(body) else body), 10 * ctx.t)
        return expect_status(r, {status}, code)


GOOD = None  # a small valid PNG (set in main)


def good():
    return data_url(GOOD)


@case("ready", "main", "GET /ready 200", 5)
def c_ready(ctx):
    return expect_status(get(ctx.srv.port, "/ready"), {200})


# The bad-request cases of tests/test-serve.cpp.
bad_request("malformed JSON", b'{"images": [', 400, "invalid_json")
bad_request("unknown field", lambda: encode_body([good()], return_deepstacks=True), 400, "invalid_request")
bad_request("bad base64", lambda: encode_body(["data:image/png;base64,iVBOR@@@"]), 400, "invalid_base64")
bad_request("not an image", lambda: encode_body([base64.b64encode(b"this is text, not an image").decode()]), 400,
            "invalid_image")
bad_request("too many images (17 > 16)", lambda: encode_body([good()] * 17), 400, "too_many_images")
bad_request("wrong model", lambda: encode_body([good()], model="gpt-4o"), 404, "model_not_found")


@case("405 with Allow", "main", "405 method_not_allowed, Allow: POST", 5)
def c_405(ctx):
    r = get(ctx.srv.port, "/v1/encode")
    return "%s, Allow: %s" % (r.describe(), r.header("allow")), r.status == 405 and r.header("allow") == "POST"


@case("body too large (Content-Length)", "main", "413 body_too_large", 15)
def c_413(ctx):
    n = int(ctx.srv.flag("--max-body-bytes", 64 * MiB)) + 1
    head = request("POST", "/v1/encode", b"")
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % n)
    chunk = b"A" * MiB
    stream = (chunk if i < n // MiB else b"A" * (n % MiB) for i in range(n // MiB + 1))
    r, sent = exchange(ctx.srv.port, head, 15 * ctx.t, stream)
    obs, ok = expect_status(r, {413}, "body_too_large")
    return "%s after %d MiB sent" % (obs, sent // MiB), ok


@case("body too large (chunked)", "main", "413 body_too_large", 15)
def c_413_chunked(ctx):
    n = int(ctx.srv.flag("--max-body-bytes", 64 * MiB)) + MiB
    head = ("POST /v1/encode HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" % HOST).encode()
    chunk = b"%x\r\n" % MiB + b"A" * MiB + b"\r\n"
    stream = [chunk] * (n // MiB) + [b"0\r\n\r\n"]
    r, sent = exchange(ctx.srv.port, head, 15 * ctx.t, iter(stream))
    obs, ok = expect_status(r, {413}, "body_too_large")
    return "%s after %d MiB sent" % (obs, sent // MiB), ok


def nested_case(name, make_body):
    @case(name, "main", "400, server alive", 5)
    def run(ctx):
        r, _ = exchange(ctx.srv.port, request("POST", "/v1/encode", make_body(good().encode())), 5 * ctx.t)
        return expect_status(r, {400})


# Depth 10^5 (~200 KB), then another key: the value is copied when the object grows, and the error
# message about "model" quotes it.
D = 100000
ARRAYS, OBJECTS = b"[" * D + b"]" * D, b'{"a":' * D + b"1" + b"}" * D
nested_case("nested arrays, depth 10^5, as \"model\", then a key",
            lambda img: b'{"model": ' + ARRAYS + b', "images": ["' + img + b'"]}')
nested_case("nested arrays, depth 10^5, unknown key, then a key",
            lambda img: b'{"images": ["' + img + b'"], "x": ' + ARRAYS + b', "y": 1}')
nested_case("nested objects, depth 10^5, unknown key, then a key",
            lambda img: b'{"x": ' + OBJECTS + b', "images": ["' + img + b'"]}')


@case("object with 100k keys (1.2 MB)", "main", "400 in < 2 s", 2)
def c_many_keys(ctx):
    body = b"{" + b",".join(b'"k%06d":0' % i for i in range(100000)) + b', "images": ["%s"]}' % good().encode()
    t0 = time.monotonic()
    r, _ = exchange(ctx.srv.port, request("POST", "/v1/encode", body), 5 * ctx.t)
    dt = time.monotonic() - t0
    obs, ok = expect_status(r, {400})
    return "%s in %.2f s (%d KB)" % (obs, dt, len(body) // 1000), ok and dt < 2 * ctx.t


@case("JPEG DHT with 265 codes", "main", "400 invalid_image", 5)
def c_jpeg_dht(ctx):
    body = encode_body([data_url(jpeg_oversized_dht(), "image/jpeg")])
    r, _ = exchange(ctx.srv.port, request("POST", "/v1/encode", body), 5 * ctx.t)
    return expect_status(r, {400}, "invalid_image")


BOMB = None


def bomb_body():
    global BOMB
    if BOMB is None:
        BOMB = encode_body([data_url(bomb_png())])
    return BOMB


@case("PNG 16384x16384 (780 KB of zeros)", "main", "400 invalid_image", 10)
def c_bomb(ctx):
    r, _ = exchange(ctx.srv.port, request("POST", "/v1/encode", bomb_body()), 10 * ctx.t)
    obs, ok = expect_status(r, {400}, "invalid_image")
    return "%s, VmHWM %d MiB" % (obs, rss_kib(ctx.srv.proc.pid, "VmHWM") // 1024), ok


@case("4 concurrent PNG 16384x16384", "main", "400 invalid_image x4", 20)
def c_bomb4(ctx):
    body = bomb_body()
    results = [None] * 4

    def one(i):
        try:
            results[i] = exchange(ctx.srv.port, request("POST", "/v1/encode", body), 20 * ctx.t)[0].describe()
        except (NoReply, OSError) as e:
            results[i] = "no reply (%s)" % e
    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    ok = all(r == "400 invalid_image" for r in results)
    return "%s, VmHWM %d MiB" % (", ".join(results), rss_kib(ctx.srv.proc.pid, "VmHWM") // 1024), ok


@case("64 MiB JSON array of numbers", "main", "400 or 413", 20)
def c_big_array(ctx):
    limit = int(ctx.srv.flag("--max-body-bytes", 64 * MiB))
    n = (min(limit, 64 * MiB) - len('{"images": [0]}')) // 2
    body = b'{"images": [' + b"0," * n + b'0]}'
    r, _ = exchange(ctx.srv.port, request("POST", "/v1/encode", body), 20 * ctx.t)
    obs, ok = expect_status(r, {400, 413})
    return "%s, %.1f MiB body, VmHWM %d MiB" % (obs, len(body) / MiB, rss_kib(ctx.srv.proc.pid, "VmHWM") // 1024), ok


@case("header line of 1 MB", "main", "431 (or 400)", 5)
def c_long_header(ctx):
    data = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 1000000 + b"\r\nConnection: close\r\n\r\n"
    r, _ = exchange(ctx.srv.port, data, 5 * ctx.t)
    return expect_status(r, {431, 400})


@case("endless header line (up to 64 MiB)", "main", "431 (or 400) before 64 MiB sent", 10)
def c_endless_header(ctx):
    total = 64
    stream = (b"a" * MiB for _ in range(total))
    r, sent = exchange(ctx.srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: ", 10 * ctx.t, stream)
    obs, ok = expect_status(r, {431, 400})
    return "%s after %d MiB sent" % (obs, sent // MiB), ok and sent < total * MiB


@case("10k header fields", "main", "431 (or 400)", 5)
def c_many_headers(ctx):
    data = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(10000)) + b"\r\n"
    r, _ = exchange(ctx.srv.port, data, 5 * ctx.t)
    return expect_status(r, {431, 400})


def smuggle(name, head_lines, framed=None):
    """A valid encode request whose framing is ambiguous: a lenient server answers it 200."""
    @case(name, "main", "400", 5)
    def run(ctx):
        body = encode_body([good()])
        data = ("POST /v1/encode HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % HOST).encode()
        data += b"".join(h.replace(b"LEN", b"%d" % len(body)) + b"\r\n" for h in head_lines) + b"\r\n"
        data += framed(body) if framed else body
        r, _ = exchange(ctx.srv.port, data, 5 * ctx.t)
        return expect_status(r, {400})


smuggle("duplicate Content-Length", [b"Content-Length: LEN", b"Content-Length: 5"])
smuggle("Content-Length + chunked", [b"Content-Length: 5", b"Transfer-Encoding: chunked"],
        lambda body: b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
smuggle("NUL in a header value", [b"Content-Length: LEN", b"X-Note: a\x00b"])
smuggle("obs-fold header line", [b"Content-Length: LEN", b"X-Note: a", b" folded"])


@case("pipelined: 2 x GET /health + POST", "main", "200 health, 200 health, 200 encode, in order", 10)
def c_pipelined(ctx):
    c = Conn(ctx.srv.port)
    deadline = time.monotonic() + 10 * ctx.t
    try:
        c.send(request("GET", "/health", close=False) * 2 +
               request("POST", "/v1/encode", encode_body([good()]), close=False))
        got = []
        for _ in range(3):
            try:
                r = c.read_reply(deadline)
            except NoReply as e:
                got.append("no reply (%s)" % e)
                break
            kind = b'"data"' in r.body and "encode" or b'"status"' in r.body and "health" or "?"
            got.append("%d %s" % (r.status, kind))
    finally:
        c.close()
    return ", ".join(got), got == ["200 health", "200 health", "200 encode"]


@case("half-close after a complete request", "main", "200 encode", 10)
def c_half_close(ctx):
    c = Conn(ctx.srv.port)
    try:
        c.send(request("POST", "/v1/encode", encode_body([good()]), close=False))
        c.sock.shutdown(socket.SHUT_WR)
        r = c.read_reply(time.monotonic() + 10 * ctx.t)
    finally:
        c.close()
    return r.describe(), r.status == 200 and b'"data"' in r.body


# ---- POST /v1/chat/completions: vLLM's encode instance (main server, --ec-storage-path ROOT/cache) ----

def tree(root):
    """Every folder and file under root (relative paths; symlinks not followed)."""
    out = set()
    for folder, dirs, files in os.walk(root):
        out.update(os.path.relpath(os.path.join(folder, n), root) for n in dirs + files)
    return out


def cache_file(ctx, key):
    return os.path.join(ctx.srv.ec_dir(), key, "encoder_cache.safetensors")


def safetensors_names(path):
    """The tensor names of a safetensors file (its JSON header), or None if it is not one."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            return set(json.loads(f.read(n))) - {"__metadata__"} if n < MiB else None
    except (OSError, ValueError, struct.error):
        return None


def half(body):
    return body[:len(body) // 2]


def chat(ctx, body, seconds=10, path=CHAT):
    if not ctx.srv.ec_dir():  # --legacy: no encoder cache, no chat endpoint to test
        raise NoReply("the main server has no --ec-storage-path (--legacy)")
    return exchange(ctx.srv.port, request("POST", path, body), seconds * ctx.t)


def chat_request(name, body, statuses, codes, expected, bound=10, path=CHAT):
    """A body the server must refuse with one of these statuses and codes, writing nothing."""
    @case(name, "main", expected, bound)
    def run(ctx):
        before = tree(EC_ROOT)
        r, _ = chat(ctx, body() if callable(body) else body, bound, path)
        created = sorted(tree(EC_ROOT) - before)
        ok = r.status in statuses and r.error_code() in codes and not created
        return r.describe() + ("; created %s" % ", ".join(created[:3]) if created else ""), ok


def chat_refused(name, body, status, code, bound=10, path=CHAT):
    chat_request(name, body, {status}, {code}, "%d %s, nothing written" % (status, code), bound, path)


# Nesting past the limit of 8, where the proxy's body nests deepest: inside a message, and as a part's URL.
chat_refused("chat: nested arrays, depth 10^5, in messages", lambda: b'{"messages": [' + ARRAYS + b']}',
             400, "invalid_json")
chat_refused("chat: nested objects, depth 10^5, as image_url.url",
             lambda: b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ' +
             OBJECTS + b'}}]}]}', 400, "invalid_json")
chat_refused("chat: 17 image parts in one message (> 16)", lambda: chat_body([image_part(good())] * 17),
             400, "too_many_images")
chat_refused("chat: 17 messages of one image part (> 16)",
             lambda: chat_body(messages=[dict(role="user", content=[image_part(good())])] * 17), 400, "too_many_images")
# 10^5 entries: the JSON value limit (counted while scanning; 384 values on the chat endpoint) refuses
# them before the image count; either refusal is right, a slow one is not.
TINY = "data:image/png;base64,AA=="
for _what, _body in (("image parts", lambda: chat_body([image_part(TINY)] * 100000)),
                     ("messages", lambda: chat_body(messages=[dict(role="user", content=[image_part(TINY)])] * 100000)),
                     ("text parts", lambda: chat_body([dict(type="text", text="x")] * 100000 + [image_part(good())]))):
    chat_request("chat: 10^5 %s" % _what, _body, {400}, {"invalid_json", "too_many_images"},
                 "400 invalid_json or too_many_images in < 2 s, nothing written", 2)


def with_field(name, value):
    """A good chat body plus one top-level field."""
    return lambda: chat_body([image_part(good())], **{name: value})


# Fields that would make vLLM look for the file under another key, or that ask for what an encode
# instance does not do (stream, the push connector): refused, naming the field.
for _name, _value in (("stream", True), ("ec_transfer_params", {})):
    chat_refused("chat: %s" % json.dumps({_name: _value})[1:-1], with_field(_name, _value), 400, "unsupported_field")
# The kwargs vLLM's proxy forwards (PR #56786): what fovea does not implement is refused naming the key
# (unsupported_field); a value of the wrong type, out of range, or raising the server's limits is
# invalid_request; nesting past the body's depth is invalid_json. Nothing is written for any of them.
for _name, _value, _code in (
        ("mm_processor_kwargs", {"do_resize": False}, "unsupported_field"),
        ("mm_processor_kwargs", {"size": {"height": 4, "width": 4}}, "unsupported_field"),
        ("mm_processor_kwargs", {"images_kwargs": {"fps": 2}}, "unsupported_field"),
        ("mm_processor_kwargs", {"u" * 5000: 1}, "unsupported_field"),
        ("media_io_kwargs", {"video": {"num_frames": 8}}, "unsupported_field"),
        ("media_io_kwargs", {"audio": {}}, "unsupported_field"),
        ("mm_processor_kwargs", "max_pixels=4096", "invalid_request"),
        ("mm_processor_kwargs", [1, 2], "invalid_request"),
        ("media_io_kwargs", 7, "invalid_request"),
        ("mm_processor_kwargs", {"max_pixels": "4096"}, "invalid_request"),
        ("mm_processor_kwargs", {"max_pixels": 4096.5}, "invalid_request"),
        ("mm_processor_kwargs", {"max_pixels": True}, "invalid_request"),
        ("mm_processor_kwargs", {"max_pixels": 10 ** 30}, "invalid_request"),
        ("mm_processor_kwargs", {"max_pixels": -1}, "invalid_request"),
        ("mm_processor_kwargs", {"max_pixels": 1 << 27}, "invalid_request"),           # raises the server's limit
        ("mm_processor_kwargs", {"size": {"longest_edge": 1 << 28}}, "invalid_request"),
        ("mm_processor_kwargs", {"videos_kwargs": {"max_frames": 1 << 40}}, "invalid_request"),
        ("mm_processor_kwargs", {"fps": 1e308}, "invalid_request"),
        ("mm_processor_kwargs", {"fps": -0.0}, "invalid_request"),
        ("mm_processor_kwargs", {"min_pixels": 70000, "max_pixels": 60000}, "invalid_request"),
        ("mm_processor_kwargs", {"videos_kwargs": {"size": {"longest_edge": {"a": {"b": {"c": {"d": 1}}}}}}},
         "invalid_request"),  # 8 deep: within the body's limit, and not an integer
        ("priority", "urgent", "invalid_request"),
        ("session_id", {"a": 1}, "invalid_request")):
    chat_refused("chat: %s" % json.dumps({_name: _value})[1:-1][:80], with_field(_name, _value), 400, _code)
chat_refused("chat: mm_processor_kwargs nested 10^5 deep", lambda: b'{"mm_processor_kwargs": {"size": ' + OBJECTS +
             b'}, "messages": []}', 400, "invalid_json")
chat_refused("chat: truncated body (half a good one)", lambda: half(chat_body([image_part(good(), "truncated")])),
             400, "invalid_json")
chat_refused("chat: invalid JSON", b'{"messages": [}', 400, "invalid_json")
chat_refused("chat: PNG 16384x16384 (780 KB of zeros)", lambda: chat_body([image_part(data_url(bomb_png()))]),
             400, "invalid_image")


# A uuid is a folder name under the cache: anything that would leave it (or not be one name) is refused,
# and nothing is created anywhere under ROOT (the cache, the server's working folder, beside them).
def bad_uuid(label, uuid):
    """uuid: a string, or a function of ROOT (known once the suite runs)."""
    def body():
        return chat_body([image_part(good(), uuid(EC_ROOT) if callable(uuid) else uuid)])
    chat_refused("chat: uuid %s" % label, body, 400, "invalid_uuid", 5)


for _label, _uuid in (("../x", "../x"), ("a/b", "a/b"), ("..", ".."), (".", "."), ("a\\b", "a\\b"),
                      ("300 bytes", "u" * 300), ("control byte 0x01", "a\x01b"), ("NUL", "a\x00b"),
                      ("absolute path", lambda root: os.path.join(root, "abs"))):
    bad_uuid(_label, _uuid)
chat_refused("encode: uuid ../x", lambda: encode_body([image_part(good(), "../x")]), 400, "invalid_uuid", 5,
             "/v1/encode")


@case("chat: text part past --max-body-bytes (chunked)", "main", "413 body_too_large", 15)
def c_chat_413(ctx):
    n = int(ctx.srv.flag("--max-body-bytes", 64 * MiB)) + MiB
    head = ("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" % (CHAT, HOST)).encode()
    opening = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "'
    chunk = b"%x\r\n" % MiB + b"a" * MiB + b"\r\n"  # the text goes on: the server must count, not wait for its end
    stream = [b"%x\r\n" % len(opening) + opening + b"\r\n"] + [chunk] * (n // MiB) + [b"0\r\n\r\n"]
    r, sent = exchange(ctx.srv.port, head, 15 * ctx.t, iter(stream))
    obs, ok = expect_status(r, {413}, "body_too_large")
    return "%s after %d MiB sent" % (obs, sent // MiB), ok


def check_ec_reply(ctx, r, want):
    """Problems of a 200 chat reply: ec_transfer_params must map each key of want to its item_indices
    with a [t, h, w] grid, and DIR/<key>/encoder_cache.safetensors must hold ec_cache."""
    if r.status != 200:
        return [r.describe()]
    try:
        doc = json.loads(r.body)
        params, tokens = doc["ec_transfer_params"], doc["usage"]["prompt_tokens"]
    except (ValueError, KeyError, TypeError) as e:
        return ["200 without ec_transfer_params/usage (%r)" % e]
    problems = [] if set(params) == set(want) else ["keys %s, not %s" % (sorted(params), sorted(want))]
    for key, indices in want.items():
        entry = params.get(key) or {}
        grid = (entry.get("metadata") or {}).get("image_grid_thw")
        if entry.get("item_indices") != indices or not (isinstance(grid, list) and len(grid) == 3):
            problems.append("%s: %s" % (key[:16], json.dumps(entry)[:100]))
        if safetensors_names(cache_file(ctx, key)) != {"ec_cache"}:
            problems.append("no encoder_cache.safetensors with ec_cache under %s" % key[:16])
    if not isinstance(tokens, int) or tokens < 1:
        problems.append("usage.prompt_tokens %r" % tokens)
    return problems


@case("chat: good request (uuid, URL hash, repeat, text part)", "main",
      "200, ec_transfer_params per key, the files under the keys", 10)
def c_chat_good(ctx):
    other = data_url(noise_png(48, 64, 11))
    uuid = "hostile-good-%d" % os.getpid()
    parts = [dict(type="text", text="describe"), image_part(good(), uuid), image_part(other), image_part(good(), uuid)]
    r, _ = chat(ctx, chat_body(parts))
    # item_indices count image parts only (the text part is skipped); a part without uuid is keyed by
    # the sha256 of its URL string, as vLLM's proxy keys it.
    want = {uuid: [0, 2], hashlib.sha256(other.encode()).hexdigest(): [1]}
    problems = check_ec_reply(ctx, r, want)
    return (r.describe() + ("; " + "; ".join(problems) if problems else ", 2 keys, files written")), not problems


@case("chat: 16 MiB text part + an image", "main", "200 (text ignored), the file under the key", 10)
def c_chat_big_text(ctx):
    uuid = "hostile-big-text-%d" % os.getpid()
    r, _ = chat(ctx, chat_body([dict(type="text", text="a" * (16 * MiB)), image_part(good(), uuid)]))
    problems = check_ec_reply(ctx, r, {uuid: [0]})
    return r.describe() + ("; " + "; ".join(problems) if problems else ""), not problems


bad_request("chat without --ec-storage-path", lambda: chat_body([image_part(good())]), 400, "invalid_request",
            path=CHAT, instance="deadlines")


def control_server():
    """A trivial HTTP server on a thread of the probe's process, the control beside fovea's /health: it
    answers 200 to each connection's first request, one connection at a time, as an event loop would.
    Returns its port."""
    lsock = socket.socket()
    lsock.bind((HOST, 0))
    lsock.listen(256)

    def serve():
        while True:
            c, _ = lsock.accept()
            try:
                c.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = c.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            except OSError:
                pass
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    return lsock.getsockname()[1]


def probe_main(port, count, interval_ms, timeout_ms):
    """--probe: GET /health on a new connection every interval_ms, count times, and at each tick the same
    GET against a control server of the probe's own (control_server); prints both series' latencies (ms;
    null for no 200 within timeout_ms) as JSON {"fovea": [...], "control": [...]}. A process of its own:
    the load's threads in the suite's process do not delay its clock. The control waits for the same
    cores as fovea's network thread does, so its latency is the machine's floor in this very run."""
    ports = {"fovea": port, "control": control_server()}
    lat = {k: [None] * count for k in ports}

    def one(key, i):
        t0 = time.monotonic()
        try:
            c = Conn(ports[key], timeout_ms / 1000)
            c.send(request("GET", "/health"))
            r = c.read_reply(t0 + timeout_ms / 1000)
            c.close()
            if r.status == 200:
                lat[key][i] = (time.monotonic() - t0) * 1000
        except (NoReply, OSError):
            pass
    start = time.monotonic()
    ts = []
    for i in range(count):
        time.sleep(max(0, start + i * interval_ms / 1000 - time.monotonic()))
        for key in ports:
            ts.append(threading.Thread(target=one, args=(key, i)))
            ts[-1].start()
    [t.join() for t in ts]
    print(json.dumps(lat))


def health_verdict(out, count, t):
    """The /health bound shared by the load cases, from probe_main's output: every probe answered and
    fovea's p99 <= 100 ms x t (the time scale and busy factor) + the control's p99. An idle machine's
    control answers in about a millisecond, so there the bound is 100 ms; on a shared machine the control
    pays the same wait for a core as fovea's network thread, which the 1-minute load average, read before
    the burst, does not see. A /health queued behind the encoder, or a network thread blocked on a lock
    the workers hold, is slower than the control by far more than 100 ms. Returns (text, ok)."""
    def ranks(xs):
        ok = sorted(x for x in xs if x is not None)
        if not ok:
            return ok, float("inf"), float("inf"), float("inf")
        rank = lambda q: ok[max(0, -(-len(ok) * q // 100) - 1)]  # nearest rank  # noqa: E731
        return ok, rank(50), rank(99), ok[-1]
    got, p50, p99, mx = ranks(out["fovea"])
    cgot, _, cp99, _ = ranks(out["control"])
    bound = 100 * t + cp99
    text = "/health %d/%d, p50 %.0f p99 %.0f max %.0f ms (bound %.0f: control p99 %.0f, %d/%d)" % (
        len(got), count, p50, p99, mx, bound, cp99, len(cgot), count)
    return text, len(got) == count and len(cgot) == count and p99 <= bound


@case("load: 200 idle + 64 slow-header + 50 slow-body + 200 encodes", "main",
      "/health p99 <= 100 ms + a control server's p99 (100 samples), every encode 200, then 200", 40)
def c_load(ctx):
    port, t = ctx.srv.port, ctx.t
    socks, failed_connect = [], 0

    def connect():
        nonlocal failed_connect
        try:
            s = socket.create_connection((HOST, port), timeout=2)
            socks.append(s)
            return s
        except OSError:
            failed_connect += 1
            return None
    for _ in range(200):
        connect()
    slow = []
    for i in range(64):
        s = connect()
        if s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append(s)
    for i in range(50):
        s = connect()
        if s:
            s.sendall(request("POST", "/v1/encode", b" " * 100000, close=False)[:-100000])
            slow.append(s)
    stop = threading.Event()

    def trickle():  # one byte per second to each slow client
        while not stop.wait(1.0):
            for s in slow:
                try:
                    s.setblocking(False)
                    s.send(b"a")
                except OSError:
                    pass
    threading.Thread(target=trickle, daemon=True).start()

    # 200 clients, each sending one encode after another (a new connection each) until the probe ends.
    images = [data_url(noise_png(64, 64, i)) for i in range(8)]
    done, bad, lock = [0], [], threading.Lock()
    go, stop_encodes = threading.Barrier(201), threading.Event()

    keyed = ctx.srv.ec_dir() is not None

    def encode(i):
        go.wait()
        for n in itertools.count():
            # A uuid of its own: the main instance has an encoder cache, and a repeated key would be a
            # cache hit, not an encode under load (--legacy: no cache, the bare data URL as before).
            body = encode_body([image_part(images[i % 8], "load-%d-%d" % (i, n)) if keyed else images[i % 8]])
            try:
                status = exchange(port, request("POST", "/v1/encode", body), 20 * t)[0].status
            except (NoReply, OSError) as e:
                status = str(e)
            with lock:
                done[0] += status == 200
                if status != 200:
                    bad.append(status)
            if stop_encodes.is_set():
                return
    enc = [threading.Thread(target=encode, args=(i,), daemon=True) for i in range(200)]
    [e.start() for e in enc]
    probe = subprocess.Popen([sys.executable, __file__, "--probe", str(port), "100", "80", str(int(1000 * t))],
                             stdout=subprocess.PIPE)
    go.wait()
    lat = json.loads(probe.communicate(timeout=30 * t)[0])
    stop_encodes.set()
    deadline = time.monotonic() + 20 * t
    for e in enc:
        e.join(max(0, deadline - time.monotonic()))
    try:
        after = exchange(port, request("POST", "/v1/encode", encode_body([good()])), 5 * t)[0].status
    except (NoReply, OSError) as e:
        after = str(e)
    stop.set()
    for s in socks:
        s.close()
    health, health_ok = health_verdict(lat, 100, t)
    unfinished = sum(e.is_alive() for e in enc)
    obs = "%s; encodes %d x 200, %d not (%s)%s%s; then %s" % (
        health, done[0], len(bad), bad[0] if bad else "-",
        "; %d clients unfinished" % unfinished if unfinished else "",
        "; %d connects failed" % failed_connect if failed_connect else "", after)
    return obs, (health_ok and done[0] >= 200 and not bad and not unfinished and
                 after == 200 and not failed_connect)


# ---- deadlines (server with --header-timeout 1 --body-timeout 1 --keep-alive-timeout 1) ----

def trickle_case(ctx, head, flag):
    limit = ctx.srv.flag(flag, 1.0)
    c = Conn(ctx.srv.port)
    stop = threading.Event()

    def sender():
        try:
            c.send(head)
            while not stop.wait(0.2):
                c.send(b"a")
        except OSError:
            pass
    threading.Thread(target=sender, daemon=True).start()
    t0 = time.monotonic()
    try:
        r = c.read_reply(t0 + limit + 4 * ctx.t)
        dt = time.monotonic() - t0
        closed = c.closed_within(1.0 * ctx.t)
        obs = "%s after %.1f s, %s" % (r.describe(), dt, "closed" if closed else "left open")
        ok = r.status == 408 and dt <= limit + 1.5 * ctx.t and closed
    except NoReply as e:
        obs, ok = "no reply: %s after %.1f s" % (e, time.monotonic() - t0), False
    finally:
        stop.set()
        c.close()
    return obs, ok


@case("slow header past --header-timeout", "deadlines", "408 within header-timeout + 1.5 s, closed", 8)
def c_header_deadline(ctx):
    return trickle_case(ctx, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", "--header-timeout")


@case("slow body past --body-timeout", "deadlines", "408 within body-timeout + 1.5 s, closed", 8)
def c_body_deadline(ctx):
    return trickle_case(ctx, request("POST", "/v1/encode", b" " * 100000, close=False)[:-100000], "--body-timeout")


@case("idle keep-alive past --keep-alive-timeout", "deadlines", "closed within keep-alive-timeout + 1.5 s", 8)
def c_keep_alive(ctx):
    limit = ctx.srv.flag("--keep-alive-timeout", 1.0)
    c = Conn(ctx.srv.port)
    try:
        c.send(request("GET", "/health", close=False))
        r = c.read_reply(time.monotonic() + 5 * ctx.t)
        t0 = time.monotonic()
        closed = c.closed_within(limit + 1.5 * ctx.t)
        dt = time.monotonic() - t0
    finally:
        c.close()
    return "%s, then %s after %.1f s idle" % (r.describe(), "closed" if closed else "still open", dt), \
        r.status == 200 and closed


# ---- shutdown ----

def encode_request(images):
    return request("POST", "/v1/encode", encode_body(images), close=False)


@case("SIGTERM with 40 sent requests (--threads 4) + 1 mid-body", "sigterm",
      "40 replies (200; 503 if unread), mid-body 503 or 200, /ready 503 or closed, exit 0", 60)
def c_sigterm(ctx):
    srv, t = ctx.srv, ctx.t
    img = [data_url(noise_png(256, 256, i)) for i in range(4)]
    keep = Conn(srv.port)
    keep.send(request("GET", "/health", close=False))
    keep.read_reply(time.monotonic() + 5 * t)
    conns = [Conn(srv.port) for _ in range(40)]
    replies = [None] * 40
    deadline = time.monotonic() + 50 * t

    def read(i):
        try:
            replies[i] = conns[i].read_reply(deadline).describe()
        except NoReply as e:
            replies[i] = "no reply (%s)" % e
    readers = []
    for i, c in enumerate(conns):
        c.send(encode_request([img[i % 4]]))
        readers.append(threading.Thread(target=read, args=(i,), daemon=True))
        readers[-1].start()
    body = encode_request([img[0]])
    mid = Conn(srv.port)
    mid.send(body[:len(body) // 2])
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # the signal is handled asynchronously: a request sent in the same instant may still be served
    try:  # readiness during shutdown, on a connection opened before
        keep.send(request("GET", "/ready", close=False))
        ready = keep.read_reply(time.monotonic() + 2 * t).describe()
    except NoReply as e:
        ready = "closed" if str(e) in ("connection closed", "connection reset") else "no reply (%s)" % e
    except OSError:
        ready = "closed"
    try:
        mid_reply = mid.read_reply(time.monotonic() + 1.0).describe()
    except NoReply as e:
        mid_reply = None if "deadline" in str(e) else "no reply (%s)" % e
    if mid_reply is None:
        try:
            mid.send(body[len(body) // 2:])
            mid_reply = mid.read_reply(deadline).describe()
        except (NoReply, OSError) as e:
            mid_reply = "no reply (%s)" % e
    for r in readers:
        r.join(max(0, deadline - time.monotonic()))
    try:
        code = srv.proc.wait(max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = "still running"
    dt = time.monotonic() - t0
    for c in conns + [keep, mid]:
        c.close()
    n200 = replies.count("200")
    n503 = sum(1 for r in replies if r and r.startswith("503"))
    lost = [r for r in replies if not (r == "200" or (r and r.startswith("503")))]
    obs = "%d x 200, %d x 503, %d lost%s; mid-body: %s; /ready: %s; exit %s after %.1f s" % (
        n200, n503, len(lost), " (%s)" % lost[0] if lost else "", mid_reply, ready, code, dt)
    ok = (not lost and (mid_reply in ("200",) or mid_reply.startswith("503")) and
          (ready == "closed" or ready.startswith("503")) and code == 0)
    return obs, ok


@case("second signal exits at once", "second-signal", "exit 1 within 2 s of the second SIGTERM", 15)
def c_second_signal(ctx):
    srv, t = ctx.srv, ctx.t
    img = [data_url(noise_png(256, 256, i)) for i in range(16)]
    c = Conn(srv.port)
    c.send(encode_request(img))
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    if srv.proc.poll() is not None:
        c.close()
        return "exited %s before the second signal (nothing in flight?)" % srv.proc.returncode, False
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(2 * t)
    except subprocess.TimeoutExpired:
        code = "still running"
    c.close()
    return "exit %s after %.2f s" % (code, time.monotonic() - t0), code == 1


# ---- driver ---------------------------------------------------------------------------------------------

def busy_factor():
    """How much a busy machine stretches wall time: the 1-minute load average over the CPUs this process may
    use, at least 1. The time bounds are hang and latency bounds for an otherwise idle machine; on a shared
    one (CI, a parallel build) they stretch with it. Read again before every case."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / max(1, len(os.sched_getaffinity(0))))


def run_case(ctx, name, bound, f):
    """f(ctx) under a hang bound; ctx.t is the time scale (ctx.scale, the suite's --time-scale) times the
    machine's busy factor at the case's start."""
    out = {}
    busy = busy_factor()
    ctx.t = ctx.scale * busy

    def body():
        try:
            out["r"] = f(ctx)
        except (NoReply, OSError) as e:
            out["r"] = ("no reply (%s)" % e, False)
        except Exception as e:  # a bug of the suite shows as a failed case, not a traceback
            out["r"] = ("suite error: %r" % e, False)
    t0 = time.monotonic()
    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(bound * ctx.t + 10)
    dt = time.monotonic() - t0
    if "r" not in out:
        return "hang: no result after %.0f s" % dt, False, dt
    obs, ok = out["r"]
    if dt > bound * ctx.t:
        obs, ok = "%s (took %.1f s > %.0f s)" % (obs, dt, bound * ctx.t), False
    if busy > 1:
        obs += " [time bounds x%.1f: load %.1f]" % (busy, os.getloadavg()[0])
    return obs, ok, dt


def main():
    global GOOD, EC_ROOT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--fovea", default=os.path.join(here, "..", "..", "build", "fovea"), help="the fovea binary")
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="the server's limits (see above)")
    ap.add_argument("--legacy", action="store_true", help="leave out the flags the pre-issue-10 server lacks")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--time-scale", type=float, default=1.0, help="factor on every time bound (sanitizer builds), times the busy factor")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--probe", nargs=4, type=int, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.probe:
        probe_main(*opts.probe)
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # the server inherits it too
    GOOD = noise_png(64, 64, 7)
    EC_ROOT = make_ec_root()
    only = [s.strip().lower() for s in opts.only.split(",") if s.strip()]
    cases = [c for c in CASES if not only or any(s in c[0].lower() for s in only)]
    rows, started = [], time.monotonic()
    for instance in INSTANCE_ARGS:
        mine = [c for c in cases if c[1] == instance]
        if not mine:
            continue
        ctx = Ctx()
        ctx.scale = ctx.t = opts.time_scale
        ctx.srv = Server(opts, instance)
        print("# %s server: %s" % (instance, shlex.join(ctx.srv.args())), flush=True)
        for name, _, expected, bound, f in mine:
            obs, ok, dt = run_case(ctx, name, bound, f)
            died = ctx.srv.died()
            if died and instance in ("main", "deadlines"):
                obs, ok = "%s; server %s (crash)" % (obs, died), False
                ctx.srv.err.seek(0)
                tail = ctx.srv.err.read().decode(errors="replace").strip().splitlines()[-3:]
                print("#   server stderr: %s" % " / ".join(tail), flush=True)
                ctx.srv.start()
            elif not died:
                try:
                    if get(ctx.srv.port, "/health", 5 * ctx.t).status != 200:
                        raise NoReply("not 200")
                except (NoReply, OSError) as e:
                    obs, ok = "%s; /health afterwards: %s" % (obs, e), False
            rows.append(dict(case=name, expected=expected, observed=obs, ok=ok, seconds=round(dt, 2)))
            print("%-62s | %s | %s" % (name, "ok" if ok else "FAIL", obs), flush=True)
        if instance == "main" and not only:
            hwm, bound = rss_kib(ctx.srv.proc.pid, "VmHWM"), ctx.srv.rss_bound_kib()
            rows.append(dict(case="peak RSS of the main server (VmHWM)",
                             expected="<= %d MiB (%d at start + 2 x body + decode + 256)" % (
                                 bound // 1024, ctx.srv.start_rss_kib // 1024),
                             observed="%d MiB" % (hwm // 1024), ok=0 < hwm <= bound, seconds=0))
        ctx.srv.stop()
    total = time.monotonic() - started

    w = [max(len(r[k]) for r in rows + [dict(case="case", expected="expected", observed="observed")])
         for k in ("case", "expected", "observed")]
    print("\n| %-*s | %-*s | %-*s | ok |" % (w[0], "case", w[1], "expected", w[2], "observed"))
    print("|%s|%s|%s|----|" % ("-" * (w[0] + 2), "-" * (w[1] + 2), "-" * (w[2] + 2)))
    for r in rows:
        print("| %-*s | %-*s | %-*s | %s |" % (w[0], r["case"], w[1], r["expected"], w[2], r["observed"],
                                              "ok" if r["ok"] else "FAIL"))
    failed = [r["case"] for r in rows if not r["ok"]]
    print("\n%d/%d ok in %.0f s%s" % (len(rows) - len(failed), len(rows), total,
                                       "; failed: " + "; ".join(failed) if failed else ""))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(rows=rows, seconds=round(total, 1), server_args=opts.server_args,
                           legacy=opts.legacy), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        kill_started()
