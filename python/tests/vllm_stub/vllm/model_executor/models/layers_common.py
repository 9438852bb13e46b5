"""Small stand-ins for vLLM's linear layers (tp = 1): parameters made with torch.empty under the loader's
device and dtype context, forward returning (output, bias) as vLLM's parallel linears do."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, prefix=""):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class QKVParallelLinear(ReplicatedLinear):
    """[q (all heads) | k | v] along the last dimension."""

    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True, prefix=""):
        kv = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        super().__init__(hidden_size, (total_num_heads + 2 * kv) * head_size, bias, prefix)
        self.hidden_size = hidden_size
        self.num_heads, self.num_kv_heads, self.head_size = total_num_heads, kv, head_size


RowParallelLinear = ReplicatedLinear


def apply_rotary_emb(x, cos, sin):
    """vLLM's ApplyRotaryEmb(enable_fp32_compute=True), neox style: x [B, S, H, D]; cos, sin [S, D/2] float32:
    (x1 cos - x2 sin, x2 cos + x1 sin) over the halves, computed in fp32, rounded once to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.float()[None, :, None, :], sin.float()[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class ApplyRotaryEmb(nn.Module):
    def __init__(self, enforce_enable=True, enable_fp32_compute=True):
        super().__init__()

    def forward(self, x, cos, sin):
        return apply_rotary_emb(x, cos, sin)
