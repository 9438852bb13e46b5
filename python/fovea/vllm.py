"""A vLLM general plugin: fovea's attention as vLLM's vision-encoder attention (docs/python.md).

Installed with the package (entry point `vllm.general_plugins: fovea = fovea.vllm:register`), it
registers an out-of-tree replacement of MMEncoderAttention, so every ViT attention layer vLLM builds
(Qwen3-VL's among them) runs fovea's kernel: BF16, or FP8 with --mm-encoder-attn-dtype fp8 (dynamic
scaling; static scales from --mm-encoder-fp8-scale-path, vLLM's file; calibration to
--mm-encoder-fp8-scale-save-path with --mm-encoder-fp8-scale-save-margin). FP8 runs on Hopper, where
vLLM's own FP8 encoder attention is refused. Set FOVEA_VLLM=0 to leave vLLM's attention in place.

Written against vLLM's call contract as read in its source (MMEncoderAttention.forward_cuda, the
CustomOp.register_oot hook, the host-side classmethod maybe_recompute_cu_seqlens); not run against
vLLM itself (tests use a stub of exactly these hooks).
"""
import json
import os
import re
import weakref

_registered = False


def register():
    """The plugin's entry point: idempotent, a no-op with FOVEA_VLLM=0."""
    global _registered
    if _registered or os.environ.get("FOVEA_VLLM", "1") == "0":
        return
    import torch
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    from . import attention as fovea_attention
    from . import torch as fovea_torch

    def multimodal_config():
        try:
            from vllm.model_executor.models.vision import get_multimodal_config
        except ImportError:
            return None
        return get_multimodal_config()

    layers = []  # weak references to the dynamic layers, for calibration

    class FoveaMMEncoderAttention(MMEncoderAttention):
        """MMEncoderAttention on fovea's kernel. Its constructor skips MMEncoderAttention's, whose FP8
        set-up refuses every GPU but Blackwell: it keeps the same attributes and builds fovea's FP8 state."""

        def __init__(self, num_heads, head_size, scale=None, num_kv_heads=None, prefix="", **unused):
            CustomOp.__init__(self)
            self.num_heads, self.head_size = num_heads, head_size
            self.scale = 1.0 / (head_size ** 0.5) if scale is None else scale
            self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
            if self.num_kv_heads != num_heads:
                raise ValueError(f"fovea: {prefix}: grouped-query attention ({num_heads} query heads, "
                                 f"{self.num_kv_heads} key/value heads) is not supported")
            self.layer_name = prefix
            self.num_queries_per_kv = 1
            self.dtype = torch.get_default_dtype()
            self.fp8_enabled, self.fovea_calls = False, 0
            cfg = multimodal_config()
            if cfg is None or (getattr(cfg, "mm_encoder_attn_dtype", None) or "").lower() != "fp8":
                return
            self.fp8_enabled = True
            static = getattr(cfg, "mm_encoder_fp8_scale_path", None)
            if static:
                scales = _layer_scales(os.path.expanduser(static), prefix)
                self.register_buffer("fovea_descale", torch.tensor(scales, dtype=torch.float32))
            else:
                raw = bytearray(fovea_attention.fresh_state_bytes())
                self.register_buffer("fovea_amax_state", torch.frombuffer(raw, dtype=torch.int32).clone())
                self.fovea_save = getattr(cfg, "mm_encoder_fp8_scale_save_path", None)
                self.fovea_margin = float(getattr(cfg, "mm_encoder_fp8_scale_save_margin", 1.5))
                layers.append(weakref.ref(self))

        def process_weights_after_loading(self, act_dtype=None):
            # vLLM's loader calls this on every MMEncoderAttention to load FP8 scales into the buffers
            # its own constructor makes; this class made its state in its constructor.
            return None

        @classmethod
        def maybe_recompute_cu_seqlens(cls, attn_backend, cu_seqlens, hidden_size, tp_size, device,
                                       fp8_padded_hidden_size=None):
            # Called on the host with numpy offsets: the device copy is remembered with them, so the
            # layers plan without reading it back.
            t = torch.from_numpy(cu_seqlens).to(device, non_blocking=True)
            fovea_torch.remember_offsets(t, [int(x) for x in cu_seqlens])
            return t

        def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
            b, s = query.shape[0], query.shape[1]
            q, k, v = (x.reshape(b, s, self.num_heads, self.head_size) if x.dim() == 3 else x for x in (query, key, value))
            if cu_seqlens is None:  # one sequence per batch row
                cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
            elif b != 1:
                raise ValueError(f"fovea: {self.layer_name}: cu_seqlens with a batch of {b} rows")
            flat = [x.reshape(b * s, self.num_heads, self.head_size) if b != 1 else x[0] for x in (q, k, v)]
            fp8 = {}
            if self.fp8_enabled:
                fp8 = {"descale": self.fovea_descale} if hasattr(self, "fovea_descale") else {"amax_state": self.fovea_amax_state}
            out = fovea_torch.varlen_attention(*flat, cu_seqlens, softmax_scale=self.scale, **fp8)
            out = out.view(b, s, self.num_heads, self.head_size)
            if "amax_state" in fp8 and self.fovea_save:
                self.fovea_calls += 1
                _maybe_calibrate(self, layers)
            return out.reshape(query.shape) if query.dim() == 3 else out

    CustomOp.register_oot(FoveaMMEncoderAttention, name="MMEncoderAttention")
    _registered = True


def _layer_index(prefix):
    m = re.search(r"blocks\.(\d+)\.", prefix + ".")
    return int(m.group(1)) if m else None


def _layer_scales(path, prefix):
    """This layer's (q, k, v) from vLLM's scale file, by its prefix as vLLM looks it up (the file's
    other entries are validated by fovea's reader where the prefix names a block)."""
    from . import attention as fovea_attention
    with open(path) as f:
        data = json.load(f)
    layers = data.get("layers", data) if isinstance(data, dict) else None
    entry = layers.get(prefix) if isinstance(layers, dict) else None
    if not isinstance(entry, dict):
        raise ValueError(f"fovea: FP8 scale file {path} has no entry for layer {prefix}")
    index = _layer_index(prefix)
    if index is not None:
        return fovea_attention.read_scale_file(path, index + 1)[index]
    vals = [entry.get(n, entry.get(n + "_scale")) for n in ("q", "k", "v")]
    if not all(isinstance(x, (int, float)) and x > 0 for x in vals):
        raise ValueError(f"fovea: FP8 scale file {path}, layer {prefix}: q, k, v must be numbers > 0, got {vals}")
    return [float(x) for x in vals]


def _maybe_calibrate(layer, layers):
    """After 16 forwards of every dynamic layer, writes the save path once (s x margin), in layer order."""
    from . import attention as fovea_attention
    live = [r() for r in layers if r() is not None]
    if not layer.fovea_save or any(x.fovea_calls < 16 for x in live):
        return
    live.sort(key=lambda x: _layer_index(x.layer_name) or 0)
    states = [x.fovea_amax_state.cpu().numpy().tobytes() for x in live]
    scales = fovea_attention.calibrated_scales(states, layer.fovea_margin)
    tmp = layer.fovea_save + ".tmp"
    with open(tmp, "w") as f:
        json.dump({x.layer_name: dict(zip("qkv", s)) for x, s in zip(live, scales)}, f, indent=1)
    os.replace(tmp, layer.fovea_save)
    for x in live:
        x.fovea_save = None
