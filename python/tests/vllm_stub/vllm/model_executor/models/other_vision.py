"""Other vision attention shapes vLLM has, each around one MMEncoderAttention:
  SimpleVisionAttention: [B, S, H*D] inputs (3-D), any head size (88 among them), GQA via num_kv_heads;
  CompassVisionAttention: a tower whose code reads attn.attn_backend / is_flash_attn_backend / _fa_version /
    fp8_enabled (DeepSeek-V4 vision, Cohere-Compass style);
  CrossAttention: kv_len != q_len, no cu_seqlens;
  AttentionOnly / MixedTower: bare layers at given prefixes (the loader's view), one block built in fp16."""
import torch
import torch.nn as nn

from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention, encoder_metadata
from vllm.model_executor.models.layers_common import ReplicatedLinear
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.registry import AttentionBackendEnum


class AttentionOnly(nn.Module):
    """MMEncoderAttention layers at `prefixes` (module attribute layers[i].attn)."""

    def __init__(self, num_heads=16, head_size=72, prefixes=("visual.blocks.0.attn.attn",), num_kv_heads=None):
        super().__init__()
        self.layers = nn.ModuleList()
        for p in prefixes:
            holder = nn.Module()
            holder.attn = MMEncoderAttention(num_heads=num_heads, head_size=head_size, scale=head_size ** -0.5,
                                             num_kv_heads=num_kv_heads, prefix=p)
            self.layers.append(holder)


class SimpleVisionAttention(nn.Module):
    def __init__(self, dim, num_heads, head_size, num_kv_heads=None, prefix=""):
        super().__init__()
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.qkv = ReplicatedLinear(dim, (num_heads + 2 * self.num_kv_heads) * head_size, prefix=f"{prefix}.qkv")
        self.proj = ReplicatedLinear(num_heads * head_size, dim, prefix=f"{prefix}.proj")
        self.attn = MMEncoderAttention(num_heads=num_heads, head_size=head_size, scale=head_size ** -0.5,
                                       num_kv_heads=num_kv_heads, prefix=f"{prefix}.attn")

    def forward(self, x, cu_seqlens, max_seqlen):           # x [s, dim]
        qkv, _ = self.qkv(x.to(self.qkv.weight.dtype))
        q, k, v = qkv.split([self.num_heads * self.head_size, self.num_kv_heads * self.head_size,
                             self.num_kv_heads * self.head_size], dim=-1)
        out = self.attn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self.proj(out.squeeze(0))[0]


class MixedTower(nn.Module):
    """blocks.0: MHA hd 72 (bf16); blocks.1: GQA 16/4 hd 72; blocks.2: hd 88; blocks.3: MHA hd 72 built in fp16."""

    def __init__(self, dim=1152, prefix="visual"):
        super().__init__()
        self.dim = dim
        b = [SimpleVisionAttention(dim, 16, 72, prefix=f"{prefix}.blocks.0.attn"),
             SimpleVisionAttention(dim, 16, 72, num_kv_heads=4, prefix=f"{prefix}.blocks.1.attn"),
             SimpleVisionAttention(dim, 16, 88, prefix=f"{prefix}.blocks.2.attn")]
        with set_default_torch_dtype(torch.float16):
            b.append(SimpleVisionAttention(dim, 16, 72, prefix=f"{prefix}.blocks.3.attn"))
        self.blocks = nn.ModuleList(b)

    def forward(self, x, cu_seqlens_np):
        dtype = x.dtype
        for blk in self.blocks:
            cu, _, ms = encoder_metadata(blk.attn.attn_backend, cu_seqlens_np, self.dim, 1, x.device)
            x = (x + blk(x, cu, ms).to(dtype))
        return x


class CompassVisionAttention(nn.Module):
    """Model code that reads the layer's backend attributes at construction and in forward."""

    def __init__(self, dim=1152, num_heads=16, depth=2, prefix="vision_tower"):
        super().__init__()
        self.dim = dim
        self.blocks = nn.ModuleList([SimpleVisionAttention(dim, num_heads, dim // num_heads,
                                                           prefix=f"{prefix}.layers.{i}.self_attn")
                                     for i in range(depth)])
        attn = self.blocks[0].attn
        if attn.attn_backend not in {AttentionBackendEnum.FLASH_ATTN, AttentionBackendEnum.TORCH_SDPA,
                                     AttentionBackendEnum.FLASHINFER, AttentionBackendEnum.TRITON_ATTN,
                                     AttentionBackendEnum.ROCM_AITER_FA}:
            raise RuntimeError(f"Compass vision does not support {attn.attn_backend} backend now.")
        self.use_max_seqlen = attn.is_flash_attn_backend or attn.attn_backend in {
            AttentionBackendEnum.TRITON_ATTN, AttentionBackendEnum.FLASHINFER}
        self.fa_version = attn._fa_version
        self.fp8 = attn.fp8_enabled
        self.pad_heads = attn.num_queries_per_kv  # read, unused

    def forward(self, x, cu_seqlens_np):
        attn = self.blocks[0].attn
        cu, _, ms = encoder_metadata(attn.attn_backend, cu_seqlens_np, self.dim, 1, x.device)
        ms = ms if self.use_max_seqlen else None
        for blk in self.blocks:
            x = x + blk(x, cu, ms)
        return x


class CrossAttention(nn.Module):
    """q from x [Sq, dim], k/v from ctx [Skv, dim]; [1, S, H, D] inputs, no cu_seqlens (kv_len != q_len)."""

    def __init__(self, dim=1152, num_heads=16, prefix="visual.resampler.attn"):
        super().__init__()
        self.h, self.d = num_heads, dim // num_heads
        self.q = ReplicatedLinear(dim, dim, prefix=f"{prefix}.q")
        self.kv = ReplicatedLinear(dim, 2 * dim, prefix=f"{prefix}.kv")
        self.attn = MMEncoderAttention(num_heads=num_heads, head_size=self.d, scale=self.d ** -0.5,
                                       prefix=f"{prefix}.attn")

    def forward(self, x, ctx):
        q = self.q(x)[0].view(1, x.shape[0], self.h, self.d)
        k, v = self.kv(ctx)[0].view(1, ctx.shape[0], 2, self.h, self.d).unbind(2)
        return self.attn(q, k, v).reshape(x.shape[0], -1)
