"""fovea.torch and fovea.transformers on a GPU (torch and transformers installed; FP8 needs Hopper); fovea.vllm
is tested in test_vllm_double.py.

    FOVEA_ATTN_LIB=build/libfovea_attn.so PYTHONPATH=python python3 -m unittest python/tests/test_torch_gpu.py -v
The oracles: fp64 attention (torch, per segment), the CPU emulation of the same kernel through the same
op (CPU tensors run the reference), and transformers' own fp32 run. Bounds are the C++ GPU tests':
error vs fp64 within 2x the emulation's (+1e-3 rel, +1e-2 abs), and within a quarter of it of the emulation.
"""
import copy
import itertools
import json
import os
import tempfile
import unittest

import torch

import fovea.torch as ft

CUDA = torch.device("cuda")
SEGMENTS = [1, 130, 777, 64, 1500]


def inputs(seqlens, heads, hd, seed, scale=(1.0, 1.0, 1.0)):
    """q, k contiguous [N, H, D]; v a strided view of a fused [N, 3, H, D] buffer (as transformers and vLLM pass it)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(seqlens)
    fused = torch.randn(n, 3, heads, hd, device=CUDA, generator=g)
    for i, s in enumerate(scale):
        fused[:, i] *= s
    fused = fused.to(torch.bfloat16)
    q, k = fused[:, 0].contiguous(), fused[:, 1].contiguous()
    cu = torch.tensor([0] + list(itertools.accumulate(seqlens)), dtype=torch.int32, device=CUDA)
    return q, k, fused[:, 2], cu


def ref64(q, k, v, cu):
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    c = cu.tolist()
    for a, b in zip(c[:-1], c[1:]):
        x = [t[a:b].double().transpose(0, 1) for t in (q, k, v)]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(*x).transpose(0, 1)
    return out


def stats(out, ref):
    d = out.double() - ref
    return (d.norm() / ref.norm()).item(), d.abs().max().item()


def on_cpu(fn, q, k, v, cu, **kw):
    """The same op on CPU tensors: the kernel's emulation (fovea's CPU reference)."""
    kw = {a: (b.cpu().clone() if torch.is_tensor(b) else b) for a, b in kw.items()}
    return fn(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), **kw), kw


class Checks:
    """The GPU-vs-oracles rule, shared by the test classes (a mixin, so no class inherits another's tests)."""

    def check(self, what, out, emu, ref):
        self.assertFalse(out.isnan().any().item(), what)
        g_rel, g_max = stats(out, ref)
        e_rel, e_max = stats(emu.to(CUDA), ref)
        ve_rel, _ = stats(out, emu.to(CUDA).double())
        print(f"{what:32s} gpu rel {g_rel:.3e} max {g_max:.3e} | emu rel {e_rel:.3e} | gpu-vs-emu rel {ve_rel:.3e}")
        self.assertLessEqual(g_rel, 2 * e_rel + 1e-3, what)
        self.assertLessEqual(g_max, 2 * e_max + 1e-2, what)
        self.assertLessEqual(ve_rel, 0.25 * e_rel, what)


class Op(Checks, unittest.TestCase):
    def test_bf16_and_fp8_against_fp64_and_emulation(self):
        for hd in (64, 72, 80, 128):
            q, k, v, cu = inputs(SEGMENTS, 4, hd, seed=hd, scale=(1.0, 2.0, 0.5))
            ref = ref64(q, k, v, cu)
            out = ft.varlen_attention(q, k, v, cu)
            emu, _ = on_cpu(ft.varlen_attention, q, k, v, cu)
            self.check(f"bf16 hd {hd}", out, emu, ref)
            sdpa = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                *[t[a:b].transpose(0, 1) for t in (q, k, v)]).transpose(0, 1) for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])])
            self.assertLessEqual(stats(out, ref)[0], 1.5 * stats(sdpa, ref)[0] + 1e-4, f"bf16 hd {hd} vs SDPA's error")
            # FP8 dynamic: one forward from a fresh state, the GPU's state vs the emulation's.
            book = ft.ScaleBook(1, "dynamic", device=CUDA)
            emu8, kw = on_cpu(ft.varlen_attention, q, k, v, cu, amax_state=book.amax_state[0].clone())
            out8 = ft.varlen_attention(q, k, v, cu, **book.layer(0))
            self.check(f"fp8 dynamic hd {hd}", out8, emu8, ref)
            self.assertTrue(torch.equal(book.amax_state[0].cpu(), kw["amax_state"]), "device state == emulation's state")
            st = book.states()[0]
            self.assertEqual([st.t[i].filled for i in range(3)], [1, 1, 1])
            self.assertAlmostEqual(st.t[1].ring[0], k.abs().max().item(), places=6)
            # FP8 static: the scales dynamic scaling chose, as a file would give them.
            descale = torch.tensor([st.t[i].scale for i in range(3)], device=CUDA)
            out_s = ft.varlen_attention(q, k, v, cu, descale=descale)
            self.assertTrue(torch.equal(out_s, out8), "static with the same scales == dynamic")

    def test_fused_qkv_entry_applies_rope(self):
        n_seg = [300, 5, 200]
        for hd in (72, 128):
            q, k, v, cu = inputs(n_seg, 4, hd, seed=11 + hd)
            qkv = torch.stack([q, k, v], dim=1)
            g = torch.Generator(device="cuda").manual_seed(hd)
            ang = torch.rand(q.shape[0], hd // 2, device=CUDA, generator=g) * 6 - 3
            cos, sin = ang.cos(), ang.sin()

            def rope(x):  # transformers' formula, fp32, unfused
                x = x.float()
                x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
                c, s = cos[:, None], sin[:, None]
                return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

            ref = ref64(rope(q), rope(k), v, cu)
            out = ft.varlen_attention_qkv(qkv, cu, cos, sin)
            emu, _ = on_cpu(lambda *a, **kw: ft.varlen_attention_qkv(torch.stack(a[:3], 1), a[3], cos.cpu(), sin.cpu(), **kw),
                            q, k, v, cu)
            self.check(f"fused bf16 hd {hd}", out, emu, ref)
            # RoPE'd in fp32 and rounded once: what transformers' RoPE then bf16 gives, bit for bit.
            self.assertTrue(torch.equal(out, ft.varlen_attention(rope(q).bfloat16(), rope(k).bfloat16(), v, cu)))
            book = ft.ScaleBook(1, "dynamic", device=CUDA)
            emu8, kw = on_cpu(lambda *a, **kw: ft.varlen_attention_qkv(torch.stack(a[:3], 1), a[3], cos.cpu(), sin.cpu(), **kw),
                              q, k, v, cu, amax_state=book.amax_state[0].clone())
            out8 = ft.varlen_attention_qkv(qkv, cu, cos, sin, **book.layer(0))
            self.check(f"fused fp8 dynamic hd {hd}", out8, emu8, ref)
            self.assertTrue(torch.equal(book.amax_state[0].cpu(), kw["amax_state"]), "device state == emulation's state")
        with self.assertRaisesRegex(ValueError, "rope_cos must be"):
            ft.varlen_attention_qkv(qkv, cu, cos[:, :10].contiguous(), sin)
        with self.assertRaisesRegex(ValueError, "both RoPE tables"):
            ft.varlen_attention_qkv(qkv, cu, cos, None)

    def test_strided_head_major_inputs_and_padding_segments(self):
        q, k, v, cu = inputs([300, 5, 200], 16, 72, seed=7)
        qh = q.transpose(0, 1).contiguous().transpose(0, 1)  # head-major memory, [N, H, D] view
        padded = torch.cat([cu, cu[-1:].repeat(3)])          # vLLM's CUDA-graph padding: empty segments
        out = ft.varlen_attention(qh, k, v, padded)
        self.assertTrue(torch.equal(out, ft.varlen_attention(q, k, v, cu)))

    def test_errors_are_clear(self):
        q, k, v, cu = inputs([64], 2, 72, seed=1)
        with self.assertRaisesRegex(TypeError, "bfloat16"):
            ft.varlen_attention(q.float(), k, v, cu)
        with self.assertRaisesRegex(ValueError, "token count"):  # offsets on the host are checked there
            ft.varlen_attention(q, k, v, torch.tensor([0, 63], dtype=torch.int32))
        with self.assertRaisesRegex(ft.FoveaUnsupportedError, "1/sqrt"):
            ft.varlen_attention(q, k, v, cu, softmax_scale=0.5)
        with self.assertRaisesRegex(ft.FoveaUnsupportedError, "head_dim"):
            ft.varlen_attention(*(x[..., :48].contiguous() for x in (q, k, v)), cu, descale=torch.ones(3, device=CUDA))

    def test_opcheck(self):
        q, k, v, cu = inputs([40, 90], 2, 72, seed=2)
        torch.library.opcheck(torch.ops.fovea.varlen_attention.default, (q, k, v, cu, None, 0.0))
        torch.library.opcheck(torch.ops.fovea.varlen_attention.default, (q, k, v, cu, torch.full((3,), 0.01, device=CUDA), 0.0))
        book = ft.ScaleBook(1, "dynamic", device=CUDA)
        torch.library.opcheck(torch.ops.fovea.varlen_attention_dynamic.default, (q, k, v, cu, book.amax_state[0], 0.0))
        qkv = torch.stack([q, k, v], dim=1)
        cos, sin = torch.rand(2, q.shape[0], 36, device=CUDA).unbind(0)
        torch.library.opcheck(torch.ops.fovea.varlen_attention_qkv.default, (qkv, cu, cos, sin, None))
        torch.library.opcheck(torch.ops.fovea.varlen_attention_qkv.default, (qkv, cu, None, None, torch.full((3,), 0.01, device=CUDA)))
        torch.library.opcheck(torch.ops.fovea.varlen_attention_qkv_dynamic.default, (qkv, cu, cos, sin, book.amax_state[0]))
        tight = torch.full((3,), 1e-4, device=CUDA)  # the guard switches all three
        guard = torch.zeros(3, dtype=torch.int64, device=CUDA)
        torch.library.opcheck(torch.ops.fovea.varlen_attention_guarded.default, (q, k, v, cu, tight, guard, 0.0))
        torch.library.opcheck(torch.ops.fovea.varlen_attention_qkv_guarded.default, (qkv, cu, cos, sin, tight, guard))

    def test_compile_fullgraph(self):
        q, k, v, cu = inputs([333, 100], 16, 72, seed=3)

        tight = torch.full((3,), 1e-4, device=CUDA)  # the guard switches all three

        def f(q, k, v, cu, state, guard):
            a = ft.varlen_attention(q * 1.0, k, v, cu)
            b = ft.varlen_attention(q, k, v, cu, amax_state=state)
            c = ft.varlen_attention(q, k, v, cu, descale=tight, guard=guard)
            return a.float() + b.float() + c.float()

        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True)
        s_eager, s_comp = (ft.ScaleBook(1, "dynamic", device=CUDA) for _ in range(2))
        g_eager, g_comp = (torch.zeros(3, dtype=torch.int64, device=CUDA) for _ in range(2))
        for _ in range(3):
            want = f(q, k, v, cu, s_eager.amax_state[0], g_eager)
            got = compiled(q, k, v, cu, s_comp.amax_state[0], g_comp)
        self.assertTrue(torch.equal(got, want))
        self.assertTrue(torch.equal(s_eager.amax_state, s_comp.amax_state), "the compiled graph mutates the state")
        self.assertEqual(s_comp.states()[0].t[0].updates, 3)
        self.assertEqual(g_comp.tolist(), [3, 3, 3], "the compiled graph counts the guard")
        self.assertEqual(g_eager.tolist(), [3, 3, 3])

    def test_cuda_graph_replays_dynamic_scaling(self):
        q, k, v, cu = inputs([500, 250], 16, 72, seed=4)
        qs, ks, vs = q.clone(), k.clone(), v.clone()
        book, twin = ft.ScaleBook(1, "dynamic", device=CUDA), ft.ScaleBook(1, "dynamic", device=CUDA)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture: plans the shape
            ft.varlen_attention(qs, ks, vs, cu, amax_state=book.amax_state[0])
        torch.cuda.current_stream().wait_stream(stream)
        book.amax_state.copy_(twin.amax_state)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ft.varlen_attention(qs, ks, vs, cu, amax_state=book.amax_state[0])
        for step, scale in enumerate((1.0, 3.0, 0.25, 2.0)):
            qs.copy_(q * scale), ks.copy_(k * scale), vs.copy_(v * scale)
            graph.replay()
            want = ft.varlen_attention(q * scale, k * scale, (v * scale), cu, amax_state=twin.amax_state[0])
            self.assertTrue(torch.equal(out, want), f"replay {step}")
            self.assertTrue(torch.equal(book.amax_state, twin.amax_state), f"state after replay {step}")
        self.assertEqual(book.states()[0].t[2].filled, 4)

    def test_cuda_graph_replays_any_layout_from_device_offsets(self):
        """One capture on a device cu_seqlens buffer of 9 entries and 2048 tokens; each replay takes the layout
        copied in as vLLM's graph manager does (zeroed, then the real offsets at its front): rows of the layout
        match fp64 and the emulation under the usual rule, rows past it are zeros, and nothing is read back."""
        import random
        rng = random.Random(11)
        n, heads, hd = 2048, 16, 72
        g = torch.Generator(device="cuda").manual_seed(12)
        q, k, v = (torch.randn(n, heads, hd, device=CUDA, generator=g).bfloat16() for _ in range(3))
        for fp8 in (False, True):
            descale = torch.tensor([x.abs().max().item() / 448 * 1.5 for x in (q, k, v)], dtype=torch.float32,
                                   device=CUDA) if fp8 else None
            buf = torch.tensor([0, 300, 700, 2048] + [2048] * 5, dtype=torch.int32, device=CUDA)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture: plans the capacity
                ft.varlen_attention(q, k, v, buf, descale=descale)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ft.varlen_attention(q, k, v, buf, descale=descale)
            for step in range(12):
                lens = [rng.randint(1, 700) for _ in range(rng.randint(1, 8))]
                while sum(lens) > n:
                    lens.pop()
                cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=CUDA)
                buf.zero_()
                buf[: cu.numel()].copy_(cu)
                graph.replay()
                t = int(cu[-1])
                what = f"{'fp8' if fp8 else 'bf16'} replay {step} {lens}"
                kw = {} if descale is None else {"descale": descale}
                emu, _ = on_cpu(ft.varlen_attention, q[:t], k[:t], v[:t], cu, **kw)
                self.check(what, out[:t], emu, ref64(q[:t], k[:t], v[:t], cu))
                self.assertTrue(bool((out[t:] == 0).all()), f"{what}: rows past the layout are not zeros")

    def test_scale_book_static_and_calibration(self):
        q, k, v, cu = inputs([200, 300], 16, 72, seed=5)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "scales.json")
            cal = ft.ScaleBook(2, "calibrate", path, device=CUDA)
            for i in range(16):
                self.assertFalse(os.path.exists(path))
                for layer in range(2):
                    ft.varlen_attention(q * (1 + i % 3), k, v, cu, **cal.layer(layer))
                saved = cal.maybe_save()
            self.assertTrue(saved)
            with open(path) as f:
                data = json.load(f)
            self.assertEqual(sorted(data), ["visual.blocks.0.attn.attn", "visual.blocks.1.attn.attn"])
            self.assertAlmostEqual(data["visual.blocks.0.attn.attn"]["q"], 3 * q.abs().max().item() / 448 * 1.5, places=6)
            static = ft.ScaleBook(2, "static", path, device=CUDA)
            self.assertEqual(static.descale.shape, (2, 3))
            ft.varlen_attention(q, k, v, cu, **static.layer(1))
            self.assertEqual(static.guarded(), [[0, 0, 0], [0, 0, 0]])  # within the calibrated range
            ft.varlen_attention(q * 10, k, v, cu, **static.layer(1))   # q past it: guarded, counted
            self.assertEqual(static.guarded(), [[0, 0, 0], [1, 0, 0]])
            self.assertNotIn("guard", ft.ScaleBook(2, "static", path, device=CUDA, guard=False).layer(0))

    def test_static_guard_never_clips_and_counts(self):
        """Static scales below the batch's range (q at 4x, v at 2x): guarded, the GPU is the emulation's guarded
        run and counts as it does; unguarded, both clip. A CUDA graph replays the guard and its counts."""
        q, k, v, cu = inputs(SEGMENTS, 16, 72, seed=21)
        ref = ref64(q, k, v, cu)
        amax = torch.tensor([x.abs().max().item() for x in (q, k, v)])
        descale = (amax / 448 * torch.tensor([0.25, 2.0, 0.5])).to(CUDA)
        kept = descale.clone()
        guard = torch.zeros(3, dtype=torch.int64, device=CUDA)
        out = ft.varlen_attention(q, k, v, cu, descale=descale, guard=guard)
        emu, kw = on_cpu(ft.varlen_attention, q, k, v, cu, descale=descale, guard=torch.zeros(3, dtype=torch.int64))
        self.check("fp8 static guarded", out, emu, ref)
        self.assertEqual(guard.tolist(), [1, 0, 1])
        self.assertEqual(kw["guard"].tolist(), [1, 0, 1])
        self.assertTrue(torch.equal(descale, kept), "the file's scales are never written")
        clipped = ft.varlen_attention(q, k, v, cu, descale=descale)
        self.assertGreater(stats(clipped, ref)[0], 2 * stats(out, ref)[0], "unguarded, q and v clip")
        # The fused entry and the robust arrays (one head's Q scale below its range) take it the same way.
        qkv = torch.stack([q, k, v], dim=1)
        fused = ft.varlen_attention_qkv(qkv, cu, descale=descale, guard=guard)
        self.assertEqual(guard.tolist(), [2, 0, 2])
        self.assertLessEqual(stats(fused, ref)[0], 2 * stats(emu.to(CUDA), ref)[0] + 1e-3)
        H, hd = 16, 72
        split = torch.full((H * 6,), -1, dtype=torch.int32, device=CUDA)
        q_head = torch.full((H,), 1.0, device=CUDA)
        q_head[3] = 1e-4
        fine = (torch.zeros(H * hd, device=CUDA), q_head, torch.ones(H, device=CUDA), torch.ones(H * hd, device=CUDA),
                split)
        rg = torch.zeros(3, dtype=torch.int64, device=CUDA)
        out = ft.varlen_attention(q, k, v, cu, fine=fine, guard=rg)
        cpu_guard = torch.zeros(3, dtype=torch.int64)
        robust_emu = ft.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), fine=fine_cpu(fine), guard=cpu_guard)
        self.check("fp8 robust static guarded", out, robust_emu, ref)
        self.assertEqual(rg.tolist(), [1, 0, 0])
        self.assertEqual(cpu_guard.tolist(), [1, 0, 0])
        # One capture, replayed: every replay guards and counts on the device.
        guard.zero_()
        static_out = torch.empty_like(out)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            static_out.copy_(ft.varlen_attention(q, k, v, cu, descale=descale, guard=guard))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out.copy_(ft.varlen_attention(q, k, v, cu, descale=descale, guard=guard))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(guard.tolist(), [4, 0, 4])
        self.check("fp8 static guarded replay", static_out, emu, ref)


def outlier_inputs(seqlens, hd, seed):
    """inputs() with what trained ViTs have: Q and K offset on one rotary pair (K's much more), V with a loud channel."""
    q, k, v, cu = inputs(seqlens, 4, hd, seed)
    q, k, v = q.float(), k.float(), v.float()
    q[:, :, 3] += 12
    k[:, :, 3] += 40
    k[:, :, hd // 2 + 3] -= 30
    v[:, :, 7] *= 30
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), cu


def fine_cpu(fine):
    return tuple(None if t is None else t.cpu() for t in fine)


class Robust(Checks, unittest.TestCase):
    """The robust FP8 scheme through fovea.torch (issue 49): the GPU against fp64 and the CPU emulation through
    the same op, calibration to a file and the static plan read back, and graph replays of the dynamic state."""

    def test_robust_dynamic_against_fp64_emulation_and_per_tensor(self):
        for hd in (64, 72, 80, 128):
            q, k, v, cu = outlier_inputs(SEGMENTS, hd, seed=40 + hd)
            ref = ref64(q, k, v, cu)
            book = ft.ScaleBook(1, "dynamic", scheme="robust", heads=4, head_dim=hd, device=CUDA)
            self.assertEqual(book.modes, ["robust_dynamic"])
            emu, kw = on_cpu(ft.varlen_attention, q, k, v, cu, robust_state=book.robust_state[0].clone())
            out = ft.varlen_attention(q, k, v, cu, **book.layer(0))
            self.check(f"fp8 robust dynamic hd {hd}", out, emu, ref)
            self.assertEqual(book.complete_forwards(), 1)
            tensor = ft.varlen_attention(q, k, v, cu, **ft.ScaleBook(1, "dynamic", device=CUDA).layer(0))
            self.assertLess(stats(out, ref)[0], 0.5 * stats(tensor, ref)[0], f"hd {hd}: robust beats per tensor")
            # The fused entry (no RoPE) runs the same quantization as the views.
            again = ft.ScaleBook(1, "dynamic", scheme="robust", heads=4, head_dim=hd, device=CUDA)
            fused = ft.varlen_attention_qkv(torch.stack([q, k, v], 1), cu, **again.layer(0))
            self.assertTrue(torch.equal(fused, out), f"hd {hd}: fused == views")

    def test_robust_calibration_writes_the_file_the_static_plan_runs(self):
        for hd in (64, 72):
            with self.subTest(hd=hd):
                self.calibrate_then_run_static(hd)

    def calibrate_then_run_static(self, hd):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "scales.json")
            cal = ft.ScaleBook(2, "calibrate", path, scheme="auto", heads=4, head_dim=hd, device=CUDA)
            self.assertEqual(cal.modes, ["robust_dynamic"] * 2)
            for i in range(16):
                q, k, v, cu = outlier_inputs([200 + 10 * i, 300], hd, seed=60 + i)
                for layer in range(2):
                    ft.varlen_attention(q, k, v, cu, **cal.layer(layer))
                self.assertEqual(cal.maybe_save(), i == 15)
            with open(path) as f:
                data = json.load(f)
            self.assertIn("fovea_q_head", data["visual.blocks.1.attn.attn"])
            static = ft.ScaleBook(2, "static", path, scheme="robust", heads=4, head_dim=hd, device=CUDA)
            self.assertEqual(static.modes, ["robust_static"] * 2)
            q, k, v, cu = outlier_inputs([333, 222], hd, seed=99)  # held out from calibration
            ref = ref64(q, k, v, cu)
            kw = static.layer(1)
            out = ft.varlen_attention(q, k, v, cu, **kw)
            emu = ft.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), fine=fine_cpu(kw["fine"]))
            self.check(f"fp8 robust static hd {hd}", out, emu, ref)
            tensor = ft.ScaleBook(2, "static", path, device=CUDA)  # the same file's per-tensor q/k/v
            self.assertLess(stats(out, ref)[0], stats(ft.varlen_attention(q, k, v, cu, **tensor.layer(1)), ref)[0])
            # qk_split None splits no pair: the output of all -1s; the file's split pairs change it.
            split = kw["fine"][4]
            self.assertEqual(split.numel(), 4 * {64: 8, 72: 6}[hd])
            unsplit = ft.varlen_attention(q, k, v, cu, fine=kw["fine"][:4] + (None,))
            minus = ft.varlen_attention(q, k, v, cu, fine=kw["fine"][:4] + (torch.full_like(split, -1),))
            self.assertTrue(torch.equal(unsplit, minus))
            self.assertTrue(bool((split >= 0).any()))
            self.assertFalse(torch.equal(unsplit, out))

    def test_cuda_graph_replays_robust_dynamic_scaling(self):
        """One capture of the dynamic robust op on a device cu_seqlens: each replay records into the state as an eager
        call from the same state does, bit for bit, on layouts and inputs the capture never saw."""
        import random
        rng = random.Random(5)
        n, hd = 1024, 72
        q, k, v, _ = outlier_inputs([n], hd, seed=7)
        book = ft.ScaleBook(1, "dynamic", scheme="robust", heads=4, head_dim=hd, device=CUDA)
        buf = torch.tensor([0, 500, n] + [n] * 3, dtype=torch.int32, device=CUDA)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ft.varlen_attention(q, k, v, buf, **book.layer(0))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ft.varlen_attention(q, k, v, buf, **book.layer(0))
        for step in range(6):
            lens = [rng.randint(1, 400) for _ in range(rng.randint(1, 5))]
            cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=CUDA)
            buf.zero_()
            buf[: cu.numel()].copy_(cu)
            q.mul_(1.5), k.add_(0.25)  # new inputs in the captured buffers
            before = book.robust_state[0].clone()
            graph.replay()
            eager_state = before.clone()
            eager = ft.varlen_attention(q, k, v, buf, robust_state=eager_state)  # the same capacity handle, eagerly
            self.assertFalse(out.isnan().any().item())
            self.assertTrue(torch.equal(out, eager), f"replay {step} {lens}: output == eager")
            self.assertTrue(torch.equal(book.robust_state[0], eager_state), f"replay {step}: state == eager's")


def vision_model_8b(dtype, attn):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    cfg = Qwen3VLVisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                              num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return Qwen3VLVisionModel(cfg).to(CUDA, dtype).eval()


def merged(out):
    if hasattr(out, "pooler_output") and out.pooler_output is not None:
        return out.pooler_output
    return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


class Transformers(unittest.TestCase):
    def test_vision_tower_packed_path_within_bf16_error(self):
        import fovea.transformers as ftr
        grids = torch.tensor([[1, 32, 40], [1, 24, 24], [2, 16, 20]], device=CUDA)
        n = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
        px = torch.rand(n, 1536, device=CUDA, generator=torch.Generator(device="cuda").manual_seed(9)) * 2 - 1
        fp32 = vision_model_8b(torch.float32, "sdpa")
        with torch.no_grad():
            ref = merged(fp32(px, grid_thw=grids)).double()
            bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
            e_hf = stats(merged(bf16(px.bfloat16(), grid_thw=grids)), ref)[0]
            ftr.enable(bf16, fused=False)
            e_fv = stats(merged(bf16(px.bfloat16(), grid_thw=grids)), ref)[0]
            self.assertEqual(ftr.stats, {"packed_calls": 27, "single_calls": 0}, "the packed path ran")
            unfused = merged(bf16(px.bfloat16(), grid_thw=grids))
            ftr.enable(bf16, fused=True)
            fused = merged(bf16(px.bfloat16(), grid_thw=grids))
            self.assertEqual(ftr.stats, {"packed_calls": 27, "single_calls": 0}, "the fused forward ran")
            self.assertTrue(torch.equal(fused, unfused), "fused RoPE in fovea == transformers' RoPE, bit for bit (BF16)")
            fp8 = copy.deepcopy(fp32).to(torch.bfloat16)
            ftr.enable(fp8, fp8="dynamic", fused=False)
            e_f8 = stats(merged(fp8(px.bfloat16(), grid_thw=grids)), ref)[0]
            ftr.enable(fp8, fp8="dynamic", fused=True)
            e_f8f = stats(merged(fp8(px.bfloat16(), grid_thw=grids)), ref)[0]
        print(f"merged output vs fp32: transformers bf16 {e_hf:.3e}, fovea bf16 {e_fv:.3e} ({e_fv / e_hf:.2f}x), "
              f"fovea fp8 dynamic {e_f8:.3e} ({e_f8 / e_hf:.2f}x), fused {e_f8f:.3e} ({e_f8f / e_hf:.2f}x)")
        self.assertLessEqual(e_fv, 1.5 * e_hf)
        self.assertLessEqual(e_f8, 1.5 * e_hf)
        self.assertLessEqual(e_f8f, 1.5 * e_hf)


if __name__ == "__main__":
    unittest.main(verbosity=2)
