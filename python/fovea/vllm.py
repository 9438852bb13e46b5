"""A vLLM general plugin: fovea's attention inside vLLM's vision encoders (docs/vllm.md, docs/python.md).

Installed with the package (entry point `vllm.general_plugins: fovea = fovea.vllm:register`; vLLM
loads it in every process unless VLLM_PLUGINS leaves it out; FOVEA_VLLM=0 turns it off). It
registers an out-of-tree MMEncoderAttention, so the ViT attention layers vLLM builds (Qwen3-VL's
and Qwen3.5's among them) run fovea's kernels on Hopper: BF16, or FP8 with
--mm-encoder-attn-dtype fp8 (dynamic scaling; static scales from --mm-encoder-fp8-scale-path, vLLM's
file; calibration to --mm-encoder-fp8-scale-save-path with --mm-encoder-fp8-scale-save-margin),
where vLLM's own FP8 encoder attention needs Blackwell. FOVEA_FP8_SCHEME (auto, tensor, robust; fovea's
own, the fovea command's --fp8-scheme) picks the scales per layer as fovea's plan does: a static file
with fovea's fine scales runs its layers with outlier channels robust (auto) or every layer robust
(robust); without a file, robust runs the robust scheme's dynamic scaling. A static file's scales never
clip: a batch past a layer's range is quantized with its own scale and counted (static_guard_counts()
reads the counts; docs/fp8.md §Static guard). Calibration runs fovea's plan: the robust scheme's
dynamic scaling, then fovea's own calibration (C++, through the C ABI) writes vLLM's per-tensor q/k/v
and the fine scales (FOVEA_FP8_SCHEME=tensor: per tensor only). It also replaces the Qwen2.5-VL / Qwen3-VL
vision attention forward, so fovea gets the qkv projection's output and vLLM's RoPE tables (RoPE,
quantization and layout in one step), as fovea.transformers' fused path does.

vLLM's own constructor runs (every attribute vLLM's model code reads is there); a layer fovea cannot
serve keeps vLLM's own forward: grouped-query attention, head sizes other than 64/72/80/128, a
softmax scale other than 1/sqrt(head_dim), a layer built in another dtype than bfloat16, a GPU other
than Hopper (there vLLM's FP8 check applies as vLLM has it), and at run time fp16 inputs,
kv_len != q_len, a batch of several rows. One log line (logger "fovea.vllm") lists, at the first
forward, the layers on fovea and those left to vLLM with the reason.

Encoder CUDA graphs (compilation_config.cudagraph_mm_encoder) replay new segment layouts from the
captured cu_seqlens buffer: fovea's layers read the offsets on the device at every call (planned by
capacity: the budget's tokens and segments), so each replay attends the layout copied in for it.

Tested against a double of vLLM written from its source (python/tests/vllm_stub, the commits it
follows in docs/vllm.md), never against vLLM itself.
"""
import json
import logging
import os
import re
import weakref

log = logging.getLogger("fovea.vllm")

HEAD_SIZES = (64, 72, 80, 128)
_registered = False
_layers = []        # weak references to fovea's dynamic FP8 layers, for calibration
_static_layers = [] # weak references to fovea's static FP8 layers, for static_guard_counts
_served = [0]       # layers built on fovea in this process (the classmethods then give token offsets)
_pending = []       # (layer name, reason or None) of layers built since the last report
_said = set()       # (layer name, reason) of run-time fallbacks already logged


def register():
    """The plugin's entry point: idempotent, a no-op with FOVEA_VLLM=0. Where another plugin has
    already replaced MMEncoderAttention, it logs that and leaves it in place."""
    global _registered
    if _registered or os.environ.get("FOVEA_VLLM", "1") == "0":
        return
    _registered = True
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    taken = getattr(custom_op, "op_registry_oot", {}).get("MMEncoderAttention")
    if taken is not None:
        log.warning("fovea: MMEncoderAttention is already replaced by %s.%s (another vLLM plugin): fovea leaves it "
                    "in place (set VLLM_PLUGINS to choose one)", taken.__module__, taken.__qualname__)
        return
    layer_cls = _layer_class(MMEncoderAttention)
    try:
        custom_op.CustomOp.register_oot(layer_cls, name="MMEncoderAttention")
    except AssertionError as e:  # registered in between: vLLM's assertion, which its loader does not catch
        log.warning("fovea: MMEncoderAttention could not be registered (%s): fovea leaves vLLM's in place", e)
        return
    _patch_vision_attention()


def _fp8_config():
    """vLLM's multimodal config where it asks for FP8 encoder attention, else None."""
    try:
        from vllm.model_executor.models.vision import get_multimodal_config
        cfg = get_multimodal_config()
    except (ImportError, AttributeError, AssertionError):
        return None
    return cfg if cfg is not None and (getattr(cfg, "mm_encoder_attn_dtype", None) or "").lower() == "fp8" else None


def _why_not(torch, num_heads, head_size, num_kv_heads, scale, dtype):
    """Why fovea cannot serve a layer of this shape (None: it can)."""
    if num_kv_heads not in (None, num_heads):
        return f"grouped-query attention ({num_heads} query heads, {num_kv_heads} key/value heads)"
    if head_size not in HEAD_SIZES:
        return f"head size {head_size} (fovea's kernels: {', '.join(map(str, HEAD_SIZES))})"
    if scale is not None and abs(scale * head_size ** 0.5 - 1) > 1e-6:
        return f"softmax scale {scale:g}, not 1/sqrt(head_dim)"
    if dtype != torch.bfloat16:
        return f"built for {str(dtype).replace('torch.', '')} (fovea runs bfloat16)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return f"not a Hopper GPU (sm_{cap[0]}{cap[1]})"
    return None


def _runtime_why(q, k):
    """Why fovea cannot serve this call of a layer it serves (None: it can)."""
    if q.dtype != k.dtype or str(q.dtype) != "torch.bfloat16":
        return f"{str(q.dtype).replace('torch.', '')} inputs (fovea runs bfloat16)"
    if k.shape[1] != q.shape[1]:
        return f"kv_len {k.shape[1]} != q_len {q.shape[1]}"
    if not q.is_cuda:
        return "inputs not on a CUDA device"
    return None


def _report():
    """Logs, once, the layers built since the last report: those on fovea and those left to vLLM."""
    if not _pending:
        return
    ours = [name for name, why in _pending if why is None]
    theirs = [f"{name} ({why})" for name, why in _pending if why is not None]
    _pending.clear()
    parts = []
    if ours:
        parts.append(f"{len(ours)} on fovea: {', '.join(ours)}")
    if theirs:
        parts.append(f"{len(theirs)} on vLLM's own attention: {'; '.join(theirs)}")
    log.info("fovea: vision attention layers: %s", ". ".join(parts))


def _said_once(layer, why):
    if (layer.layer_name, why) not in _said:
        _said.add((layer.layer_name, why))
        log.info("fovea: %s: %s: this call runs on vLLM's own attention", layer.layer_name, why)


class _FoveaFp8:
    """The FP8 half of fovea's MMEncoderAttention, a mixin before vLLM's class (_layer_class): its FP8
    state where fovea serves the layer (static descales or a dynamic amax history, calibration), vLLM's
    own elsewhere."""

    def _init_fp8_state(self):
        import torch

        from . import attention as fovea_attention

        cfg = _fp8_config()
        if self.fovea_reason is not None:
            parent = getattr(super(), "_init_fp8_state", None)
            try:
                if parent is not None:
                    return parent()
            except ValueError:  # vLLM's FP8 check: Blackwell only
                if cfg is None or torch.cuda.get_device_capability()[0] != 9:
                    raise
                self.fovea_reason += "; FP8 asked, which vLLM's attention has only on Blackwell: runs BF16"
            self._fp8_defaults(False)
            return
        self._fp8_defaults(cfg is not None)
        if cfg is None:
            return
        scheme = _scheme()  # a bad value is refused whatever the scale flags
        static = getattr(cfg, "mm_encoder_fp8_scale_path", None)
        save = getattr(cfg, "mm_encoder_fp8_scale_save_path", None)
        self._fp8_dynamic_scale = not static
        # torch.tensor follows vLLM's `with torch.device(...)`: buffers are made on the layer's device.
        if static:
            path = os.path.expanduser(static)
            scales = _layer_scales(path, self.layer_name)
            fine = _layer_fine(path, self.layer_name, self.num_heads, self.head_size)
            # The static guard's counts (q, k, v): the file's scales never clip (docs/fp8.md §Static guard).
            self.register_buffer("fovea_guard", torch.zeros(3, dtype=torch.int64))
            _static_layers.append(weakref.ref(self))
            if fine is not None:  # fovea's plan runs this layer robust from the file's arrays
                for name, values in fine.items():
                    dtype = torch.int32 if name == "qk_split" else torch.float32
                    self.register_buffer(f"fovea_fine_{name}", torch.tensor(values, dtype=dtype))
                return
            self.register_buffer("fovea_descale", torch.tensor(scales, dtype=torch.float32))
            self.skip_scale_q, self.skip_scale_k, self.skip_scale_v = (s == 1.0 for s in scales)
            return
        # Robust dynamic (K smoothing, per-head and per-channel scales) for FOVEA_FP8_SCHEME=robust, and for
        # calibration unless the scheme is tensor: fovea's plan calibrates robust, so the file records which
        # layers need it (and per-tensor q/k/v for vLLM's own path).
        named = _layer_index(self.layer_name) is not None  # robust calibration writes layer i as visual.blocks.i
        if save and scheme == "robust" and not named:
            raise ValueError(f"fovea: robust calibration needs layers named visual.blocks.<i>.attn.attn, not "
                             f"{self.layer_name!r} (FOVEA_FP8_SCHEME=tensor calibrates per tensor)")
        if scheme == "robust" or (save and scheme == "auto" and named):
            state = fovea_attention.fresh_robust_state(self.num_heads, self.head_size)
            self.register_buffer("fovea_robust_state", torch.tensor(list(state), dtype=torch.uint8))
        else:
            state = list(memoryview(fovea_attention.fresh_state_bytes()).cast("i"))
            self.register_buffer("fovea_amax_state", torch.tensor(state, dtype=torch.int32))
        self.fovea_save = save
        self.fovea_margin = float(getattr(cfg, "mm_encoder_fp8_scale_save_margin", 1.5))
        self.fovea_calls = 0
        _layers.append(weakref.ref(self))

    def _fp8_defaults(self, enabled):
        self.fp8_enabled, self._fp8_dynamic_scale, self.fp8_quant = enabled, False, None
        self.skip_scale_q = self.skip_scale_k = self.skip_scale_v = False

    def process_weights_after_loading(self, act_dtype=None):
        # vLLM's loader calls this on every MMEncoderAttention to fill its FP8 scales; fovea's
        # layers read theirs in the constructor.
        if self.fovea_reason is not None:
            parent = getattr(super(), "process_weights_after_loading", None)
            return parent(act_dtype) if parent is not None else None
        return None

    def fovea_fp8_kwargs(self, device):
        """The FP8 keyword arguments of fovea.torch's ops for this layer (its state on `device`)."""
        if not self.fp8_enabled:
            return {}

        def on(name):
            t = getattr(self, name)
            if t.device != device:  # a layer built outside a device context and never moved
                t = t.to(device)
                setattr(self, name, t)
            return t
        guard = {"guard": on("fovea_guard")} if hasattr(self, "fovea_guard") else {}
        if hasattr(self, "fovea_fine_k_mean"):
            split = on("fovea_fine_qk_split")
            return {"fine": tuple(on(f"fovea_fine_{n}") for n in ("k_mean", "q_head", "k_head", "v_channel"))
                    + (split if split.numel() else None,), **guard}
        if hasattr(self, "fovea_descale"):
            return {"descale": on("fovea_descale"), **guard}
        if hasattr(self, "fovea_robust_state"):
            return {"robust_state": on("fovea_robust_state")}
        return {"amax_state": on("fovea_amax_state")}

    def fovea_after_call(self):
        if self.fp8_enabled and self._fp8_dynamic_scale and self.fovea_save:
            _count_and_calibrate(self)


def _layer_class(base):
    import torch

    from . import torch as fovea_torch

    class FoveaMMEncoderAttention(_FoveaFp8, base):
        """MMEncoderAttention on fovea's kernel where fovea can serve it (fovea_reason None), vLLM's own
        forward elsewhere. vLLM's constructor runs; its FP8 set-up, which refuses every GPU but
        Blackwell, is replaced by fovea's for the layers fovea serves."""

        def __init__(self, num_heads, head_size, scale=None, num_kv_heads=None, prefix="", **kwargs):
            why = _why_not(torch, num_heads, head_size, num_kv_heads, scale, torch.get_default_dtype())
            object.__setattr__(self, "fovea_reason", why)  # read by _init_fp8_state, which vLLM's constructor calls
            super().__init__(num_heads, head_size, scale, num_kv_heads, prefix, **kwargs)
            if not hasattr(self, "fp8_enabled"):  # a vLLM without FP8 encoder attention
                self._init_fp8_state()
            if self.scale is None:  # vLLM before 2026 kept None for the default
                self.scale = head_size ** -0.5
            _pending.append((prefix, self.fovea_reason))
            if self.fovea_reason is None:
                _served[0] += 1

        @classmethod
        def maybe_recompute_cu_seqlens(cls, attn_backend, cu_seqlens, hidden_size, tp_size, *args, **kwargs):
            # Two contracts in 2026 vLLM: with `device` (a device tensor back) and without (numpy back).
            # Where fovea serves the tower, its layers take token offsets whatever the backend's own form.
            if not _served[0]:
                return super().maybe_recompute_cu_seqlens(attn_backend, cu_seqlens, hidden_size, tp_size, *args,
                                                          **kwargs)
            device = kwargs.get("device")
            if device is None and args and not isinstance(args[0], (int, type(None))):
                device = args[0]
            import numpy as np
            offsets = np.ascontiguousarray(cu_seqlens, dtype=np.int32)
            if device is None:
                return offsets
            t = torch.from_numpy(offsets).to(device, non_blocking=True)
            fovea_torch.remember_offsets(t, offsets.tolist())  # the layers plan without reading it back
            return t

        def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
            _report()
            b = query.shape[0]
            why = self.fovea_reason or _runtime_why(query, key) or (
                f"a batch of {b} rows with cu_seqlens" if b != 1 and cu_seqlens is not None else None)
            if why:
                if self.fovea_reason is None:
                    _said_once(self, why)
                return self._vllm_forward(query, key, value, cu_seqlens, max_seqlen, sequence_lengths)
            s = query.shape[1]
            q, k, v = (x.reshape(b * s, self.num_heads, self.head_size) for x in (query, key, value))
            if cu_seqlens is None:  # one sequence per batch row
                cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
            out = fovea_torch.varlen_attention(q, k, v, cu_seqlens, **self.fovea_fp8_kwargs(query.device))
            self.fovea_after_call()
            return out.view(query.shape) if query.dim() == 4 else out.reshape(b, s, -1)

        def _vllm_forward(self, query, key, value, cu_seqlens, max_seqlen, sequence_lengths):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum
            if _served[0] and self.attn_backend == AttentionBackendEnum.FLASHINFER:
                # The tower's offsets are fovea's (tokens), not FlashInfer's (elements): vLLM's SDPA reads tokens.
                return self._forward_sdpa(query, key, value, cu_seqlens)
            kw = {} if sequence_lengths is None else {"sequence_lengths": sequence_lengths}
            return super().forward_cuda(query, key, value, cu_seqlens, max_seqlen, **kw)

    return FoveaMMEncoderAttention


def _patch_vision_attention():
    """Replaces Qwen2_5_VisionAttention.forward (Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's vision blocks)
    with the fused path where its attention layer is fovea's, as vLLM's hardware plugins patch it."""
    try:
        from vllm.model_executor.models import qwen2_5_vl
    except ImportError:
        return
    cls = getattr(qwen2_5_vl, "Qwen2_5_VisionAttention", None)
    if cls is None or getattr(cls.forward, "fovea_original", None) is not None:
        return
    import torch

    from . import torch as fovea_torch
    original = cls.forward

    def forward(self, x, cu_seqlens, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None, max_seqlen=None,
                sequence_lengths=None, **kwargs):
        attn = getattr(self, "attn", None)
        if (kwargs or getattr(attn, "fovea_reason", "not fovea's") is not None or rotary_pos_emb_cos is None
                or rotary_pos_emb_sin is None or x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.bfloat16):
            if sequence_lengths is not None:  # passed on only where given: older forwards lack it
                kwargs["sequence_lengths"] = sequence_lengths
            return original(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin, max_seqlen, **kwargs)
        _report()
        s = x.shape[0]
        qkv, _ = self.qkv(x)
        qkv = qkv.view(s, 3, attn.num_heads, attn.head_size)
        cos, sin = (t.float().contiguous() for t in (rotary_pos_emb_cos, rotary_pos_emb_sin))
        out = fovea_torch.varlen_attention_qkv(qkv, cu_seqlens, cos, sin, **attn.fovea_fp8_kwargs(x.device))
        attn.fovea_after_call()
        output, _ = self.proj(out.view(s, 1, -1))
        return output

    forward.fovea_original = original
    cls.forward = forward


def _layer_index(prefix):
    m = re.search(r"blocks\.(\d+)\.", prefix + ".")
    return int(m.group(1)) if m else None


class _StaticFile:
    """A static scale file as the model's layers read it: parsed once, fovea's reader (every block's
    entry validated) and plan run once per path, however many layers the model builds."""

    def __init__(self, path):
        self.path = path
        with open(path) as f:
            data = json.load(f)
        layers = data.get("layers", data) if isinstance(data, dict) else None
        self.layers = layers if isinstance(layers, dict) else {}
        self.highest = max((i for i in map(_layer_index, self.layers) if i is not None), default=None)
        self._scales, self._plans = {}, {}

    def count(self, index):
        """The number of blocks the file covers (its highest block index + 1, else index + 1)."""
        return (index if self.highest is None else self.highest) + 1

    def scales(self, index):
        from . import attention as fovea_attention
        n = self.count(index)
        if n not in self._scales:
            self._scales[n] = fovea_attention.read_scale_file(self.path, n)
        return self._scales[n][index]

    def plan(self, scheme, index, heads, head_dim):
        from . import attention as fovea_attention
        key = (scheme, self.count(index), heads, head_dim)
        if key not in self._plans:
            self._plans[key] = fovea_attention.fp8_plan(scheme, key[1], heads, head_dim, path=self.path)
        return self._plans[key]


_static_files = {}  # (path, mtime, size): the one file the model's layers read


def _static_file(path):
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _static_files:
        _static_files.clear()
        _static_files[key] = _StaticFile(path)
    return _static_files[key]


def _layer_scales(path, prefix):
    """This layer's (q, k, v) from vLLM's scale file, by its prefix as vLLM looks it up (the file's
    other entries are validated by fovea's reader where the prefix names a block)."""
    f = _static_file(path)
    index = _layer_index(prefix)
    if index is not None and f.highest is not None and index <= f.highest:
        # fovea's reader, whole (every block's entry validated, any module prefix before "visual."), at the
        # file's own layer count
        return f.scales(index)
    entry = f.layers.get(prefix)
    if not isinstance(entry, dict):
        raise ValueError(f"fovea: FP8 scale file {path} has no entry for layer {prefix}")
    if index is not None:
        return f.scales(index)
    vals = [entry.get(n, entry.get(n + "_scale")) for n in ("q", "k", "v")]
    if not all(isinstance(x, (int, float)) and x > 0 for x in vals):
        raise ValueError(f"fovea: FP8 scale file {path}, layer {prefix}: q, k, v must be numbers > 0, got {vals}")
    return [float(x) for x in vals]


def _scheme():
    """FOVEA_FP8_SCHEME (fovea's own, as the fovea command's --fp8-scheme): auto (default), tensor, robust."""
    scheme = os.environ.get("FOVEA_FP8_SCHEME", "auto").strip().lower() or "auto"
    if scheme not in ("auto", "tensor", "robust"):
        raise ValueError(f"fovea: FOVEA_FP8_SCHEME={scheme!r} is not one of auto, tensor, robust")
    return scheme


def _layer_fine(path, prefix, heads, head_dim):
    """This layer's robust arrays where fovea's plan runs it robust from the static file (FOVEA_FP8_SCHEME
    auto: the layers whose calibration found outlier channels, when the file has fine scales; robust:
    every layer, the file must have them), else None (per-tensor q, k, v)."""
    scheme, index = _scheme(), _layer_index(prefix)
    if scheme == "tensor" or index is None:
        return None
    plan = _static_file(path).plan(scheme, index, heads, head_dim)
    return plan["fine"][index] if plan["modes"][index] == "robust_static" else None


def _count_and_calibrate(layer):
    """Counts the layer's forward; after 16 forwards of every dynamic layer, writes the save path
    once (s x margin), in layer order. Host work: kept out of compiled graphs."""
    layer.fovea_calls += 1
    live = [r() for r in _layers if r() is not None]
    if not layer.fovea_save or any(x.fovea_calls < 16 for x in live):
        return
    from . import attention as fovea_attention
    live.sort(key=lambda x: _layer_index(x.layer_name) or 0)
    path, margin = layer.fovea_save, live[0].fovea_margin
    if any(hasattr(x, "fovea_robust_state") for x in live):  # fovea's calibration (C++), layer i as visual.blocks.i
        if [_layer_index(x.layer_name) for x in live] != list(range(len(live))):
            log.error("fovea: no FP8 scales saved: robust calibration writes blocks 0 to %d, the layers are %s "
                      "(FOVEA_FP8_SCHEME=tensor calibrates per tensor)", len(live) - 1, [x.layer_name for x in live])
            for x in live:
                x.fovea_save = None
            return
        states = [x.fovea_robust_state.cpu().numpy().tobytes() for x in live]
        fovea_attention.robust_calibrate(states, live[0].num_heads, live[0].head_size, path, margin)
    else:
        states = [x.fovea_amax_state.cpu().numpy().tobytes() for x in live]
        scales = fovea_attention.calibrated_scales(states, margin)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({x.layer_name: dict(zip("qkv", s)) for x, s in zip(live, scales)}, f, indent=1)
        os.replace(tmp, path)
    for x in live:
        x.fovea_save = None
    log.info("fovea: saved FP8 scales of %d layers to %s", len(live), path)


def static_guard_counts():
    """The static guard's counts of this process's static FP8 layers, {layer name: [q, k, v]}: the
    forwards in which a tensor passed the scale file's range and was quantized with the batch's own
    scale. A count that grows says the file no longer fits the inputs (calibrate again). Reads the
    device (a synchronization): for a metrics scrape or a log, not for a forward."""
    live = sorted((r() for r in _static_layers if r() is not None), key=lambda x: _layer_index(x.layer_name) or 0)
    if not live:
        return {}
    import torch
    counts = torch.stack([x.fovea_guard.to(live[0].fovea_guard.device) for x in live]).tolist()  # one read
    return {x.layer_name: c for x, c in zip(live, counts)}


try:  # host I/O and Python counters: never traced into a compiled region
    import torch as _torch
    _count_and_calibrate = _torch.compiler.disable(_count_and_calibrate)
except (ImportError, AttributeError):
    pass
