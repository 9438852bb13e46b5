"""Hostile clips, made from the ffmpeg command line and a few byte edits (Python standard library only).

Each maker returns the clip's bytes. `make_all(dir)` makes every one, for the hostile-clips suite
(hostile-clips.py), the fuzzers' seeds (`python3 tests/hostile/clips.py fuzz/corpus/video`) and a
reader who wants to see one.

    sample-table bombs: stsz with a constant size claiming 80M samples; an edit list of 2000 edits
                        over 10k samples; a fragment run claiming 80M samples; a chunk table whose
                        count overruns its box
    frame-size lies:    an MKV whose header says 16x16 over 4096x4096 H.264; an AVI saying 16x16 over
                        a 4096x4096 MJPEG frame; an MPEG-TS growing from 64x48 to 2048x2048
    honest clips:       one per container fovea reads; a 2048x2048 H.264 clip; a Matroska clip
                        without DefaultDuration (60 fps); a clip whose last two timestamps are swapped;
                        16x16 at 1000 fps for 200 s (200,000 packets of ~20 bytes)
"""
import os
import struct
import subprocess
import sys
import tempfile

CONTAINERS = {  # extension: ffmpeg arguments for its video stream
    "mp4": ["-c:v", "libx264", "-pix_fmt", "yuv420p"],
    "mov": ["-c:v", "libx264", "-pix_fmt", "yuv420p"],
    "mkv": ["-c:v", "libx264", "-pix_fmt", "yuv420p"],
    "webm": ["-c:v", "libvpx-vp9", "-b:v", "200k"],
    "avi": ["-c:v", "mpeg4", "-q:v", "4"],
    "ts": ["-c:v", "libx264", "-pix_fmt", "yuv420p"],
    "flv": ["-c:v", "libx264", "-pix_fmt", "yuv420p"],
    "ogg": ["-c:v", "libtheora", "-q:v", "5"],
}


def ffmpeg(ext, size, rate, seconds, args, extra=()):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "clip." + ext)
        cmd = ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
               "testsrc2=size=%s:rate=%s:duration=%s" % (size, rate, seconds)] + list(args) + list(extra) + [out]
        subprocess.run(cmd, check=True)
        with open(out, "rb") as f:
            return f.read()


def container(ext, size="64x48", rate=10, seconds=1):
    return ffmpeg(ext, size, rate, seconds, CONTAINERS[ext])


# ---- ISO BMFF boxes ----------------------------------------------------------------------------

BOX_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"moof", b"traf", b"mvex"}


def boxes(data):
    """The boxes of data as [type, payload or children]; containers parsed recursively."""
    out, pos = [], 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        head = 8
        if size == 1:
            size, head = struct.unpack(">Q", data[pos + 8:pos + 16])[0], 16
        elif size == 0:
            size = len(data) - pos
        body = data[pos + head:pos + size]
        out.append([kind, boxes(body) if kind in BOX_CONTAINERS else body])
        pos += size
    return out


def serialize(tree):
    out = b""
    for kind, body in tree:
        payload = serialize(body) if isinstance(body, list) else body
        out += struct.pack(">I4s", 8 + len(payload), kind) + payload
    return out


def find(tree, kind):
    """Every box of that type, depth first, as the [type, body] lists (edit them in place)."""
    found = []
    for box in tree:
        if box[0] == kind:
            found.append(box)
        if isinstance(box[1], list):
            found += find(box[1], kind)
    return found


def mp4_with_moov_last():
    # ffmpeg writes mdat before moov: moov can grow without moving the samples its offsets name.
    return ffmpeg("mp4", "32x32", 10, 1, CONTAINERS["mp4"])


def stsz_bomb():
    """4-5 KB: stsz with constant sample size 1 claims 80M samples (FFmpeg indexes each one)."""
    tree = boxes(mp4_with_moov_last())
    stsz = find(tree, b"stsz")[0]
    stsz[1] = stsz[1][:4] + struct.pack(">II", 1, 80_000_000) + stsz[1][12:]
    return serialize(tree)


def elst_bomb():
    """~60 KB: 10k samples of 1 byte (stsz) and an edit list of 2000 edits each covering all of them."""
    tree = boxes(mp4_with_moov_last())
    stsz = find(tree, b"stsz")[0]
    stsz[1] = stsz[1][:4] + struct.pack(">II", 1, 10_000)
    edits = struct.pack(">I", 0) + struct.pack(">I", 2000) + struct.pack(">IiHH", 1000, 0, 1, 0) * 2000
    trak = find(tree, b"trak")[0]
    trak[1] = [b for b in trak[1] if b[0] != b"edts"]
    trak[1].insert(1, [b"edts", [[b"elst", edits]]])
    tree.append([b"free", bytes(16_000)])  # the 10k samples fit in the file
    return serialize(tree)


def trun_bomb():
    """A fragmented MP4 whose first run claims 80M samples with no per-sample fields."""
    data = ffmpeg("mp4", "32x32", 10, 1, CONTAINERS["mp4"], ["-movflags", "frag_keyframe+empty_moov+default_base_moof"])
    tree = boxes(data)
    trun = find(tree, b"trun")[0]
    trun[1] = struct.pack(">I", 0x000001) + struct.pack(">I", 80_000_000) + trun[1][8:12]
    return serialize(tree)


def stco_overrun():
    """A chunk-offset table listing 500M entries in a few bytes."""
    tree = boxes(mp4_with_moov_last())
    stco = find(tree, b"stco")[0]
    stco[1] = stco[1][:4] + struct.pack(">I", 500_000_000) + stco[1][8:]
    return serialize(tree)


# ---- frame-size lies ---------------------------------------------------------------------------

def mkv_size_lie(size=4096):
    """H.264 frames of size x size in a Matroska file whose header says 16x16."""
    data = bytearray(ffmpeg("mkv", "%dx%d" % (size, size), 10, 0.2, CONTAINERS["mkv"] + ["-preset", "ultrafast"]))
    value = struct.pack(">H", size)
    for element in (b"\xb0\x82", b"\xba\x82"):  # PixelWidth, PixelHeight: 2-byte unsigned
        at = data.find(element + value)
        assert at >= 0, "no %r in the Matroska header" % element
        data[at + 2:at + 4] = struct.pack(">H", 16)
    return bytes(data)


def avi_size_lie(size=4096):
    """An MJPEG frame of size x size in an AVI whose headers (avih, strf) say 16x16."""
    data = bytearray(ffmpeg("avi", "%dx%d" % (size, size), 10, 0.2, ["-c:v", "mjpeg", "-q:v", "31"]))
    avih = data.find(b"avih") + 8
    data[avih + 32:avih + 40] = struct.pack("<II", 16, 16)
    strf = data.find(b"strf") + 8
    data[strf + 4:strf + 12] = struct.pack("<ii", 16, 16)
    return bytes(data)


def ts_grows(size=2048):
    """An MPEG-TS of 64x48 H.264 followed by one of size x size: the stream grows mid-way."""
    small = ffmpeg("ts", "64x48", 10, 1, CONTAINERS["ts"])
    large = ffmpeg("ts", "%dx%d" % (size, size), 10, 0.3, CONTAINERS["ts"] + ["-preset", "ultrafast"])
    return small + large


# ---- honest clips ------------------------------------------------------------------------------

def mkv_without_default_duration():
    """3 s at 60 fps in Matroska with its DefaultDuration element blanked (an EBML Void of the same size)."""
    data = bytearray(container("mkv", rate=60, seconds=3))
    at = data.find(b"\x23\xe3\x83")  # DefaultDuration
    assert at >= 0, "no DefaultDuration"
    size = data[at + 3] & 0x7F  # a 1-byte size (0x80 | n)
    data[at:at + 4 + size] = b"\xec" + bytes([0x80 | (size + 2)]) + bytes(size + 2)  # Void, same length
    return bytes(data)


def swapped_last_pts(size="640x360", rate=30, seconds=20):
    """A clip whose last two frames' timestamps are swapped (pts placement fails at the end: two passes)."""
    frames = int(rate * seconds)
    return ffmpeg("mp4", size, rate, seconds, CONTAINERS["mp4"] + ["-preset", "ultrafast", "-bf", "0"],
                  ["-bsf:v", "setts=pts='if(eq(N,%d),PTS+1,if(eq(N,%d),PTS-1,PTS))'" % (frames - 2, frames - 1)])


def high_fps(seconds=200, rate=1000, size="16x16"):
    """Tiny frames at a high rate: 200,000 packets of ~20 bytes in 5 MB (MP4), within every limit.
    The packets' bookkeeping outweighs their data: refused before issue 45, item 8."""
    return ffmpeg("mp4", size, rate, seconds, CONTAINERS["mp4"])


def make_all(folder):
    os.makedirs(folder, exist_ok=True)
    made = {
        "stsz-bomb.mp4": stsz_bomb(), "elst-bomb.mp4": elst_bomb(), "trun-bomb.mp4": trun_bomb(),
        "stco-overrun.mp4": stco_overrun(), "mkv-size-lie.mkv": mkv_size_lie(256), "avi-size-lie.avi": avi_size_lie(256),
        "ts-grows.ts": ts_grows(256), "no-default-duration.mkv": mkv_without_default_duration(),
    }
    for ext in CONTAINERS:
        made["container." + ext] = container(ext)
    for name, data in made.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return sorted(made)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: clips.py FOLDER  (writes every hostile and honest clip there)")
    print("\n".join(make_all(sys.argv[1])))
