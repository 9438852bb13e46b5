"""A stub of exactly the vLLM hooks fovea.vllm uses, shaped as vLLM's source has them (CustomOp's
out-of-tree registry and __new__ swap, MMEncoderAttention's constructor, forward_cuda and host-side
classmethod, the multimodal config): for tests, not vLLM."""
from dataclasses import dataclass


@dataclass
class MultiModalConfig:
    mm_encoder_attn_dtype: str | None = None
    mm_encoder_fp8_scale_path: str | None = None
    mm_encoder_fp8_scale_save_path: str | None = None
    mm_encoder_fp8_scale_save_margin: float = 1.5


_config = None


def set_config(cfg):
    global _config
    _config = cfg


def reset():
    from .model_executor import custom_op
    custom_op.op_registry_oot.clear()
    set_config(None)
