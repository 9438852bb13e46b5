"""The C ABI through the package's ctypes layer, on the CPU reference (no GPU, no torch): numpy only.

Run: FOVEA_ATTN_LIB=build/libfovea_attn.so PYTHONPATH=python python3 -m unittest discover -s python/tests -p 'test_capi*.py'
The oracle is an fp64 attention written here in numpy; inputs are fresh random bf16 values in
ragged segments, read through strided views; outputs start poisoned with NaN.
"""
import ctypes
import ctypes.util
import json
import os
import re
import subprocess
import sys
import tempfile
import tracemalloc
import unittest

import numpy as np

from fovea import _lib, attention as fa

NAN_BF16 = 0x7FC0
HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "include", "fovea", "fovea_attn.h")


def to_bf16(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def from_bf16(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def ref_attention(q, k, v, cu):
    """fp64 attention of [N, H, D] float arrays over segments cu."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    scale = 1.0 / np.sqrt(q.shape[2])
    for a, b in zip(cu[:-1], cu[1:]):
        s = np.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        p = np.exp(s - s.max(axis=2, keepdims=True))
        p /= p.sum(axis=2, keepdims=True)
        out[a:b] = np.einsum("hqk,khd->qhd", p, v[a:b])
    return out


def rel_l2(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


class Batch:
    """Fresh inputs: q in a head-major buffer [H, N, D], k contiguous [N, H, D], v a view of a fused
    [N, 3, H, D] buffer, all bf16; segments ragged."""

    def __init__(self, seqlens, heads=3, head_dim=72, seed=0, scale=(1.0, 1.0, 1.0)):
        rng = np.random.default_rng(seed)
        self.cu = [0] + list(np.cumsum(seqlens))
        n, self.heads, self.head_dim = self.cu[-1], heads, head_dim
        self.n = n
        qf, kf, vf = (rng.standard_normal((n, heads, head_dim)) * s for s in scale)
        self.q_buf = to_bf16(qf.transpose(1, 0, 2))             # [H, N, D]
        self.k_buf = to_bf16(kf)                                # [N, H, D]
        self.fused = np.zeros((n, 3, heads, head_dim), np.uint16)
        self.fused[:, 0], self.fused[:, 1], self.fused[:, 2] = to_bf16(qf), self.k_buf, to_bf16(vf)
        self.q, self.k, self.v = (from_bf16(self.fused[:, w]) for w in range(3))

    def views(self):
        d, h, n = self.head_dim, self.heads, self.n
        q = (self.q_buf.ctypes.data, d, n * d)
        k = (self.k_buf.ctypes.data, h * d, d)
        v = (self.fused.ctypes.data + 2 * h * d * 2, 3 * h * d, d)
        return q, k, v

    def out(self, pad=0):
        buf = np.full((self.n, self.heads * self.head_dim + pad), NAN_BF16, np.uint16)
        return buf, (buf.ctypes.data, self.heads * self.head_dim + pad, self.head_dim)

    def read(self, buf):
        return from_bf16(buf[:, :self.heads * self.head_dim].reshape(self.n, self.heads, self.head_dim))


def run(batch, dtype="bf16", scales=None, pad=0, att=None):
    att = att or fa.Attention(dtype, batch.heads, batch.head_dim, device="cpu")
    att.plan(batch.cu)
    att.prepare(*batch.views(), scales=scales)
    buf, view = batch.out(pad)
    att.attend(view)
    return buf


class Abi(unittest.TestCase):
    def test_version_and_exports_match_the_header(self):
        self.assertEqual(_lib.lib().fovea_attn_abi_version(), _lib.ABI_VERSION)
        with open(HEADER) as f:
            text = f.read()
        self.assertIn(f"#define FOVEA_ATTN_ABI_VERSION {_lib.ABI_VERSION}", text)
        declared = set(re.findall(r"\b(fovea_attn_[a-z0-9_]+)\(", text))
        path = os.environ.get("FOVEA_ATTN_LIB") or ctypes.util.find_library("fovea_attn")
        nm = subprocess.run(["nm", "-D", "--defined-only", path], check=True, capture_output=True, text=True).stdout
        exported = {m.split("@")[0] for m in re.findall(r" T (\S+)", nm)}
        self.assertEqual(exported, declared, "the library exports exactly the header's functions")
        self.assertTrue(all(s.startswith("fovea_attn_") for s in exported))

    def test_missing_library_is_a_clear_import_error(self):
        env = dict(os.environ, FOVEA_ATTN_LIB="/nonexistent/libfovea_attn.so")
        r = subprocess.run([sys.executable, "-c", "from fovea import attention as a; a.Attention('bf16', 1, 64, 'cpu')"],
                           env=env, capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("libfovea_attn.so not found", r.stderr)
        self.assertIn("/nonexistent/libfovea_attn.so: no such file", r.stderr)


class Cpu(unittest.TestCase):
    def test_bf16_views_match_fp64(self):
        for hd in (64, 72, 80, 128):
            b = Batch([37, 130, 1, 64], heads=2, head_dim=hd, seed=hd)
            out = b.read(run(b))
            self.assertFalse(np.isnan(out).any())
            err = rel_l2(out, ref_attention(b.q, b.k, b.v, b.cu))
            self.assertLess(err, 8e-3, f"hd {hd}")

    def test_fp8_static_is_quantized_and_close(self):
        b = Batch([100, 29, 150], seed=3)
        ref = ref_attention(b.q, b.k, b.v, b.cu)
        amax = [float(np.abs(x).max()) for x in (b.q, b.k, b.v)]
        fixed = (ctypes.c_float * 3)(*[a / 448 for a in amax])
        out8 = b.read(run(b, "fp8", fa.Scales(fixed=ctypes.addressof(fixed))))
        out16 = b.read(run(b))
        self.assertFalse(np.isnan(out8).any())
        e8, e16 = rel_l2(out8, ref), rel_l2(out16, ref)
        self.assertLess(e8, 0.08)
        self.assertGreater(e8, 2 * e16, "FP8 must actually quantize")

    def test_fp8_dynamic_records_history_and_matches_static(self):
        b = Batch([64, 90], seed=4, scale=(2.0, 0.5, 3.0))
        state = _lib.AmaxState.from_buffer_copy(fa.fresh_state_bytes())
        att = fa.Attention("fp8", b.heads, b.head_dim, device="cpu")
        dyn = fa.Scales(state=ctypes.addressof(state))
        first = run(b, "fp8", dyn, att=att)
        amax = [float(np.abs(x).max()) for x in (b.q, b.k, b.v)]
        for i in range(3):
            t = state.t[i]
            self.assertEqual((t.filled, t.pos, t.updates, t.nonfinite), (1, 1, 1, 0))
            self.assertEqual(t.ring[0], np.float32(amax[i]))
            self.assertEqual(t.scale, np.float32(np.float32(amax[i]) / np.float32(448)))
        fixed = (ctypes.c_float * 3)(*[state.t[i].scale for i in range(3)])
        static = run(b, "fp8", fa.Scales(fixed=ctypes.addressof(fixed)))
        np.testing.assert_array_equal(first, static)
        for _ in range(17):
            run(b, "fp8", dyn, att=att)
        self.assertEqual((state.t[0].filled, state.t[0].updates, state.t[0].pos), (16, 18, 18 % 16))

    def test_static_guard_switches_a_tight_file_and_counts(self):
        """Scales whose range the batch passes (q at 4x, v at 2x): with guard, the output is that of the
        batch's own scales for q and v (the file's for k) and the caller's counts grow; without, it clips."""
        b = Batch([100, 29, 150], seed=6)
        ref = ref_attention(b.q, b.k, b.v, b.cu)
        amax = [float(np.float32(np.abs(x).max())) for x in (b.q, b.k, b.v)]
        fixed = (ctypes.c_float * 3)(amax[0] / 448 / 4, amax[1] / 448 * 2, amax[2] / 448 / 2)
        counts = (ctypes.c_uint64 * 3)(10, 0, 0)
        guarded = b.read(run(b, "fp8", fa.Scales(fixed=ctypes.addressof(fixed), guard=ctypes.addressof(counts))))
        self.assertEqual(list(counts), [11, 0, 1])
        own = (ctypes.c_float * 3)(np.float32(amax[0]) / np.float32(448), fixed[1], np.float32(amax[2]) / np.float32(448))
        np.testing.assert_array_equal(guarded, b.read(run(b, "fp8", fa.Scales(fixed=ctypes.addressof(own)))))
        clipped = b.read(run(b, "fp8", fa.Scales(fixed=ctypes.addressof(fixed))))
        self.assertGreater(rel_l2(clipped, ref), 2 * rel_l2(guarded, ref))
        state = _lib.AmaxState.from_buffer_copy(fa.fresh_state_bytes())
        with self.assertRaisesRegex(ValueError, "give it with fixed or fine scales"):
            fa.Scales(state=ctypes.addressof(state), guard=ctypes.addressof(counts))

    def test_fused_path_applies_rope(self):
        b = Batch([50, 77], heads=2, head_dim=64, seed=5)
        rng = np.random.default_rng(6)
        ang = rng.uniform(-3, 3, (b.n, b.head_dim // 2)).astype(np.float32)
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        att = fa.Attention("bf16", b.heads, b.head_dim, device="cpu")
        att.plan(b.cu)
        att.prepare_fused(b.fused.ctypes.data, 3 * b.heads * b.head_dim, cos.ctypes.data, sin.ctypes.data)
        buf, view = b.out()
        att.attend(view)
        half = b.head_dim // 2

        def rope(x):
            x1, x2 = x[..., :half], x[..., half:]
            c, s = cos[:, None, :], sin[:, None, :]
            return np.concatenate([np.float32(x1 * c) - np.float32(x2 * s), np.float32(x2 * c) + np.float32(x1 * s)], -1)

        ref = ref_attention(rope(b.q), rope(b.k), b.v, b.cu)
        self.assertLess(rel_l2(b.read(buf), ref), 8e-3)
        # Without tables the fused path is the views path, bit for bit.
        att.prepare_fused(b.fused.ctypes.data, 3 * b.heads * b.head_dim)
        buf2, view2 = b.out()
        att.attend(view2)
        np.testing.assert_array_equal(buf2, run(b))

    def test_strided_output_leaves_the_padding(self):
        b = Batch([20, 33], seed=7)
        padded = run(b, pad=24)
        np.testing.assert_array_equal(padded[:, -24:], NAN_BF16)
        np.testing.assert_array_equal(padded[:, :-24], run(b))


class Errors(unittest.TestCase):
    def assertFails(self, cls, text, fn, *args, **kw):
        with self.assertRaises(cls) as cm:
            fn(*args, **kw)
        self.assertIn(text, str(cm.exception))

    def test_bad_calls_name_the_problem(self):
        b = Batch([10, 12], heads=2, head_dim=64)
        att = fa.Attention("bf16", 2, 64, device="cpu")
        self.assertFails(_lib.FoveaError, "prepare before plan", att.prepare, *b.views())
        self.assertFails(_lib.FoveaError, "cu_seqlens", att.plan, [0, 5, 5, 9])
        att.plan(b.cu)
        self.assertFails(_lib.FoveaError, "attend before prepare", att.attend, b.out()[1])
        self.assertFails(_lib.FoveaUnsupportedError, "1/sqrt(head_dim)", att.prepare, *b.views(), softmax_scale=0.2)
        fixed = (ctypes.c_float * 3)(1, 1, 1)
        self.assertFails(_lib.FoveaError, "FP8 scales given to a BF16", att.prepare, *b.views(),
                         scales=fa.Scales(fixed=ctypes.addressof(fixed)))
        q, k, v = b.views()
        self.assertFails(_lib.FoveaError, "overlap", att.prepare, (q[0], 8, 8), k, v)
        att8 = fa.Attention("fp8", 2, 64, device="cpu")
        att8.plan(b.cu)
        self.assertFails(_lib.FoveaError, "needs static, dynamic, robust static or robust dynamic scales", att8.prepare, *b.views())
        self.assertFails(_lib.FoveaError, "head_dim", fa.Attention, "bf16", 2, 63, device="cpu")
        self.assertFails(_lib.FoveaUnsupportedError, "runs on a GPU", fa.Attention, "bf16", 2, 64, device="cpu",
                         backend="fovea")
        # Segments read on the device: a GPU handle's alone; the calls in their order; sizes checked.
        self.assertFails(_lib.FoveaError, "schedule before plan_capacity", att.schedule, 16, 1)
        self.assertFails(_lib.FoveaError, "layout_error before schedule", att.layout_error)
        self.assertFails(_lib.FoveaError, "max_tokens = 0", att.plan_capacity, 0, 4)
        self.assertFails(_lib.FoveaError, "max_segments = 0", att.plan_capacity, 100, 0)
        self.assertFails(_lib.FoveaError, "max_seqlen = 101", att.plan_capacity, 100, 4, 101)
        self.assertFails(_lib.FoveaUnsupportedError, "need a GPU handle", att.plan_capacity, 100, 4)
        self.assertFails(_lib.FoveaError, "prepare before plan", att.prepare, *b.views())  # the failed plan unplans

    def test_a_gpu_handle_without_a_gpu_says_why(self):
        with self.assertRaises(_lib.FoveaError) as cm:
            fa.Attention("fp8", 16, 72, device=0)
        self.assertRegex(str(cm.exception), "built without CUDA|GPU\\(s\\) visible")


class ScaleFiles(unittest.TestCase):
    def test_round_trip_and_vllm_keys(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "scales.json")
            fa.write_scale_file(p, [[0.5, 0.25, 0.125], [1.0, 2.0, 4.0]])
            self.assertEqual(fa.read_scale_file(p, 2), [[0.5, 0.25, 0.125], [1.0, 2.0, 4.0]])
            self.assertEqual(os.listdir(d), ["scales.json"], "no temporary file left")
            v = os.path.join(d, "vllm.json")
            with open(v, "w") as f:
                json.dump({"visual.blocks.1.attn.attn": {"q_scale": 3.0, "k_scale": 2.0, "v_scale": 1.0},
                           "visual.blocks.0.attn.attn": {"q": 0.5, "k": 0.5, "v": 0.5}}, f)
            self.assertEqual(fa.read_scale_file(v, 2), [[0.5, 0.5, 0.5], [3.0, 2.0, 1.0]])
            with self.assertRaises(_lib.FoveaError) as cm:
                fa.read_scale_file(v, 3)
            self.assertIn("2", str(cm.exception))
            with open(v, "w") as f:
                f.write('{"visual.blocks.0.attn.attn": {"q": -1, "k": 1, "v": 1}}')
            with self.assertRaises(_lib.FoveaError) as cm:
                fa.read_scale_file(v, 1)
            self.assertIn(v, str(cm.exception))
            with self.assertRaises(_lib.FoveaError):
                fa.write_scale_file(p, [[0.5, float("nan"), 1.0]])
            self.assertEqual(fa.read_scale_file(p, 2)[0], [0.5, 0.25, 0.125], "a refused write leaves the file")

    def test_calibration_is_the_scale_books(self):
        rng = np.random.default_rng(8)
        states = []
        for layer in range(2):
            st = _lib.AmaxState.from_buffer_copy(fa.fresh_state_bytes())
            b = Batch([40], heads=1, head_dim=64, seed=layer, scale=(1 + layer, 2, 3))
            att = fa.Attention("fp8", 1, 64, device="cpu")
            for _ in range(int(rng.integers(1, 20))):
                run(b, "fp8", fa.Scales(state=ctypes.addressof(st)), att=att)
            states.append(bytes(st))
        got = fa.calibrated_scales(states, margin=1.5)
        for layer, raw in enumerate(states):
            st = fa.state_from_bytes(raw)
            for i in range(3):
                t = st.t[i]
                want = np.float32(max(t.ring[:t.filled]) / np.float32(448)) * np.float32(1.5)
                self.assertAlmostEqual(got[layer][i], float(want), delta=float(want) * 1e-6)
        with self.assertRaises(_lib.FoveaError) as cm:
            fa.calibrated_scales([states[0], fa.fresh_state_bytes()])
        self.assertIn("1", str(cm.exception))


class Robust(unittest.TestCase):
    """The robust FP8 scheme through the ABI (issue 49): dynamic states, calibration to a file, the plan
    read back from it, and the static arrays it gives, on the CPU reference."""

    @staticmethod
    def outlier_batch(seqlens, seed):
        """Q and K with a large offset on a rotary pair and V with a loud channel, as trained ViTs have."""
        b = Batch(seqlens, heads=2, head_dim=72, seed=seed)
        for w, ch, add, mul in ((0, 3, 12.0, 1.0), (1, 3, 40.0, 1.0), (1, 39, -30.0, 1.0), (2, 7, 0.0, 30.0)):
            x = from_bf16(b.fused[:, w]).copy()
            x[:, :, ch] = x[:, :, ch] * mul + add
            b.fused[:, w] = to_bf16(x)
        b.q, b.k, b.v = (from_bf16(b.fused[:, w]) for w in range(3))
        b.q_buf = np.ascontiguousarray(b.fused[:, 0].transpose(1, 0, 2))
        b.k_buf = np.ascontiguousarray(b.fused[:, 1])
        return b

    def state(self):
        raw = fa.fresh_robust_state(2, 72)
        return np.frombuffer(raw, np.uint8).copy().view(np.float64)  # an 8-byte aligned copy

    def test_robust_dynamic_beats_per_tensor_on_outlier_channels(self):
        b = self.outlier_batch([90, 31, 120], seed=21)
        ref = ref_attention(b.q, b.k, b.v, b.cu)
        st = self.state()
        robust = b.read(run(b, "fp8", fa.Scales(robust_state=st.ctypes.data)))
        amax = [float(np.abs(x).max()) for x in (b.q, b.k, b.v)]
        fixed = (ctypes.c_float * 3)(*[a / 448 for a in amax])
        tensor = b.read(run(b, "fp8", fa.Scales(fixed=ctypes.addressof(fixed))))
        self.assertFalse(np.isnan(robust).any())
        e_robust, e_tensor = rel_l2(robust, ref), rel_l2(tensor, ref)
        self.assertLess(e_robust, 0.5 * e_tensor, (e_robust, e_tensor))
        self.assertLess(e_robust, 0.05)
        fresh = np.frombuffer(fa.fresh_robust_state(2, 72), np.uint8)
        self.assertFalse(np.array_equal(st.view(np.uint8), fresh), "the forward recorded into the state")

    def test_calibration_writes_the_file_the_plan_reads(self):
        states = []
        for layer in range(2):
            st = self.state()
            att = fa.Attention("fp8", 2, 72, device="cpu")
            for i in range(3):
                run(self.outlier_batch([40 + 7 * i, 50], seed=30 + 10 * layer + i), "fp8",
                    fa.Scales(robust_state=st.ctypes.data), att=att)
            states.append(st.tobytes())
        self.assertEqual([fa.robust_state_forwards(s, 2, 72) for s in states], [3, 3])
        self.assertEqual(fa.robust_state_forwards(fa.fresh_robust_state(2, 72), 2, 72), 0)
        with self.assertRaises(ValueError):
            fa.robust_state_forwards(states[0][:-8], 2, 72)
        with self.assertRaisesRegex(_lib.FoveaError, "robust state"):
            fa.robust_state_forwards(bytes([states[0][0] ^ 0xFF]) + states[0][1:], 2, 72)  # the header's magic
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "scales.json")
            fa.robust_calibrate(states, 2, 72, path, margin=1.5)
            with open(path) as f:
                text = json.load(f)
            self.assertEqual(len(text), 2)
            plan = fa.fp8_plan("robust", 2, 2, 72, path=path)
            self.assertEqual(plan["modes"], ["robust_static", "robust_static"])
            fine = plan["fine"][1]
            self.assertEqual([len(fine[k]) for k in ("k_mean", "q_head", "k_head", "v_channel", "qk_split")],
                             [144, 2, 2, 144, 12])
            self.assertTrue(all(x > 0 for x in fine["q_head"] + fine["v_channel"]))
            arrays = [np.array(fine[k], np.float32) for k in ("k_mean", "q_head", "k_head", "v_channel")]
            split = np.array(fine["qk_split"], np.int32)
            b = self.outlier_batch([60, 45], seed=99)  # held out from calibration
            out = b.read(run(b, "fp8", fa.Scales(fine=[a.ctypes.data for a in arrays] + [split.ctypes.data])))
            self.assertFalse(np.isnan(out).any())
            self.assertLess(rel_l2(out, ref_attention(b.q, b.k, b.v, b.cu)), 0.05)
            auto = fa.fp8_plan("auto", 2, 2, 72, path=path)
            self.assertEqual(len(auto["modes"]), 2)
            self.assertTrue(set(auto["modes"]) <= {"static", "robust_static"})
            self.assertEqual(fa.fp8_plan("tensor", 2, 2, 72, path=path)["modes"], ["static", "static"])
            self.assertEqual(fa.fp8_plan("tensor", 2, 2, 72, path=path)["qkv"], plan["qkv"])
            with self.assertRaises(_lib.FoveaError) as cm:
                fa.fp8_plan("robust", 2, 4, 72, path=path)
            self.assertIn("layer 0's fine scales are for 2 heads", str(cm.exception))
            with self.assertRaises(_lib.FoveaError) as cm:
                fa.robust_calibrate([states[0], fa.fresh_robust_state(2, 72)], 2, 72, os.path.join(d, "x.json"))
            self.assertIn("layer 1", str(cm.exception))
            self.assertEqual(sorted(os.listdir(d)), ["scales.json"], "nothing half-written")
        self.assertEqual(fa.fp8_plan("auto", 3, 2, 72)["modes"], ["dynamic"] * 3)
        self.assertEqual(fa.fp8_plan("auto", 3, 2, 72, calibrating=True)["modes"], ["robust_dynamic"] * 3)
        self.assertEqual(fa.fp8_plan("robust", 1, 2, 64)["modes"], ["robust_dynamic"])

    def test_the_vllm_plugin_reads_a_static_file_once_per_model(self):
        """fovea.vllm (importable without torch or vLLM) builds each layer's static scales from one parse
        of the file: fovea's reader and plan run once for all the model's layers, again only once the
        file changes."""
        from fovea import vllm as fv
        states = []
        for layer in range(3):
            st = self.state()
            att = fa.Attention("fp8", 2, 72, device="cpu")
            run(self.outlier_batch([40, 50 + layer], seed=60 + layer), "fp8", fa.Scales(robust_state=st.ctypes.data),
                att=att)
            states.append(st.tobytes())
        calls = {"read_scale_file": 0, "fp8_plan": 0}
        real = {name: getattr(fa, name) for name in calls}

        def counting(name):
            def call(*args, **kwargs):
                calls[name] += 1
                return real[name](*args, **kwargs)
            return call
        old_scheme = os.environ.get("FOVEA_FP8_SCHEME")
        os.environ["FOVEA_FP8_SCHEME"] = "robust"
        try:
            for name in calls:
                setattr(fa, name, counting(name))
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "scales.json")
                fa.robust_calibrate(states, 2, 72, path)
                names = ["visual.blocks.%d.attn.attn" % i for i in range(3)]
                qkv = [fv._layer_scales(path, n) for n in names]
                fine = [fv._layer_fine(path, n, 2, 72) for n in names]
                self.assertEqual(calls, {"read_scale_file": 1, "fp8_plan": 1})
                self.assertEqual(qkv, real["read_scale_file"](path, 3))
                plan = real["fp8_plan"]("robust", 3, 2, 72, path=path)
                self.assertEqual(fine, plan["fine"])
                with self.assertRaisesRegex(ValueError, "no entry for layer visual.blocks.7.attn.attn"):
                    fv._layer_scales(path, "visual.blocks.7.attn.attn")
                fa.robust_calibrate(states[:2], 2, 72, path)  # a new file at the same path is read anew
                self.assertEqual(len(fv._layer_scales(path, names[1])), 3)
                self.assertEqual(calls["read_scale_file"], 2)
                with self.assertRaisesRegex(ValueError, "no entry for layer"):
                    fv._layer_scales(path, names[2])
        finally:
            for name in calls:
                setattr(fa, name, real[name])
            if old_scheme is None:
                os.environ.pop("FOVEA_FP8_SCHEME", None)
            else:
                os.environ["FOVEA_FP8_SCHEME"] = old_scheme

    def test_bad_robust_arguments_name_the_problem(self):
        with self.assertRaises(ValueError):
            fa.Scales(fixed=8, robust_state=16)
        with self.assertRaises(ValueError):
            fa.Scales(fine=[8, 16])
        with self.assertRaises(ValueError):
            fa.robust_state_bytes(0, 72)
        with self.assertRaises(_lib.FoveaError) as cm:
            fa.fp8_plan("fastest", 2, 2, 72)
        self.assertIn("'fastest' is not one of auto, tensor, robust", str(cm.exception))
        b = Batch([20, 9], heads=2, head_dim=72, seed=7)
        st = self.state()
        st.view(np.int32)[1] = 5  # the header's heads
        before = st.copy()
        with self.assertRaises(_lib.FoveaError) as cm:
            run(b, "fp8", fa.Scales(robust_state=st.ctypes.data))
        self.assertEqual(cm.exception.status, _lib.INVALID)
        self.assertIn("a robust state for 5 heads of 72, not 2 of 72", str(cm.exception))
        np.testing.assert_array_equal(st, before)
        self.assertEqual(fa.split_pairs(72), 6)
        self.assertEqual(fa.split_pairs(64), 8)  # the robust rows one K step wider
        self.assertEqual(fa.split_pairs(128), 8)


class Hostile(unittest.TestCase):
    """Issue 45: the C ABI and this layer trust no caller. Each case names the argument or field, and
    writes nothing out of bounds (states and outputs sit between poisoned guards)."""

    POISON = 0xDEADBEEF

    def assertRefused(self, cls, text, fn, *args, **kw):
        with self.assertRaises(cls) as cm:
            fn(*args, **kw)
        self.assertIn(text, str(cm.exception))
        if issubclass(cls, _lib.FoveaError):
            self.assertEqual(cm.exception.status, _lib.INVALID, str(cm.exception))
        return cm.exception

    def test_ints_that_do_not_fit_int32_are_refused_not_truncated(self):
        att = fa.Attention("bf16", 2, 64, device="cpu")
        e = self.assertRefused(_lib.RangeError, "cu_seqlens[1] = 4294967301 does not fit int32", att.plan, [0, 2 ** 32 + 5])
        self.assertIsInstance(e, ValueError)
        self.assertIsInstance(e, OverflowError)
        self.assertIsNone(att.cu_seqlens, "nothing was planned (ctypes would have planned 5 tokens)")
        self.assertRefused(_lib.RangeError, "cu_seqlens[2] = -2147483649 does not fit int32", att.plan, [0, 4, -2 ** 31 - 1])
        self.assertRefused(TypeError, "cu_seqlens[1] must be an integer", att.plan, [0, 5.7])
        self.assertRefused(_lib.RangeError, "stream = 18446744073709551616 is not an address", att.plan, [0, 5], stream=2 ** 64)
        # What fits int32 is the library's to check, entry by entry.
        self.assertRefused(_lib.FoveaError, "cu_seqlens[2] = 3 is not above cu_seqlens[1] = 5", att.plan, [0, 5, 3])
        self.assertRefused(_lib.RangeError, "heads = 4294967298 does not fit int32", fa.Attention, "bf16", 2 ** 32 + 2, 64, "cpu")
        self.assertRefused(_lib.RangeError, "head_dim = -2147483650", fa.Attention, "bf16", 2, -2 ** 31 - 2, "cpu")
        self.assertRefused(_lib.RangeError, "device = 4294967296 does not fit int32", fa.Attention, "bf16", 2, 64, 2 ** 32)
        self.assertRefused(TypeError, "heads must be an integer", fa.Attention, "bf16", 2.5, 64, "cpu")

    def test_head_sizes_whose_product_overflows_are_refused_at_create(self):
        # 2^30 x 2^30 fits int32 twice; the library's sizes wrapped to 0 and prepare wrote into them.
        self.assertRefused(_lib.FoveaError, "heads x head_dim = 1073741824 x 1073741824", fa.Attention, "bf16", 2 ** 30, 2 ** 30,
                           "cpu")
        att = fa.Attention("bf16", 2 ** 15, 2 ** 15, device="cpu")
        self.assertRefused(_lib.FoveaError, "cu_seqlens[1] = 2147483647 tokens of 32768 heads x 32768", att.plan, [0, 2 ** 31 - 1])

    def test_views_pointers_and_strides_are_range_checked(self):
        b = Batch([5, 9], heads=2, head_dim=64)
        att = fa.Attention("bf16", 2, 64, device="cpu")
        att.plan(b.cu)
        q, k, v = b.views()
        self.assertRefused(_lib.RangeError, "q.stride_token = 9223372036854775808 does not fit int64", att.prepare,
                           (q[0], 2 ** 63, q[2]), k, v)
        self.assertRefused(_lib.RangeError, "k.data = -1 is not an address", att.prepare, q, (-1, k[1], k[2]), v)
        self.assertRefused(_lib.RangeError, "v.data = 18446744073709551616 is not an address", att.prepare, q, k, (2 ** 64, v[1], v[2]))
        self.assertRefused(_lib.RangeError, "token_stride = 18446744073709552000 does not fit int64", att.prepare_fused,
                           b.fused.ctypes.data, 2 ** 64 + 384)
        self.assertRefused(_lib.RangeError, "rope_cos = -8 is not an address", att.prepare_fused, b.fused.ctypes.data, 384, -8, 8)
        # Within int64, the library checks the extent: 13 tokens x 2^62 elements wraps.
        self.assertRefused(_lib.FoveaError, "qkv: 14 tokens at stride_token 4611686018427387904", att.prepare_fused,
                           b.fused.ctypes.data, 2 ** 62)
        att.prepare(q, k, v)
        guard = 256
        buf = np.full(14 * 128 + 2 * guard, NAN_BF16, np.uint16)
        out = buf.ctypes.data + 2 * guard
        self.assertRefused(_lib.FoveaError, "out: 14 tokens at stride_token 2305843009213693952", att.attend, (out, 2 ** 61, 64))
        self.assertRefused(_lib.RangeError, "out.stride_head = -9223372036854775809", att.attend, (out, 128, -2 ** 63 - 1))
        np.testing.assert_array_equal(buf, NAN_BF16, "a refused output is not written")
        att.attend((out, 128, 64))
        np.testing.assert_array_equal(buf[:guard], NAN_BF16)
        np.testing.assert_array_equal(buf[-guard:], NAN_BF16)
        self.assertFalse(np.isnan(from_bf16(buf[guard:-guard])).any())

    def guarded_state(self):
        """A fresh state inside a poisoned uint32 buffer: (buffer, AmaxState over its middle)."""
        words = fa.STATE_BYTES // 4
        buf = np.full(32 + words + 32, self.POISON, np.uint32)
        buf[32:32 + words] = np.frombuffer(fa.fresh_state_bytes(), np.uint32)
        return buf, _lib.AmaxState.from_buffer(buf, 32 * 4)

    def test_corrupt_dynamic_state_is_refused_and_not_written(self):
        b = Batch([5, 9], heads=2, head_dim=64, seed=9)
        att = fa.Attention("fp8", 2, 64, device="cpu")
        att.plan(b.cu)
        cases = [  # (tensor, field, value, message)
            (1, "pos", 2 ** 30, "amax_state.t[1].pos (k's ring position) = 1073741824 is outside [0, 16)"),  # was SIGSEGV
            (0, "pos", 17, "amax_state.t[0].pos (q's ring position) = 17 is outside [0, 16)"),  # overwrote `filled`
            (2, "pos", -1, "amax_state.t[2].pos (v's ring position) = -1 is outside [0, 16)"),
            (2, "filled", 17, "amax_state.t[2].filled (v's fill count) = 17 is outside [0, 16]"),
            (0, "filled", -5, "amax_state.t[0].filled (q's fill count) = -5 is outside [0, 16]"),
        ]
        for fused in (False, True):
            for tensor, field, value, message in cases:
                with self.subTest(field=field, value=value, fused=fused):
                    buf, state = self.guarded_state()
                    setattr(state.t[tensor], field, value)
                    before = buf.copy()
                    scales = fa.Scales(state=ctypes.addressof(state))
                    if fused:
                        self.assertRefused(_lib.FoveaError, message, att.prepare_fused, b.fused.ctypes.data,
                                           3 * b.heads * b.head_dim, scales=scales)
                    else:
                        self.assertRefused(_lib.FoveaError, message, att.prepare, *b.views(), scales=scales)
                    np.testing.assert_array_equal(buf, before, "neither the state nor its guards were written")
        buf, state = self.guarded_state()
        state.t[0].ring[0] = float("nan")
        state.t[0].pos = state.t[0].filled = 1
        self.assertRefused(_lib.FoveaError, "amax_state.t[0].ring[0] (q's amax) = nan", att.prepare, *b.views(),
                           scales=fa.Scales(state=ctypes.addressof(state)))
        buf, state = self.guarded_state()
        run(b, "fp8", fa.Scales(state=ctypes.addressof(state)), att=att)
        self.assertEqual([(t.pos, t.filled) for t in state.t], [(1, 1)] * 3)
        np.testing.assert_array_equal(buf[:32], self.POISON)
        np.testing.assert_array_equal(buf[-32:], self.POISON)

    def test_calibration_refuses_a_corrupt_state_naming_the_layer(self):
        good = fa.fresh_state_bytes()
        st = fa.state_from_bytes(good)
        for t in st.t:
            t.ring[0], t.pos, t.filled = 448.0, 1, 1
        bad = fa.state_from_bytes(bytes(st))
        bad.t[2].pos = 2 ** 30
        self.assertRefused(_lib.FoveaError, "states[1].t[2].pos (v's ring position) = 1073741824", fa.calibrated_scales,
                           [bytes(st), bytes(bad)])
        self.assertRefused(_lib.RangeError, "the number of layers (states) = 0 is outside [1, 4096]", fa.calibrated_scales, [])

    def test_an_absurd_layer_count_is_refused_before_allocating(self):
        with open(HEADER) as f:
            self.assertIn(f"#define FOVEA_ATTN_MAX_LAYERS {_lib.MAX_LAYERS}\n", f.read())
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "scales.json")
            fa.write_scale_file(p, [[0.5, 0.25, 0.125]])
            tracemalloc.start()
            try:
                for n in (10 ** 9, 2 ** 40, _lib.MAX_LAYERS + 1, 0, -1):
                    with self.subTest(n=n):
                        self.assertRefused(_lib.RangeError, f"num_layers = {n} is outside [1, 4096]", fa.read_scale_file, p, n)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            self.assertLess(peak, 1 << 20, "refused before the result was allocated (10^9 layers: 12 GB)")
            # The largest count the library takes gets to the library (which finds the file lacks layers).
            with self.assertRaises(_lib.FoveaError) as cm:
                fa.read_scale_file(p, _lib.MAX_LAYERS)
            self.assertEqual(cm.exception.status, _lib.RUNTIME)
            self.assertRefused(TypeError, "num_layers must be an integer", fa.read_scale_file, p, 2.0)


if __name__ == "__main__":
    unittest.main()
