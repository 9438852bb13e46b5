"""A small Qwen3-VL vision tower as vLLM builds it (patch embedding, blocks of Qwen2_5_VisionAttention + MLP,
2D RoPE tables, cu_seqlens through MMEncoderAttention's classmethods), with the encoder CUDA-graph interface
(prepare_encoder_cudagraph_capture_inputs / _replay_buffers, encoder_cudagraph_forward, padding_logics).
No window attention, no spatial merge, no deepstack: the attention contract is what the double is for."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm.model_executor.layers.attention.mm_encoder_attention import encoder_metadata
from vllm.model_executor.models.layers_common import ReplicatedLinear
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionAttention


class Qwen3_VisionMLP(nn.Module):
    def __init__(self, dim, hidden, prefix=""):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(dim, hidden, prefix=f"{prefix}.linear_fc1")
        self.linear_fc2 = ReplicatedLinear(hidden, dim, prefix=f"{prefix}.linear_fc2")

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)[0], approximate="tanh"))[0]


class Qwen3_VisionBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_hidden_dim, prefix=""):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen2_5_VisionAttention(embed_dim=dim, num_heads=num_heads, projection_size=dim,
                                            prefix=f"{prefix}.attn")
        self.mlp = Qwen3_VisionMLP(dim, mlp_hidden_dim, prefix=f"{prefix}.mlp")

    def forward(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin, max_seqlen, sequence_lengths=None):
        x = x + self.attn(self.norm1(x), cu_seqlens=cu_seqlens, rotary_pos_emb_cos=rotary_pos_emb_cos,
                          rotary_pos_emb_sin=rotary_pos_emb_sin, max_seqlen=max_seqlen,
                          sequence_lengths=sequence_lengths)
        return x + self.mlp(self.norm2(x))


def cu_seqlens_of(grid_thw):
    g = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.concatenate([[0], np.cumsum(np.repeat(g[:, 1] * g[:, 2], g[:, 0]))]).astype(np.int32)


def _pad_cu_seqlens(dst, src):
    """cu_seqlens into a captured buffer: zeroed, the real offsets copied, the rest repeats of the last real
    offset (empty segments; the padding tokens behind it belong to none)."""
    dst.zero_()
    n = src.shape[0]
    dst[:n].copy_(src)
    if dst.shape[0] > n:
        dst[n:].copy_(src[n - 1:n].expand(dst.shape[0] - n))


class Qwen3_VisionTransformer(nn.Module):
    def __init__(self, hidden_size=1152, num_heads=16, depth=3, intermediate_size=2048, patch_dim=96, prefix="visual"):
        super().__init__()
        self.hidden_size, self.num_heads, self.patch_dim = hidden_size, num_heads, patch_dim
        self.head_dim = hidden_size // num_heads
        self.patch_embed = ReplicatedLinear(patch_dim, hidden_size, bias=True, prefix=f"{prefix}.patch_embed")
        rdim = self.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim)),
                             persistent=False)
        self.blocks = nn.ModuleList([Qwen3_VisionBlock(hidden_size, num_heads, intermediate_size,
                                                       prefix=f"{prefix}.blocks.{i}") for i in range(depth)])
        self.norm = nn.LayerNorm(hidden_size, eps=1e-6)
        # vLLM's towers take the backend for the classmethods from their layers.
        self.attn_backend = self.blocks[0].attn.attn.attn_backend
        self.padding_logics = {"cu_seqlens": _pad_cu_seqlens}

    @property
    def device(self):
        return self.patch_embed.weight.device

    def rot_pos_emb(self, grid_thw):
        """cos, sin float32 [tokens, head_dim / 2]: (h * inv_freq, w * inv_freq) per token."""
        parts = []
        for t, h, w in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3):
            hp = torch.arange(h, device=self.device).repeat_interleave(w)
            wp = torch.arange(w, device=self.device).repeat(h)
            pos = torch.stack([hp, wp], -1).repeat(int(t), 1).float()
            parts.append(torch.cat([pos[:, :1] * self.inv_freq, pos[:, 1:] * self.inv_freq], -1))
        freqs = torch.cat(parts)
        return freqs.cos().contiguous(), freqs.sin().contiguous()

    def run_blocks(self, x, cu_seqlens, cos, sin, max_seqlen, sequence_lengths=None):
        x = x.unsqueeze(1)                                      # [s, 1, c]
        for blk in self.blocks:
            x = blk(x, cu_seqlens=cu_seqlens, rotary_pos_emb_cos=cos, rotary_pos_emb_sin=sin, max_seqlen=max_seqlen,
                    sequence_lengths=sequence_lengths)
        return self.norm(x.squeeze(1))

    def forward(self, pixel_values, grid_thw):
        cu, seq, max_seqlen = encoder_metadata(self.attn_backend, cu_seqlens_of(grid_thw), self.hidden_size, 1,
                                               self.device)
        cos, sin = self.rot_pos_emb(grid_thw)
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))[0]
        return self.run_blocks(x, cu, cos, sin, max_seqlen, seq)

    # ---- encoder CUDA graphs ---------------------------------------------------------------------------------

    def _values(self, pixel_values, grid_thw, max_seqlen=None):
        cu, _, ms = encoder_metadata(self.attn_backend, cu_seqlens_of(grid_thw), self.hidden_size, 1, self.device)
        cos, sin = self.rot_pos_emb(grid_thw)
        return {"pixel_values": pixel_values, "cu_seqlens": cu, "rotary_pos_emb_cos": cos, "rotary_pos_emb_sin": sin,
                "max_seqlen": ms if max_seqlen is None else torch.tensor(max_seqlen, dtype=torch.int32)}

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget, max_batch_size, device, dtype):
        """Dummy grids filling the budget with max_batch_size items; max_seqlen = the budget."""
        per = token_budget // max_batch_size
        grids = [(1, 1, per)] * (max_batch_size - 1) + [(1, 1, token_budget - per * (max_batch_size - 1))]
        px = torch.zeros(token_budget, self.patch_dim, device=device, dtype=dtype)
        return self._values(px, grids, max_seqlen=token_budget)

    def prepare_encoder_cudagraph_replay_buffers(self, pixel_values, grid_thw, max_batch_size, token_budget):
        if len(grid_thw) > max_batch_size:
            raise ValueError(f"{len(grid_thw)} items > max_batch_size {max_batch_size}")
        return self._values(pixel_values, grid_thw, max_seqlen=token_budget)

    def encoder_cudagraph_forward(self, values):
        x = self.patch_embed(values["pixel_values"])[0]
        return self.run_blocks(x, values["cu_seqlens"], values["rotary_pos_emb_cos"], values["rotary_pos_emb_sin"],
                               values["max_seqlen"])
