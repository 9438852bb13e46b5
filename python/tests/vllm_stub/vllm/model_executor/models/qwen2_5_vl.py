"""Qwen2_5_VisionAttention, the attention Qwen3-VL's vision blocks use in vLLM (2026 shape): qkv projection,
split, [s, b] -> [b, s] contiguous copies, RoPE from cos/sin tables on cat(q, k), self.attn(query=, key=,
value=, cu_seqlens=, max_seqlen=), back to [s, b, h*d], proj. ORIGINAL_FORWARD keeps the class's own forward
(a plugin may replace Qwen2_5_VisionAttention.forward, as vllm-ascend does)."""
import torch
import torch.nn as nn

from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
from vllm.model_executor.models.layers_common import ApplyRotaryEmb, QKVParallelLinear, RowParallelLinear


class Qwen2_5_VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, projection_size, quant_config=None, prefix=""):
        super().__init__()
        self.tp_size, self.tp_rank = 1, 0
        self.hidden_size_per_attention_head = projection_size // num_heads
        self.num_attention_heads_per_partition = num_heads
        self.qkv = QKVParallelLinear(hidden_size=embed_dim, head_size=self.hidden_size_per_attention_head,
                                     total_num_heads=num_heads, total_num_kv_heads=num_heads, bias=True,
                                     prefix=f"{prefix}.qkv")
        self.proj = RowParallelLinear(projection_size, embed_dim, bias=True, prefix=f"{prefix}.proj")
        self.attn = MMEncoderAttention(num_heads=self.num_attention_heads_per_partition,
                                       head_size=self.hidden_size_per_attention_head,
                                       scale=self.hidden_size_per_attention_head ** -0.5, prefix=f"{prefix}.attn")
        self.apply_rotary_emb = ApplyRotaryEmb(enforce_enable=True, enable_fp32_compute=True)

    def split_qkv(self, qkv):
        # [s, b, 3 * head * head_dim] -> 3 x [s, b, head, head_dim]
        seq_len, bs, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        shape = (seq_len, bs, self.num_attention_heads_per_partition, self.hidden_size_per_attention_head)
        return tuple(x.view(*shape) for x in (q, k, v))

    def forward(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin, max_seqlen=None, sequence_lengths=None):
        x, _ = self.qkv(x)                                    # [s, b, 3 * h * d]
        q, k, v = self.split_qkv(x)
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))   # [b, s, h, d] copies
        if rotary_pos_emb_cos is not None and rotary_pos_emb_sin is not None:
            qk = self.apply_rotary_emb(torch.cat([q, k], dim=0), rotary_pos_emb_cos, rotary_pos_emb_sin)
            q, k = qk.chunk(2, dim=0)
        context = self.attn(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                            sequence_lengths=sequence_lengths)
        b, s = context.shape[:2]
        context = context.transpose(0, 1).reshape(s, b, -1).contiguous()   # "b s h d -> s b (h d)"
        output, _ = self.proj(context)
        return output


ORIGINAL_FORWARD = Qwen2_5_VisionAttention.forward
