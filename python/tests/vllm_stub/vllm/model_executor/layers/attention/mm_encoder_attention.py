"""MMEncoderAttention as vLLM's 2026 source has it (FP8 state, host-side classmethods), computing real
attention with torch SDPA per segment for every backend (the double has no flash-attn/FlashInfer kernels:
FLASH_ATTN / TRITON_ATTN run the same SDPA after vLLM's argument checks; FLASHINFER simulates FP8 by
quantize-dequantize with the layer's scales, then SDPA).

SIGNATURE selects the classmethods' contract (use_signature):
  "2026_09": maybe_recompute_cu_seqlens(cls, attn_backend, cu_seqlens: np.ndarray, hidden_size, tp_size, device,
             fp8_padded_hidden_size=None) -> device tensor; maybe_compute_seq_lens(cls, attn_backend, cu_seqlens,
             device) -> tensor | None
  "2026_05": the same without `device`, returning numpy (callers do torch.from_numpy(...).to(device)).
"""
import functools
import json

import numpy as np
import torch
import torch.nn.functional as F

from vllm.config import MultiModalConfig
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp, maybe_get_oot_by_class
from vllm.model_executor.models.vision import get_multimodal_config, get_vit_attn_backend
from vllm.utils.flashinfer import is_flashinfer_cudnn_fp8_prefill_attn_supported
from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
from vllm.v1.attention.backends.registry import AttentionBackendEnum

logger = init_logger(__name__)

SIGNATURE_2026_05 = "2026_05"
SIGNATURE_2026_09 = "2026_09"
SIGNATURE = SIGNATURE_2026_09

FP8_MAX = 448.0
FP8_AMAX_HISTORY_LEN = 16
FP8_UNSUPPORTED_MESSAGE = ("mm_encoder_attn_dtype='fp8' requires the FlashInfer cuDNN backend with cuDNN >= 9.17.1 "
                           "on a GPU with native FP8 support.")

# Auto-save of dynamic scales (module-level, captured at layer init as vLLM does).
_fp8_scale_save_path = None
_fp8_scale_save_margin = MultiModalConfig.mm_encoder_fp8_scale_save_margin
_fp8_saved_scale_refs = {}


@functools.cache
def _load_fp8_scales_file(path):
    """{layer: {"q", "k", "v"}} from vLLM's JSON (optionally nested under "layers"; *_scale keys accepted)."""
    if path is None:
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data.get("layers"), dict):
        data = data["layers"]
    out = {}
    for name, entry in data.items():
        if not isinstance(entry, dict):
            continue
        vals = [entry.get(c, entry.get(c + "_scale")) for c in "qkv"]
        if all(v is not None for v in vals):
            vals = [float(v) for v in vals]
            if min(vals) <= 0:
                raise ValueError(f"FP8 scales must be positive, got q={vals[0]}, k={vals[1]}, v={vals[2]} for layer '{name}'")
            out[name] = dict(zip("qkv", vals))
    return out


def write_fp8_scale_file(path, scales):
    """vLLM's scale file as _maybe_save_fp8_scales writes it: {layer: {"q": s, "k": s, "v": s}}, indent 2, where
    s = amax / 448 x margin (a dequantization scale). `scales`: {layer: (q, k, v)}."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({n: dict(zip("qkv", map(float, s))) for n, s in scales.items()}, f, indent=2)


def _maybe_save_fp8_scales(layer_name, q_scale, k_scale, v_scale, buffer_wrapped):
    global _fp8_scale_save_path
    if _fp8_scale_save_path is None:
        return
    _fp8_saved_scale_refs[layer_name] = (q_scale, k_scale, v_scale)
    if not buffer_wrapped:
        return
    path, margin = _fp8_scale_save_path, _fp8_scale_save_margin
    scales = {n: (q.item() * margin, k.item() * margin, v.item() * margin) for n, (q, k, v) in _fp8_saved_scale_refs.items()}
    _fp8_scale_save_path = None
    _fp8_saved_scale_refs.clear()
    write_fp8_scale_file(path, scales)
    logger.info("Saved FP8 scales (%d layers) to %s", len(scales), path)


def reference_attention(query, key, value, cu_seqlens, scale, num_heads, num_kv_heads, head_size):
    """vLLM's SDPA path (vit_torch_sdpa_wrapper): q [B, S, H*D] or [B, S, H, D], k/v [B, S_kv, Hkv(*D)];
    GQA by repeat_interleave; per segment of cu_seqlens (empty segments skipped, tokens outside every segment
    left 0), else per batch row over all of k/v. Computes in the inputs' dtype (float64 gives an oracle)."""
    bsz, q_len = query.shape[:2]
    kv_len = key.size(1)
    reshaped = query.dim() != 4
    q = query.reshape(bsz, q_len, num_heads, head_size)
    k = key.reshape(bsz, kv_len, num_kv_heads, head_size)
    v = value.reshape(bsz, kv_len, num_kv_heads, head_size)
    if num_heads != num_kv_heads:
        k = torch.repeat_interleave(k, num_heads // num_kv_heads, dim=2)
        v = torch.repeat_interleave(v, num_heads // num_kv_heads, dim=2)
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=scale).transpose(1, 2)
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        out = torch.zeros_like(q)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b <= a:
                continue
            out[:, a:b] = F.scaled_dot_product_attention(q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2),
                                                         v[:, a:b].transpose(1, 2), scale=scale).transpose(1, 2)
    return out.reshape(bsz, q_len, -1) if reshaped else out


# ---- the classmethods, one set per signature --------------------------------------------------------------------

def _compute_max_seqlen(cls, attn_backend, cu_seqlens):
    cu = np.asarray(cu_seqlens)
    if attn_backend in (AttentionBackendEnum.FLASH_ATTN, AttentionBackendEnum.ROCM_AITER_FA,
                        AttentionBackendEnum.TRITON_ATTN, AttentionBackendEnum.FLASHINFER) and len(cu) >= 2:
        return int((cu[1:] - cu[:-1]).max())
    return 0


def _recompute_2026_09(cls, attn_backend, cu_seqlens, hidden_size, tp_size, device, fp8_padded_hidden_size=None):
    if (oot := maybe_get_oot_by_class(cls)) is not cls:
        return oot.maybe_recompute_cu_seqlens(attn_backend, cu_seqlens, hidden_size, tp_size, device,
                                              fp8_padded_hidden_size=fp8_padded_hidden_size)
    return torch.from_numpy(np.ascontiguousarray(cu_seqlens, dtype=np.int32)).to(device, non_blocking=True)


def _seq_lens_2026_09(cls, attn_backend, cu_seqlens, device):
    if (oot := maybe_get_oot_by_class(cls)) is not cls:
        return oot.maybe_compute_seq_lens(attn_backend, cu_seqlens, device)
    if attn_backend != AttentionBackendEnum.FLASHINFER:
        return None
    cu = np.asarray(cu_seqlens, dtype=np.int32)
    return torch.from_numpy(cu[1:] - cu[:-1]).to(device, non_blocking=True)


def _recompute_2026_05(cls, attn_backend, cu_seqlens, hidden_size, tp_size, fp8_padded_hidden_size=None):
    if (oot := maybe_get_oot_by_class(cls)) is not cls:
        return oot.maybe_recompute_cu_seqlens(attn_backend, cu_seqlens, hidden_size, tp_size,
                                              fp8_padded_hidden_size=fp8_padded_hidden_size)
    return np.ascontiguousarray(cu_seqlens, dtype=np.int32)


def _seq_lens_2026_05(cls, attn_backend, cu_seqlens):
    if (oot := maybe_get_oot_by_class(cls)) is not cls:
        return oot.maybe_compute_seq_lens(attn_backend, cu_seqlens)
    if attn_backend != AttentionBackendEnum.FLASHINFER:
        return None
    cu = np.asarray(cu_seqlens, dtype=np.int32)
    return cu[1:] - cu[:-1]


@CustomOp.register("mm_encoder_attn")
class MMEncoderAttention(CustomOp):
    """Multi-headed attention without any cache, used for multimodal encoders."""

    compute_max_seqlen = classmethod(_compute_max_seqlen)
    maybe_recompute_cu_seqlens = classmethod(_recompute_2026_09)
    maybe_compute_seq_lens = classmethod(_seq_lens_2026_09)

    def __init__(self, num_heads, head_size, scale=None, num_kv_heads=None, prefix=""):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = 1.0 / (head_size ** 0.5) if scale is None else scale
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.layer_name = prefix
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads ({self.num_heads}) is not divisible by num_kv_heads ({self.num_kv_heads})")
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.dtype = torch.get_default_dtype()
        self.attn_backend = get_vit_attn_backend(head_size=head_size, dtype=self.dtype)
        self.is_flash_attn_backend = self.attn_backend in {AttentionBackendEnum.FLASH_ATTN,
                                                           AttentionBackendEnum.ROCM_AITER_FA}
        self._fa_version = get_flash_attn_version(head_size=head_size) if self.is_flash_attn_backend else None
        logger.info_once(f"Using {self.attn_backend} for MMEncoderAttention.")
        self._init_fp8_state()

    def _init_fp8_state(self):
        self.fp8_enabled = False
        self._fp8_dynamic_scale = False
        self.fp8_quant = None
        self.skip_scale_q = self.skip_scale_k = self.skip_scale_v = False
        cfg = get_multimodal_config()
        if cfg is None or cfg.mm_encoder_attn_dtype != "fp8":
            return
        if not is_flashinfer_cudnn_fp8_prefill_attn_supported():
            raise ValueError(FP8_UNSUPPORTED_MESSAGE)
        self.fp8_enabled = True
        self._fp8_dynamic_scale = cfg.mm_encoder_fp8_scale_path is None
        self.fp8_quant = "static-per-tensor"   # vLLM: QuantFP8(static=True, group_shape=PER_TENSOR)
        for attr in ("_fp8_q_scale", "_fp8_k_scale", "_fp8_v_scale"):
            self.register_buffer(attr, torch.ones(1, dtype=torch.float32).view(1, 1, 1, 1))
        if self._fp8_dynamic_scale:
            for attr in ("_fp8_q_amax", "_fp8_k_amax", "_fp8_v_amax"):
                self.register_buffer(attr, torch.zeros(FP8_AMAX_HISTORY_LEN, dtype=torch.float32), persistent=False)
            self._fp8_amax_pos = 0
        if cfg.mm_encoder_fp8_scale_save_path is not None and self._fp8_dynamic_scale:
            global _fp8_scale_save_path, _fp8_scale_save_margin
            _fp8_scale_save_path = cfg.mm_encoder_fp8_scale_save_path
            _fp8_scale_save_margin = cfg.mm_encoder_fp8_scale_save_margin

    def process_weights_after_loading(self, act_dtype):
        """Called by the loader on every instance: fills the static FP8 scales from the scale file."""
        if not self.fp8_enabled:
            return
        cfg = get_multimodal_config()
        path = cfg.mm_encoder_fp8_scale_path if cfg is not None else None
        if path is None:
            return
        scales = _load_fp8_scales_file(path)
        entry = scales.get(self.layer_name)
        if entry is None:
            raise ValueError(f"FP8 attention enabled but scales not found for layer '{self.layer_name}' in {path}. "
                             f"Available layers: {list(scales)}")
        for attr, c in (("_fp8_q_scale", "q"), ("_fp8_k_scale", "k"), ("_fp8_v_scale", "v")):
            getattr(self, attr).fill_(entry[c])
        self.skip_scale_q, self.skip_scale_k, self.skip_scale_v = (entry[c] == 1.0 for c in "qkv")

    @classmethod
    def enabled(cls):
        return True

    # ---- forwards ----------------------------------------------------------------------------------------------

    def _forward_sdpa(self, query, key, value, cu_seqlens=None):
        return reference_attention(query, key, value, cu_seqlens, self.scale, self.num_heads, self.num_kv_heads,
                                   self.head_size)

    def _forward_fa(self, query, key, value, cu_seqlens=None, max_seqlen=None):
        assert (cu_seqlens is not None and max_seqlen is not None) or (cu_seqlens is None and max_seqlen is None), \
            "cu_seqlens and max_seqlen should be both set or both None."
        return self._forward_sdpa(query, key, value, cu_seqlens)

    @torch.no_grad()
    def _record_amax_and_update_scales(self, query, key, value):
        pos = self._fp8_amax_pos
        self._fp8_amax_pos = (pos + 1) % FP8_AMAX_HISTORY_LEN
        for t, amax, scale in ((query, self._fp8_q_amax, self._fp8_q_scale), (key, self._fp8_k_amax, self._fp8_k_scale),
                               (value, self._fp8_v_amax, self._fp8_v_scale)):
            amax[pos] = t.abs().amax().float()
            scale.fill_(torch.clamp(amax.max(), min=torch.finfo(torch.float32).tiny) / FP8_MAX)
        wrapped = self._fp8_amax_pos == 0 and pos == FP8_AMAX_HISTORY_LEN - 1
        _maybe_save_fp8_scales(self.layer_name, self._fp8_q_scale, self._fp8_k_scale, self._fp8_v_scale, wrapped)

    def _forward_flashinfer(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        if self.fp8_enabled:
            if self._fp8_dynamic_scale:
                self._record_amax_and_update_scales(query, key, value)

            def qdq(x, s):
                s = s.reshape(())
                return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)
            query, key, value = qdq(query, self._fp8_q_scale), qdq(key, self._fp8_k_scale), qdq(value, self._fp8_v_scale)
        return self._forward_sdpa(query, key, value, cu_seqlens)

    def forward_native(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        return self._forward_sdpa(query, key, value, cu_seqlens)

    def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        if self.is_flash_attn_backend:
            return self._forward_fa(query, key, value, cu_seqlens, max_seqlen)
        if self.attn_backend == AttentionBackendEnum.TRITON_ATTN:
            return self._forward_fa(query, key, value, cu_seqlens, max_seqlen)
        if self.attn_backend == AttentionBackendEnum.FLASHINFER:
            return self._forward_flashinfer(query, key, value, cu_seqlens, max_seqlen, sequence_lengths)
        if self.attn_backend == AttentionBackendEnum.TORCH_SDPA:
            return self._forward_sdpa(query, key, value, cu_seqlens)
        raise ValueError(f"Unsupported multi-modal encoder attention backend for CUDA: {self.attn_backend}.")

    def forward_cpu(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        return self._forward_sdpa(query, key, value, cu_seqlens)


def use_signature(signature):
    """Installs the classmethods of `signature` ("2026_05" or "2026_09") on MMEncoderAttention."""
    global SIGNATURE
    if signature == SIGNATURE_2026_09:
        MMEncoderAttention.maybe_recompute_cu_seqlens = classmethod(_recompute_2026_09)
        MMEncoderAttention.maybe_compute_seq_lens = classmethod(_seq_lens_2026_09)
    elif signature == SIGNATURE_2026_05:
        MMEncoderAttention.maybe_recompute_cu_seqlens = classmethod(_recompute_2026_05)
        MMEncoderAttention.maybe_compute_seq_lens = classmethod(_seq_lens_2026_05)
    else:
        raise ValueError(f"unknown signature {signature!r}")
    SIGNATURE = signature


def encoder_metadata(attn_backend, cu_seqlens, hidden_size, tp_size, device):
    """What a vision tower does with the classmethods under the current SIGNATURE: (cu_seqlens on the device,
    sequence_lengths or None, max_seqlen as a CPU 0-d int32 tensor)."""
    cu_np = np.ascontiguousarray(cu_seqlens, dtype=np.int32)
    cls = MMEncoderAttention
    if SIGNATURE == SIGNATURE_2026_09:
        cu = cls.maybe_recompute_cu_seqlens(attn_backend, cu_np, hidden_size, tp_size, device)
        seq = cls.maybe_compute_seq_lens(attn_backend, cu_np, device)
    else:
        cu = torch.from_numpy(cls.maybe_recompute_cu_seqlens(attn_backend, cu_np, hidden_size, tp_size)).to(
            device, non_blocking=True)
        seq = cls.maybe_compute_seq_lens(attn_backend, cu_np)
        seq = None if seq is None else torch.from_numpy(np.asarray(seq)).to(device, non_blocking=True)
    max_seqlen = torch.tensor(cls.compute_max_seqlen(attn_backend, cu_np), dtype=torch.int32, device="cpu")
    return cu, seq, max_seqlen


def _reset():
    global _fp8_scale_save_path, _fp8_scale_save_margin
    _fp8_scale_save_path = None
    _fp8_scale_save_margin = MultiModalConfig.mm_encoder_fp8_scale_save_margin
    _fp8_saved_scale_refs.clear()
    _load_fp8_scales_file.cache_clear()
    use_signature(SIGNATURE_2026_09)
