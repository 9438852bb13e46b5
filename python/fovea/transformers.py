"""fovea's attention inside transformers' Qwen3-VL / Qwen3.5 vision towers (docs/python.md).

    import fovea.transformers
    fovea.transformers.register()                       # adds the "fovea_flash" implementation
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa", ...)
    fovea.transformers.enable(model)                    # the vision tower only; the text model keeps sdpa
    fovea.transformers.enable(model, fp8="static", scale_path="scales.json")   # or fp8="dynamic"
    fovea.transformers.enable(model, fused=False)       # keep transformers' forward and RoPE

The vision attention takes transformers' packed path (one call per layer over every image, with
cu_seqlens) only for an implementation whose name contains "flash"; any other name gets one call per
image per layer, each behind a host sync. So the name is "fovea_flash". transformers (5.x) also tries
to import a flash kernel for such a name when it validates it at model construction
(_check_and_adjust_attn_implementation), which fails for a name that is not a Hub kernel: enable()
therefore sets the vision config's implementation directly (what
`model.set_attn_implementation({"vision_config": "fovea_flash"})` on the top-level model also does),
rather than through from_pretrained's attn_implementation.

fused=True (the default) goes further: it replaces each vision attention module's forward, so fovea gets the qkv
projection's output and the RoPE tables and rotates, quantizes and lays out Q, K and V in one step
(transformers' fp32 RoPE kernels and copies are skipped; in BF16 the result is bit for bit the
unfused one). Measured on an H200 (bench/RESULTS.md) it is the faster path by far; it depends on the
module's attribute names (qkv, proj, num_heads) and its forward's arguments, which transformers 5.x
share across Qwen3-VL and Qwen3.5.
"""
import types
import warnings

import torch

from . import torch as fovea_torch

NAME = "fovea_flash"
stats = {"packed_calls": 0, "single_calls": 0}  # eager calls by kind (a check that the packed path ran)


def attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, is_causal=False,
                      cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers' attention contract: query/key/value [B, H, S, D] -> ([B, S, H, D], None)."""
    if attention_mask is not None:
        raise ValueError("fovea attention takes no attention mask (vision towers pass none); use sdpa for masked attention")
    if is_causal:
        raise ValueError("fovea attention is non-causal (vision towers)")
    if dropout:
        raise ValueError("fovea attention has no dropout (inference only)")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError("fovea attention needs the same segments for queries and keys")
    fp8 = _fp8_kwargs(module)
    b, _, s, _ = query.shape
    counting = not torch.compiler.is_compiling()  # a counter read under torch.compile would be guarded on
    if cu_seq_lens_q is not None and b == 1:
        if counting:
            stats["packed_calls"] += 1
        out = fovea_torch.varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                           cu_seq_lens_q, softmax_scale=scaling, **fp8)
        return out.unsqueeze(0), None
    if counting:
        stats["single_calls"] += 1
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)  # each batch row one segment (host: no sync)
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3]) for x in (query, key, value)]
    out = fovea_torch.varlen_attention(*flat, cu, softmax_scale=scaling, **fp8)
    return out.view(b, s, query.shape[1], query.shape[3]), None


def _fp8_kwargs(module):
    book = getattr(module, "fovea_scales", None)
    return book.layer(module.fovea_layer) if book is not None else {}


def _half_table(t, half):
    # transformers' tables are [S, head_dim] with both halves equal (cat(freqs, freqs)); fovea's are
    # [S, head_dim / 2] float32 (a model cast to bf16 casts them too: converted back exactly).
    return t[:, :half].float().contiguous()


def fused_forward(self, hidden_states, cu_seqlens, rotary_pos_emb=None, position_embeddings=None, **kwargs):
    """Qwen3-VL / Qwen3.5 vision attention with fovea's fused entry: the qkv projection's output and the
    RoPE tables go to fovea, which rotates, quantizes and lays them out in one step (transformers'
    fp32 RoPE kernels and the per-tensor copies are skipped); then the output projection."""
    s = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).view(s, 3, self.num_heads, -1)
    cos, sin = position_embeddings
    half = qkv.shape[-1] // 2
    if not torch.compiler.is_compiling():
        stats["packed_calls"] += 1
    out = fovea_torch.varlen_attention_qkv(qkv, cu_seqlens, _half_table(cos, half), _half_table(sin, half),
                                           **_fp8_kwargs(self))
    return self.proj(out.reshape(s, -1))


def register():
    """Adds fovea's attention to transformers' AttentionInterface as "fovea_flash"; returns the name."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention_forward)
    return NAME


def _vision(model):
    """The vision tower module and its config, for a whole VLM or a bare vision model."""
    for path in ("model.visual", "visual", "vision_model"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "blocks"):
            return obj
    if hasattr(model, "blocks"):
        return model
    raise ValueError(f"fovea: {type(model).__name__} has no Qwen3-VL-style vision tower (model.visual.blocks)")


def enable(model, fp8=None, scale_path=None, margin=1.5, fused=True):
    """Runs the vision tower's attention on fovea: BF16 (fp8=None), or FP8 with "dynamic" scaling,
    "static" scales from scale_path (vLLM's file), or "calibrate" (dynamic; the book's maybe_save()
    writes scale_path after 16 complete forwards). Returns the ScaleBook (None for BF16), which is
    registered on the tower as `fovea_scales` (its state moves with the model).
    fused=True (the default) also replaces each vision attention module's forward with fused_forward
    (fovea gets the fused qkv and the RoPE tables), where the module has the attributes it needs
    (qkv, proj, num_heads; otherwise a warning, and the interface path); fused=False leaves
    transformers' forward and its RoPE in place and takes the "fovea_flash" implementation's packed call."""
    register()
    vision = _vision(model)
    vision.config._attn_implementation = NAME
    book = None
    if fp8:
        device = next(vision.parameters()).device
        book = fovea_torch.ScaleBook(len(vision.blocks), fp8, scale_path, margin, device)
        vision.fovea_scales = book
    if fused and not all(hasattr(b.attn, a) for b in vision.blocks for a in ("qkv", "proj", "num_heads")):
        warnings.warn("fovea: this vision attention module lacks qkv / proj / num_heads: fused=True falls back to "
                      "transformers' forward with the fovea_flash implementation")
        fused = False
    for i, block in enumerate(vision.blocks):
        attn = block.attn
        attn.fovea_layer = i
        if fused:
            attn.forward = types.MethodType(fused_forward, attn)
        elif "forward" in attn.__dict__:
            del attn.forward  # back to transformers' own
        # Not a submodule of each layer (the tower owns it): a plain attribute.
        object.__setattr__(attn, "fovea_scales", book)
    stats["packed_calls"] = stats["single_calls"] = 0
    return book
