#!/usr/bin/env python3
"""The hostile-resources suite of `fovea serve` (issue 45, hardening round 3): time and memory bounds,
not only statuses. Python standard library only, loopback only; every loop is bounded in count and
time (the whole suite takes about 40 s against a conforming server, under 5 minutes otherwise).

    python3 tests/hostile/hostile-resources.py --fovea build/fovea
    python3 tests/hostile/hostile-resources.py --fovea build/fovea --only parse,shutdown --json out.json

It reuses tests/hostile/hostile-client.py (imported as a module: its Server, raw HTTP helpers, case
driver and /health probe) and runs a media origin in its own process (a threaded http.server on four
loopback ports, since libcurl caps connections per host and port): /stall/* reads the request and
never answers; /endless-cl/* streams 64 KiB chunks behind a Content-Length of 1 TiB,
/endless-chunked/* and /endless-close/* stream them without one; /img/* is a small PNG; it counts
GETs per path. It starts five `fovea serve synthetic:tiny --device cpu --port 0` instances (all but
"release" fetch http:// URLs from 127.0.0.1: --allowed-media-domains 127.0.0.1 --allow-private-media-urls):

    main          --threads 4 --media-fetch-timeout 3 --request-timeout 30, an encoder cache
    release       --max-pixels 65536 (otherwise the defaults: forwards of up to 16384 tokens)
    fetch-memory  --max-body-bytes 8 MiB --max-body-bytes-in-flight 64 MiB, an encoder cache
    overload      --request-timeout 4 --max-queue 256 --max-queue-tokens 10^6 --max-pixels 65536
                  --max-batch-tokens 256 (one request's 4 images a forward, ~0.2 s; a forward packing
                  many requests ends after all their deadlines, see the overload case)
    shutdown      --shutdown-timeout 2 --threads 4 --max-batch-tokens 64

The cases (time bounds are multiplied by --time-scale and by the machine's busy factor, the load average over
the CPUs, read before each case):

    parse     ~60 MiB JSON strings of escapes: "\\n" in an unknown field of /v1/encode (400
              invalid_request after the parse), "\\u00e9" in a chat text part (200), "\\n" after a
              \\u0000 (the body parsed whole; 400): each within 8 s (a linear parse takes ~1.5 s; the
              quadratic one took 49 s for 4 MiB), RSS growth meanwhile <= 4 x body + 128 MiB
    stall     32 requests (chat and encode) whose origin never answers, then an inline data: image:
              the inline one 200 within 1.5 s; the stalled ones 400 invalid_url naming
              --media-fetch-timeout within timeout + 2 s; at most 8 origin connections at once, each
              closed by the server by then
    uuid      one uuid on two images: 400 invalid_uuid naming both, nothing written, none encoded; 16
              parts of one image under one uuid: 200, item_indices 0..15, fovea_inputs_encoded_total
              + 1; one URL 16 times (chat) and 4 times (encode): one GET each, the chat's encoded once
    fetch memory  16 requests x 16 endless URLs (a streaming one first), two rounds: every reply
              400 invalid_url or 503 server_busy within 20 s; peak RSS (VmHWM) <= start + the budget
              + 128 MiB; VmRSS after the rounds <= start + 64 MiB; no origin connection sent more
              than --max-body-bytes + 32 MiB (socket buffers)
    deadline  a stalled fetch on the overload instance: 504 timeout at --request-timeout (+ 1.5 s)
    release   X (16 images, 1024 tokens) alone in a forward, Y (16 images) queued behind it: X
              answered before Y by at least half of Y's forward (a reply leaves when its forward
              ends, not when the next one does)
    overload  160 requests x 4 images (256 tokens each) at once against the warm encoder, sent in
              milliseconds from a thread at nice +10: every request answered; >= 16 x 503 queue_full
              with Retry-After, their median time <= 1 s; every other non-200 a 504, at most 16 (10%;
              the admission estimate has no margin: 0-8 were seen on a 2-core machine); at least one
              200; /health every 25 ms for 5 s from another process, once the burst is sent: p99 <=
              100 ms + the p99 of a trivial control server probed alongside (the machine's own floor
              in that run); the workers and the encoder thread at nice +5 from the main thread
    shutdown  SIGTERM with 40 encodes of 4 images and 4 stalled fetches in flight: every request 200
              or 503 shutting_down (none lost; the 503s within timeout + 1.5 s), the stalled ones 503,
              exit 0 within --shutdown-timeout + 3 s

The exit code is 1 if any case fails (a server crash, a case past its time bound, a lost reply, a
status, time or memory bound missed), 2 for a problem of the harness (a server did not start).
"""
import argparse
import http.server
import importlib.util
import json
import os
import re
import resource
import select
import shlex
import signal
import socketserver
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HC_PATH = os.path.join(HERE, "hostile-client.py")
_spec = importlib.util.spec_from_file_location("hostile_client", HC_PATH)
hc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hc)

HOST = hc.HOST
MiB = hc.MiB
CHAT = hc.CHAT
NoReply = hc.NoReply

FETCH = "--allowed-media-domains 127.0.0.1 --allow-private-media-urls"
# Per instance: its flags ({ec}: the encoder cache folder). The rest are the server's defaults.
INSTANCES = {
    "main": "--threads 4 --max-body-bytes 67108864 --request-timeout 30 --media-fetch-timeout 3 "
            "--ec-storage-path {ec} " + FETCH,
    "release": "--max-pixels 65536",
    "fetch-memory": "--max-body-bytes 8388608 --max-body-bytes-in-flight 67108864 --media-fetch-timeout 10 "
                    "--ec-storage-path {ec} " + FETCH,
    "overload": "--request-timeout 4 --max-queue 256 --max-queue-tokens 1000000 --max-pixels 65536 "
                "--max-batch-tokens 256 --media-fetch-timeout 30 " + FETCH,
    "shutdown": "--shutdown-timeout 2 --threads 4 --max-batch-tokens 64 --media-fetch-timeout 60 " + FETCH,
}


class Server(hc.Server):
    """hostile-client's Server with the flags given here."""

    def __init__(self, opts, instance, flags, cwd=None):
        self.opts = opts
        self.flags = hc.parse_flags(flags)
        self.cwd = cwd
        self.instance = instance
        self.proc = None
        self.port = 0
        self.out = []
        try:
            self.start()
        except SystemExit:  # hostile-client's Server said why (its words: that suite's)
            print("hostile-resources: the %s server did not start: this suite needs the issue-45 server "
                  "(--shutdown-timeout) built with libcurl (--allowed-media-domains)" % instance, file=sys.stderr)
            raise

    def rss(self, field="VmRSS"):
        return hc.rss_kib(self.proc.pid, field)


# ---- the loopback origin ----------------------------------------------------------------------------------

STALL_LIMIT_S = 120   # a stalled connection is held at most this long (or until the suite ends)
ENDLESS_LIMIT_S = 60  # an endless body streams at most this long ...
ENDLESS_CAP = 1 << 30  # ... and at most this many bytes
CHUNK = b"\0" * (64 << 10)
ORIGIN_PORTS = 4


class Origin:
    """The media origin the servers fetch from: counts GETs per path, stalled connections (now, at
    most, and when each was closed by the server), and the bytes each endless connection sent."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.gets = {}
        self.stalled_now = 0
        self.stall_log = []  # (path, seconds the connection stayed open, closed by the peer)
        self.endless_sent = []  # bytes per endless connection
        self.images = {}
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                path = self.path.split("?")[0]
                with origin.lock:
                    origin.gets[path] = origin.gets.get(path, 0) + 1
                kind = path.split("/")[1] if path.count("/") >= 2 else ""
                if kind == "stall":
                    return origin.stall(self, path)
                if kind.startswith("endless"):
                    return origin.endless(self, kind)
                if kind == "img" and path in origin.images:
                    body = origin.images[path]
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_error(404)

        class Threading(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            request_queue_size = 256

        # Several ports: libcurl caps connections per host and port (8), the budget is the server's.
        self.httpds = [Threading((HOST, 0), Handler) for _ in range(ORIGIN_PORTS)]
        self.ports = [h.server_address[1] for h in self.httpds]
        for h in self.httpds:
            threading.Thread(target=h.serve_forever, kwargs=dict(poll_interval=0.1), daemon=True).start()

    def url(self, path, k=0):
        return "http://%s:%d%s" % (HOST, self.ports[k % len(self.ports)], path)

    def stall(self, h, path):
        """Never answers: waits until the server closes the connection, the suite ends or STALL_LIMIT_S."""
        h.close_connection = True
        t0 = time.monotonic()
        with self.lock:
            self.stalled_now += 1
        closed = False
        try:
            while not self.stop.is_set() and time.monotonic() - t0 < STALL_LIMIT_S:
                r, _, _ = select.select([h.connection], [], [], 0.05)
                if r:
                    try:
                        data = h.connection.recv(4096)
                    except OSError:
                        data = b""
                    if not data:
                        closed = True
                        break
        finally:
            with self.lock:
                self.stalled_now -= 1
                self.stall_log.append((path, time.monotonic() - t0, closed))

    def endless(self, h, kind):
        """64 KiB chunks until the peer stops reading or closes (or ENDLESS_LIMIT_S, ENDLESS_CAP)."""
        h.close_connection = True
        head = "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
        if kind == "endless-cl":
            head += "Content-Length: %d\r\n" % (1 << 40)
        elif kind == "endless-chunked":
            head += "Transfer-Encoding: chunked\r\n"
        head += "Connection: close\r\n\r\n"
        chunk = b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n" if kind == "endless-chunked" else CHUNK
        sent, t0 = 0, time.monotonic()
        try:
            h.connection.settimeout(5)
            h.connection.sendall(head.encode())
            while not self.stop.is_set() and sent < ENDLESS_CAP and time.monotonic() - t0 < ENDLESS_LIMIT_S:
                h.connection.sendall(chunk)
                sent += len(CHUNK)
        except OSError:
            pass
        finally:
            with self.lock:
                self.endless_sent.append(sent)

    def close(self):
        self.stop.set()
        for h in self.httpds:
            h.shutdown()
            h.server_close()


ORIGIN = None
EC_ROOT = None


# ---- helpers -----------------------------------------------------------------------------------------------

CASES = []


def case(name, instance, expected, bound_s):
    def wrap(f):
        CASES.append((name, instance, expected, bound_s, f))
        return f
    return wrap


def post(port, path, body, seconds):
    return hc.exchange(port, hc.request("POST", path, body), seconds)[0]


def message(r):
    try:
        return json.loads(r.body)["error"]["message"]
    except Exception:
        return ""


def concurrently(fns, seconds):
    """Runs each fn() on a thread of its own; (result or exception text, seconds it took) per fn."""
    out = [None] * len(fns)

    def one(i):
        t0 = time.monotonic()
        try:
            res = fns[i]()
        except (NoReply, OSError) as e:
            res = "no reply (%s)" % e
        except Exception as e:
            res = "suite error: %r" % e
        out[i] = (res, time.monotonic() - t0)
    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(fns))]
    [t.start() for t in ts]
    deadline = time.monotonic() + seconds
    for t in ts:
        t.join(max(0, deadline - time.monotonic()))
    return [o if o is not None else ("no result within %.0f s" % seconds, seconds) for o in out]


def burst(port, reqs, seconds, nice=10, sent=None):
    """Sends every request (bytes) on a connection of its own, one after another from this thread (they
    are small: each fits in the socket's buffer, so the burst takes milliseconds), then reads each reply
    on a thread of its own; (Reply or why none, seconds from its sending) per request. The calling
    thread (and the readers it starts) first lowers its priority by `nice`: on a 2-core machine the
    client's own CPU would otherwise count against the server's /health latency. `sent` (an Event) is
    set once every request is sent."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except (OSError, AttributeError):
        pass
    conns, out = [], [None] * len(reqs)
    for i, data in enumerate(reqs):
        t0 = time.monotonic()
        try:
            c = hc.Conn(port)
            c.send(data)
            conns.append((i, c, t0))
        except OSError as e:
            out[i] = ("no connection (%s)" % e, time.monotonic() - t0)
    if sent:
        sent.set()
    deadline = time.monotonic() + seconds

    def read(i, c, t0):
        try:
            out[i] = (c.read_reply(deadline), time.monotonic() - t0)
        except NoReply as e:
            out[i] = ("no reply (%s)" % e, time.monotonic() - t0)
        finally:
            c.close()
    ts = [threading.Thread(target=read, args=a, daemon=True) for a in conns]
    [t.start() for t in ts]
    for t in ts:
        t.join(max(0, deadline + 1 - time.monotonic()))
    return [o if o is not None else ("no result within %.0f s" % seconds, seconds) for o in out]


def flat_png(side, seed):
    """A side x side RGB PNG of 32-pixel tiles: a few KB (cheap to send and decode), as many visual
    tokens as any image of its size."""
    rows = bytearray()
    for y in range(side):
        rows.append(0)
        for x in range(side):
            rows.extend(((x // 32 * 40 + seed * 13) % 256, (y // 32 * 50 + seed * 7) % 256, seed * 31 % 256))
    return hc.png(side, side, hc.zlib.compress(bytes(rows), 9))


def timed_post(port, path, body, seconds):
    """fn for concurrently: the reply (a Reply) of one POST."""
    return lambda: post(port, path, body, seconds)


def describe(res):
    return res.describe() if isinstance(res, hc.Reply) else str(res)


def tally(results):
    counts = {}
    for res, _ in results:
        d = describe(res)
        counts[d] = counts.get(d, 0) + 1
    return ", ".join("%d x %s" % (n, d) for d, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def requests_seen(port):
    """/v1/encode requests the server has read whole: answered (fovea_requests_total, every code) or in
    flight (fovea_requests_in_flight)."""
    body = hc.get(port, "/metrics", 5).body.decode(errors="replace")
    done = sum(float(v) for v in re.findall(r'^fovea_requests_total\{path="/v1/encode"[^}]*\} (\S+)$', body, re.M))
    m = re.search(r"^fovea_requests_in_flight (\S+)$", body, re.M)
    return done + (float(m.group(1)) if m else 0)


def metric(port, name):
    r = hc.get(port, "/metrics", 5)
    m = re.search(r"^%s(?:\{[^}]*\})? (\S+)$" % re.escape(name), r.body.decode(errors="replace"), re.M)
    return float(m.group(1)) if m else None


class RssPeak:
    """The highest VmRSS (KiB) of a process while the with-block runs, sampled every 10 ms (VmHWM only
    rises, so it cannot tell one case's peak from an earlier one's)."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def __enter__(self):
        self.before = hc.rss_kib(self.pid, "VmRSS")
        self.peak = self.before

        def sample():
            while not self.stop.wait(0.01):
                self.peak = max(self.peak, hc.rss_kib(self.pid, "VmRSS"))
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(1)
        self.peak = max(self.peak, hc.rss_kib(self.pid, "VmRSS"))

    def growth(self):
        return self.peak - self.before


def cpu_seconds(pid):
    """User + system CPU time a process has used: on a machine busy with other work a request's wall time
    stretches, its CPU time hardly does, so linear-time bounds are held on this."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def good():
    return hc.data_url(hc.GOOD)


def mib(kib):
    return kib / 1024


# ---- parse: escape-dense strings (main instance) ------------------------------------------------------------

PARSE_BYTES = 60 * MiB  # the body; --max-body-bytes is 64 MiB


def escape_body(path, escape, prefix=b""):
    """A body of about PARSE_BYTES whose long string is `escape` repeated: on /v1/encode an unknown field
    beside a good image, on the chat endpoint a text part before an image part."""
    n = (PARSE_BYTES - 4096) // len(escape)
    text = prefix + escape * n
    if path == CHAT:
        return (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "' + text +
                b'"}, {"type": "image_url", "image_url": {"url": "' + good().encode() +
                b'"}, "uuid": "hostile-resources-parse-%d"}]}]}' % os.getpid())
    return b'{"images": ["' + good().encode() + b'"], "junk": "' + text + b'"}'


def parse_case(label, path, escape, status, code, prefix=b""):
    @case("parse: %s" % label, "main", "%d%s in <= 8 s of the server's CPU; RSS peak <= +4 x body + 128 MiB" % (
        status, " " + code if code else ""), 30)
    def run(ctx):
        body = escape_body(path, escape, prefix)
        pid = ctx.srv.proc.pid
        with RssPeak(pid) as rss:
            t0, c0 = time.monotonic(), cpu_seconds(pid)
            r = post(ctx.srv.port, path, body, 30 * ctx.t)
            dt, cpu = time.monotonic() - t0, cpu_seconds(pid) - c0
        grow = rss.growth()
        bound_kib = (4 * len(body) + 128 * MiB) // 1024
        ok = r.status == status and (code is None or r.error_code() == code) and cpu <= 8 * ctx.t and grow <= bound_kib
        return "%s in %.2f s, %.2f s of CPU (%.0f MiB, %.0f MiB/s of CPU), RSS peak +%.0f MiB" % (
            r.describe(), dt, cpu, len(body) / MiB, len(body) / MiB / max(cpu, 1e-3), mib(grow)), ok


parse_case("60 MiB of \\n escapes, unknown field (encode)", "/v1/encode", b"\\n", 400, "invalid_request")
parse_case("60 MiB of \\u00e9 escapes in a text part (chat)", CHAT, b"\\u00e9", 200, None)
parse_case("\\u0000, then 60 MiB of \\n escapes (parsed whole)", "/v1/encode", b"\\n", 400, "invalid_request",
           prefix=b"\\u0000")


# ---- stalled origins (main instance: --threads 4, --media-fetch-timeout 3) ---------------------------------

@case("stall: 32 stalled fetches, then an inline image (--threads 4)", "main",
      "inline 200 <= 1.5 s; 32 x 400 invalid_url (--media-fetch-timeout) <= timeout + 2 s; "
      "<= 8 origin connections at once, each closed by then", 20)
def c_stall(ctx):
    port, t = ctx.srv.port, ctx.t
    timeout = ctx.srv.flag("--media-fetch-timeout", 30)
    tag = "s%d" % time.monotonic_ns()
    before = len(ORIGIN.stall_log)
    fns = []
    for i in range(32):
        url = ORIGIN.url("/stall/%s-%d" % (tag, i))
        if i % 2:  # half as image_url parts of a chat request, half as "images" of an encode request
            fns.append(timed_post(port, CHAT, hc.chat_body([hc.image_part(url, "stall-%s-%d" % (tag, i))]),
                                  timeout + 10 * t))
        else:
            fns.append(timed_post(port, "/v1/encode", hc.encode_body([url]), timeout + 10 * t))
    box = {}
    th = threading.Thread(target=lambda: box.update(r=concurrently(fns, timeout + 12 * t)), daemon=True)
    t0 = time.monotonic()
    th.start()
    # Until the origin holds its first connections (the fetches are under way; at most 3 s).
    while ORIGIN.stalled_now < 8 and time.monotonic() - t0 < 3 * t:
        time.sleep(0.02)
    stalled_at_inline = ORIGIN.stalled_now
    t1 = time.monotonic()
    try:
        inline = post(port, "/v1/encode", hc.encode_body([hc.data_url(hc.noise_png(64, 64, 99))]), 10 * t)
        inline_obs = inline.describe()
        inline_ok = inline.status == 200
    except (NoReply, OSError) as e:
        inline_obs, inline_ok = "no reply (%s)" % e, False
    inline_dt = time.monotonic() - t1
    # Connections to the origin at once, sampled until shortly before the fetches expire (a close is
    # seen up to 50 ms late, and the fetches waiting their turn connect as the first ones are dropped).
    most = stalled_at_inline
    while time.monotonic() < t0 + timeout - 0.5:
        most = max(most, ORIGIN.stalled_now)
        time.sleep(0.02)
    th.join(timeout + 15 * t)
    results = box.get("r") or []
    # Each reply: 400 invalid_url saying --media-fetch-timeout, within timeout + 2 s of its sending.
    bad = [describe(res) for res, dt in results
           if not (isinstance(res, hc.Reply) and res.status == 400 and res.error_code() == "invalid_url"
                   and "--media-fetch-timeout" in message(res) and dt <= timeout + 2 * t)]
    slowest = max((dt for _, dt in results), default=0)
    # The server closes every origin connection once its fetch is given up (bounded wait: 2 s).
    deadline = time.monotonic() + 2 * t
    while ORIGIN.stalled_now and time.monotonic() < deadline:
        time.sleep(0.05)
    log = ORIGIN.stall_log[before:]
    open_now = ORIGIN.stalled_now
    not_closed = [p for p, _, closed in log if not closed]
    held = max((s for _, s, _ in log), default=0)
    obs = ("inline %s in %.2f s (%d origin connections stalled then); %s, slowest %.2f s; origin: %d connections, "
           "at most %d at once, longest held %.2f s, %d still open, %d not closed by the server" % (
               inline_obs, inline_dt, stalled_at_inline, tally(results), slowest, len(log), most,
               held, open_now, len(not_closed)))
    ok = (inline_ok and inline_dt <= 1.5 * t and stalled_at_inline >= 4 and len(results) == 32 and not bad and
          1 <= most <= 8 and not open_now and not not_closed and held <= timeout + 2 * t)
    return obs, ok


# ---- one key, one content (main instance, --ec-storage-path) -----------------------------------------------

@case("uuid: one uuid on two different images (chat)", "main",
      "400 invalid_uuid naming both items, nothing written, <= 5 s", 10)
def c_uuid_two(ctx):
    uuid = "hostile-resources-two-%d" % os.getpid()
    before = hc.tree(EC_ROOT)
    enc0 = metric(ctx.srv.port, "fovea_inputs_encoded_total")
    body = hc.chat_body([hc.image_part(good(), uuid), hc.image_part(hc.data_url(hc.noise_png(64, 64, 8)), uuid)])
    t0 = time.monotonic()
    r = post(ctx.srv.port, CHAT, body, 10 * ctx.t)
    dt = time.monotonic() - t0
    created = sorted(hc.tree(EC_ROOT) - before)
    enc = metric(ctx.srv.port, "fovea_inputs_encoded_total") - enc0
    msg = message(r)
    names = all(n in msg for n in ("messages[0].content[0]", "messages[0].content[1]"))
    ok = r.status == 400 and r.error_code() == "invalid_uuid" and names and not created and enc == 0 and dt <= 5 * ctx.t
    return "%s in %.2f s%s%s; %d encoded" % (
        r.describe(), dt, "" if names else " (message does not name both items: %r)" % msg[:120],
        "" if not created else "; created %s" % ", ".join(created[:3]), enc), ok


@case("uuid: 16 parts of one image under one uuid (chat)", "main",
      "200, item_indices 0..15, encoded once (fovea_inputs_encoded_total + 1), <= 5 s", 10)
def c_uuid_16(ctx):
    uuid = "hostile-resources-16-%d" % os.getpid()
    img = hc.data_url(hc.noise_png(64, 64, 16))
    enc0 = metric(ctx.srv.port, "fovea_inputs_encoded_total")
    t0 = time.monotonic()
    r = post(ctx.srv.port, CHAT, hc.chat_body([hc.image_part(img, uuid)] * 16), 10 * ctx.t)
    dt = time.monotonic() - t0
    enc = metric(ctx.srv.port, "fovea_inputs_encoded_total") - enc0
    problems = hc.check_ec_reply(ctx, r, {uuid: list(range(16))})
    ok = not problems and enc == 1 and dt <= 5 * ctx.t
    return "%s in %.2f s, encoded %d%s" % (r.describe(), dt, enc, "; " + "; ".join(problems) if problems else ""), ok


@case("uuid: one URL 16 times (chat) and 4 times (encode)", "main",
      "200, 200; one GET of the URL per request; the chat's image encoded once", 10)
def c_url_twice(ctx):
    port = ctx.srv.port
    uuid = "hostile-resources-url-%d" % os.getpid()
    path = "/img/twice-%d" % os.getpid()
    ORIGIN.images[path] = hc.noise_png(64, 64, 17)
    url = ORIGIN.url(path)
    enc0 = metric(port, "fovea_inputs_encoded_total")
    t0 = time.monotonic()
    r1 = post(port, CHAT, hc.chat_body([hc.image_part(url, uuid)] * 16), 10 * ctx.t)
    gets1 = ORIGIN.gets.get(path, 0)
    enc = metric(port, "fovea_inputs_encoded_total") - enc0
    problems = hc.check_ec_reply(ctx, r1, {uuid: list(range(16))})
    r2 = post(port, "/v1/encode", hc.encode_body([url] * 4), 10 * ctx.t)
    dt = time.monotonic() - t0
    gets2 = ORIGIN.gets.get(path, 0) - gets1
    n2 = len(json.loads(r2.body).get("data", [])) if r2.status == 200 else 0
    ok = not problems and enc == 1 and gets1 == 1 and r2.status == 200 and n2 == 4 and gets2 == 1 and dt <= 5 * ctx.t
    return "chat %s (%d GET, encoded %d%s), encode %s (%d items, %d GET) in %.2f s" % (
        r1.describe(), gets1, enc, "; " + "; ".join(problems) if problems else "", r2.describe(), n2, gets2, dt), ok


# ---- a forward's replies (release instance: --max-batch-tokens 16384; no encoder cache) ----------------

def item_timings(r):
    """The timings_ms of a 200 reply's first item, with its forward's image count as "images"."""
    try:
        item = json.loads(r.body)["data"][0]
        return dict(item["timings_ms"], images=item["batch"]["images"])
    except (ValueError, KeyError, IndexError, TypeError):
        return {}


@case("release: a reply leaves when its forward ends, not after the next", "release",
      "X (16 images, a forward of its own) answered before Y (16 images, queued behind X) by at least "
      "half of Y's forward", 20)
def c_forward_release(ctx):
    port, t = ctx.srv.port, ctx.t
    imgs = [hc.data_url(flat_png(256, 80 + i)) for i in range(32)]
    warm = post(port, "/v1/encode", hc.encode_body([imgs[0]]), 10 * t)
    if warm.status != 200:
        return "warm-up encode: %s" % warm.describe(), False
    tries = []
    for attempt in range(2):  # a second try if X did not get a forward of its own, or Y was not queued behind it
        got = {}

        def send(name, req):
            c = hc.Conn(port)
            t0 = time.monotonic()
            c.send(req)
            try:
                got[name] = (c.read_reply(t0 + 10 * t), t0, time.monotonic())
            except NoReply as e:
                got[name] = ("no reply (%s)" % e, t0, time.monotonic())
            finally:
                c.close()
        x = threading.Thread(target=send, args=("X", hc.request("POST", "/v1/encode", hc.encode_body(imgs[:16]))))
        y = threading.Thread(target=send, args=("Y", hc.request("POST", "/v1/encode", hc.encode_body(imgs[16:]))))
        x.start()
        time.sleep(0.05)  # X is decoded and taken alone into a forward (~0.8 s on a 2-core machine)
        y.start()
        x.join(12 * t)
        y.join(12 * t)
        (rx, x0, x1), (ry, _, y1) = got.get("X", ("no result", 0, 0)), got.get("Y", ("no result", 0, 0))
        if not (isinstance(rx, hc.Reply) and rx.status == 200 and isinstance(ry, hc.Reply) and ry.status == 200):
            return "X %s, Y %s" % (describe(rx), describe(ry)), False
        tx, ty = item_timings(rx), item_timings(ry)
        work = sum(tx.get(k, 0) for k in ("decode", "preprocess", "queue", "forward")) / 1000
        yfwd = ty.get("forward", 0) / 1000
        # X's reply is due when its forward ends; held until Y's forward ends, it comes with Y's.
        lead = y1 - x1
        tries.append("X answered %.2f s after sending (decode + queue + forward %.2f s, its forward %s images), "
                     "%.2f s before Y (Y queued %.2f s, its forward %.2f s)" % (
                         x1 - x0, work, tx.get("images"), lead, ty.get("queue", 0) / 1000, yfwd))
        if tx.get("images") == 16 and ty.get("queue", 0) >= 20:
            return "; ".join(tries), lead >= 0.5 * yfwd
    return "inconclusive: %s" % "; ".join(tries), False


# ---- fetch memory (fetch-memory instance: 8 MiB an item, 64 MiB in flight) ---------------------------------

@case("fetch memory: 16 requests x 16 endless URLs, two rounds", "fetch-memory",
      "all 400 invalid_url or 503 server_busy <= 20 s; RSS peak <= start + budget + 128 MiB, "
      "after <= start + 64 MiB; each origin connection cut by 8 + 32 MiB", 60)
def c_fetch_memory(ctx):
    port, t = ctx.srv.port, ctx.t
    item = int(ctx.srv.flag("--max-body-bytes", 0))
    budget = int(ctx.srv.flag("--max-body-bytes-in-flight", 0))
    start = ctx.srv.start_rss_kib
    kinds = ("endless-chunked", "endless-close", "endless-cl")  # a streaming one first
    rounds, problems, sent_all = [], [], []
    for rnd in range(2):
        sent0 = len(ORIGIN.endless_sent)
        fns = []
        for q in range(16):
            urls = [ORIGIN.url("/%s/r%d-q%d-i%d" % (kinds[i % 3], rnd, q, i), q + i) for i in range(16)]
            body = hc.chat_body([hc.image_part(u) for u in urls]) if q % 2 else hc.encode_body(urls)
            fns.append(timed_post(port, CHAT if q % 2 else "/v1/encode", body, 25 * t))
        results = concurrently(fns, 30 * t)
        slowest = max(dt for _, dt in results)
        for res, dt in results:
            okr = isinstance(res, hc.Reply) and (
                (res.status == 400 and res.error_code() == "invalid_url") or
                (res.status == 503 and res.error_code() == "server_busy")) and dt <= 20 * t
            if not okr:
                problems.append("round %d: %s after %.1f s" % (rnd + 1, describe(res), dt))
        capped = sum(1 for res, _ in results if isinstance(res, hc.Reply) and "--max-body-bytes)" in message(res))
        # Until the server has let go of the transfers it cut (bounded: 3 s): VmRSS after the round.
        deadline, rss = time.monotonic() + 3 * t, ctx.srv.rss()
        while rss > start + 64 * 1024 and time.monotonic() < deadline:
            time.sleep(0.1)
            rss = ctx.srv.rss()
        sent = ORIGIN.endless_sent[sent0:]
        sent_all += sent
        rounds.append("round %d: %s (%d capped), slowest %.1f s, VmRSS %.0f MiB, origin sent %.0f MiB on %d "
                      "connections" % (rnd + 1, tally(results), capped, slowest, mib(rss), sum(sent) / MiB, len(sent)))
    hwm, rss = ctx.srv.rss("VmHWM"), ctx.srv.rss()
    peak_bound = start + (budget + 128 * MiB) // 1024
    after_bound = start + 64 * 1024
    most = max(sent_all, default=0)
    obs = ("start %.0f MiB; %s; peak %.0f MiB (bound %.0f), after %.0f MiB (bound %.0f); most sent on one "
           "connection %.1f MiB%s" % (mib(start), "; ".join(rounds), mib(hwm), mib(peak_bound), mib(rss),
                                      mib(after_bound), most / MiB, "; " + "; ".join(problems[:3]) if problems else ""))
    ok = not problems and hwm <= peak_bound and rss <= after_bound and most <= item + 32 * MiB
    return obs, ok


# ---- overload (overload instance: --request-timeout 4) ---------------------------------------------------

@case("deadline: a stalled fetch past --request-timeout", "overload",
      "504 timeout at --request-timeout (+ 1.5 s)", 15)
def c_fetch_deadline(ctx):
    limit = ctx.srv.flag("--request-timeout", 4)
    t0 = time.monotonic()
    r = post(ctx.srv.port, "/v1/encode", hc.encode_body([ORIGIN.url("/stall/deadline-%d" % os.getpid())]),
             limit + 10 * ctx.t)
    dt = time.monotonic() - t0
    return "%s after %.2f s" % (r.describe(), dt), (r.status == 504 and r.error_code() == "timeout" and
                                                    limit - 0.1 <= dt <= limit + 1.5 * ctx.t)


def thread_nices(pid):
    """{thread name: set of nice values} from /proc/PID/task/*/stat."""
    out = {}
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                s = f.read()
            name = s[s.index("(") + 1:s.rindex(")")]
            nice = int(s[s.rindex(")") + 2:].split()[16])
            out.setdefault(re.sub(r"\d+$", "", name) if name.startswith("fovea-worker") else name, set()).add(nice)
    except (OSError, ValueError, IndexError):
        pass
    return out


PROBES = 200


@case("overload: 160 requests x 4 images at once (--request-timeout 4)", "overload",
      ">= 16 x 503 queue_full (Retry-After), median <= 1 s; other non-200s 504, <= 10%; "
      "/health p99 <= 100 ms + a control's p99; workers and encoder at nice +5", 40)
def c_overload(ctx):
    port, t = ctx.srv.port, ctx.t
    limit = ctx.srv.flag("--request-timeout", 4)
    imgs = [hc.data_url(flat_png(256, 40 + i)) for i in range(8)]
    warm = post(port, "/v1/encode", hc.encode_body([imgs[0]]), 10 * t)
    if warm.status != 200:
        return "warm-up encode: %s" % warm.describe(), False
    reqs = [hc.request("POST", "/v1/encode", hc.encode_body([imgs[(q + k) % 8] for k in range(4)]))
            for q in range(160)]
    # GET /health every 25 ms for 5 s (past the last request's deadline) from a process of its own
    # (hostile-client's probe), started now and let go once the burst is sent: taking 160 connections
    # at once is a spike of the network thread's own, not the saturated encoder's.
    probe = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe", str(port), str(PROBES), "25",
                              str(int(1000 * t))], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    time.sleep(0.5)  # its interpreter starts
    box, sent = {}, threading.Event()
    th = threading.Thread(target=lambda: box.update(r=burst(port, reqs, limit + 10 * t, sent=sent)), daemon=True)
    th.start()
    sent.wait(10 * t)
    probe.stdin.write(b"go\n")
    probe.stdin.flush()
    time.sleep(0.3)
    nices = thread_nices(ctx.srv.proc.pid)
    lat = json.loads(probe.communicate(timeout=30 * t)[0])
    th.join(limit + 15 * t)
    results = box.get("r") or []
    replies = [(r, dt) for r, dt in results if isinstance(r, hc.Reply)]
    lost = [r for r, _ in results if not isinstance(r, hc.Reply)]
    early = lambda r: r.status == 503 and r.error_code() == "queue_full" and r.header("retry-after")  # noqa: E731
    n200 = sum(1 for r, _ in replies if r.status == 200)
    q503 = sorted(dt for r, dt in replies if early(r))
    n504 = sum(1 for r, _ in replies if r.status == 504 and r.error_code() == "timeout")
    other = [r.describe() for r, _ in replies if not (r.status == 200 or early(r) or
                                                       (r.status == 504 and r.error_code() == "timeout"))]
    health, health_ok = hc.health_verdict(lat, PROBES, t)
    med503 = statistics.median(q503) if q503 else float("inf")
    t200 = sorted(dt for r, dt in replies if r.status == 200)
    main_nice = nices.get(os.path.basename(ctx.srv.args()[0])[:15], {0})
    bulk = {k: v for k, v in nices.items() if k.startswith("fovea-worker") or k.startswith("fovea-cpu")}
    nice_ok = bool(bulk) and all(v == {min(main_nice) + 5} for v in bulk.values())
    nice_text = ", ".join("%s %s" % (k, "/".join(map(str, sorted(v)))) for k, v in sorted(bulk.items())) or "?"
    obs = ("%d x 200 (last at %.1f s), %d x 503 queue_full (median %.2f s, max %.2f s), %d x 504, %d other%s, "
           "%d lost; %s; nice %s (main thread %s)" % (
               n200, t200[-1] if t200 else 0, len(q503), med503, q503[-1] if q503 else 0, n504, len(other),
               " (%s)" % other[0] if other else "", len(lost), health, nice_text, "/".join(map(str, sorted(main_nice)))))
    ok = (not lost and not other and len(q503) >= 16 and med503 <= 1.0 * t and n504 <= 16 and n200 >= 1 and
          health_ok and nice_ok)
    return obs, ok


# ---- shutdown (shutdown instance: --shutdown-timeout 2, --threads 4, --max-batch-tokens 64) ---------------

@case("shutdown: SIGTERM with 40 slow encodes + 4 unanswered fetches (--shutdown-timeout 2)", "shutdown",
      "every request 200 or 503 shutting_down (the 503s <= timeout + 1.5 s), exit 0 <= timeout + 3 s", 40)
def c_shutdown(ctx):
    srv, t = ctx.srv, ctx.t
    grace = srv.flag("--shutdown-timeout", 25)
    imgs = [hc.data_url(hc.noise_png(256, 256, 60 + i)) for i in range(4)]
    conns, replies = [], []
    deadline = time.monotonic() + 30 * t
    bodies = [hc.encode_body([imgs[(i + k) % 4] for k in range(4)]) for i in range(40)]
    bodies += [hc.encode_body([ORIGIN.url("/stall/shutdown-%d-%d" % (os.getpid(), i))]) for i in range(4)]
    stamps = [None] * len(bodies)
    sigterm = [None]

    def read(i):
        try:
            replies[i] = conns[i].read_reply(deadline)
        except NoReply as e:
            replies[i] = "no reply (%s)" % e
        stamps[i] = time.monotonic()
        conns[i].close()  # as a client does: the server lingers (2 s) on a connection whose client keeps it open
    readers = []
    seen = requests_seen(srv.port)
    for i, body in enumerate(bodies):
        c = hc.Conn(srv.port)
        conns.append(c)
        replies.append(None)
        c.send(hc.request("POST", "/v1/encode", body))
        readers.append(threading.Thread(target=read, args=(i,), daemon=True))
        readers[-1].start()
    # SIGTERM once every request is in the server's hands (an event: on a busy machine reading 44 bodies
    # takes a while, and a request still in the listen queue at exit is reset, not answered).
    while requests_seen(srv.port) < seen + len(bodies) and time.monotonic() < deadline:
        time.sleep(0.01)
    sigterm[0] = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = "still running"
    exited = time.monotonic() - sigterm[0]
    for r in readers:
        r.join(max(0, deadline - time.monotonic()))
    for c in conns:
        c.close()
    late, lost, n200, n503 = [], [], 0, 0
    for i, r in enumerate(replies):
        if isinstance(r, hc.Reply) and r.status == 200:
            n200 += 1
        elif isinstance(r, hc.Reply) and r.status == 503 and r.error_code() == "shutting_down":
            n503 += 1
            if stamps[i] - sigterm[0] > grace + 1.5 * t:
                late.append("%.1f s" % (stamps[i] - sigterm[0]))
        else:
            lost.append(describe(r) if r is not None else "no reply")
    stalled = [describe(r) for r in replies[40:]]
    last = max((s for s in stamps if s), default=sigterm[0]) - sigterm[0]
    obs = ("%d x 200, %d x 503 shutting_down, %d lost%s; unanswered fetches: %s; last reply %.1f s, exit %s %.1f s "
           "after SIGTERM%s" % (n200, n503, len(lost), " (%s)" % lost[0] if lost else "", ", ".join(stalled), last,
                                code, exited, "; late 503s: %s" % ", ".join(late[:3]) if late else ""))
    ok = (not lost and not late and n503 >= 4 and code == 0 and exited <= grace + 3 * t and
          all(s == "503 shutting_down" for s in stalled))
    return obs, ok


# ---- driver -------------------------------------------------------------------------------------------------

def main():
    global ORIGIN, EC_ROOT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fovea", default=os.path.join(HERE, "..", "..", "build", "fovea"), help="the fovea binary")
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--time-scale", type=float, default=1.0, help="factor on every time bound (sanitizer builds), times the busy factor")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--probe", nargs=4, type=int, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.probe:  # hostile-client's /health probe, started once a line arrives on stdin
        sys.stdin.readline()
        hc.probe_main(*opts.probe)
        return 0
    opts.legacy = False
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    hc.GOOD = hc.noise_png(64, 64, 7)
    EC_ROOT = hc.make_ec_root()
    hc.EC_ROOT = EC_ROOT  # hc.tree/check_ec_reply read it; hc.kill_started removes it
    ORIGIN = Origin()
    only = [s.strip().lower() for s in opts.only.split(",") if s.strip()]
    cases = [c for c in CASES if not only or any(s in c[0].lower() for s in only)]
    rows, started = [], time.monotonic()
    for instance, flags in INSTANCES.items():
        mine = [c for c in cases if c[1] == instance]
        if not mine:
            continue
        ctx = hc.Ctx()
        ctx.scale = ctx.t = opts.time_scale
        ctx.srv = Server(opts, instance, flags.format(ec=os.path.join(EC_ROOT, "cache")),
                         cwd=os.path.join(EC_ROOT, "cwd"))
        print("# %s server: %s" % (instance, shlex.join(ctx.srv.args())), flush=True)
        for name, _, expected, bound, f in mine:
            obs, ok, dt = hc.run_case(ctx, name, bound, f)
            died = ctx.srv.died()
            if died and instance != "shutdown":
                obs, ok = "%s; server %s (crash)" % (obs, died), False
                ctx.srv.err.seek(0)
                tail = ctx.srv.err.read().decode(errors="replace").strip().splitlines()[-3:]
                print("#   server stderr: %s" % " / ".join(tail), flush=True)
                ctx.srv.start()
            elif not died:
                try:
                    if hc.get(ctx.srv.port, "/health", 5 * ctx.t).status != 200:
                        raise NoReply("not 200")
                except (NoReply, OSError) as e:
                    obs, ok = "%s; /health afterwards: %s" % (obs, e), False
            rows.append(dict(case=name, expected=expected, observed=obs, ok=ok, seconds=round(dt, 2)))
            print("%-62s | %s | %.1f s | %s" % (name, "ok" if ok else "FAIL", dt, obs), flush=True)
        ctx.srv.stop()
    total = time.monotonic() - started
    if not rows:
        print("hostile-resources: no case matches --only %s" % opts.only, file=sys.stderr)
        return 2

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
            json.dump(dict(rows=rows, seconds=round(total, 1)), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        hc.kill_started()
        if ORIGIN:
            ORIGIN.close()
