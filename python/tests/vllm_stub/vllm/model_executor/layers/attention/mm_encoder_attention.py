import torch

from vllm.model_executor.custom_op import CustomOp, maybe_get_oot_by_class
from vllm.model_executor.models.vision import get_multimodal_config


@CustomOp.register("mm_encoder_attn")
class MMEncoderAttention(CustomOp):
    def __init__(self, num_heads, head_size, scale=None, num_kv_heads=None, prefix=""):
        super().__init__()
        self.num_heads, self.head_size, self.layer_name = num_heads, head_size, prefix
        self.scale = 1.0 / (head_size ** 0.5) if scale is None else scale
        cfg = get_multimodal_config()
        if cfg is not None and cfg.mm_encoder_attn_dtype == "fp8" and torch.cuda.get_device_capability()[0] < 10:
            raise ValueError("mm_encoder_attn_dtype='fp8' requires the FlashInfer cuDNN backend with cuDNN >= 9.17.1 "
                             "on a GPU with native FP8 support.")

    @classmethod
    def enabled(cls):
        return True

    @classmethod
    def maybe_recompute_cu_seqlens(cls, attn_backend, cu_seqlens, hidden_size, tp_size, device, fp8_padded_hidden_size=None):
        if (oot := maybe_get_oot_by_class(cls)) is not cls:
            return oot.maybe_recompute_cu_seqlens(attn_backend, cu_seqlens, hidden_size, tp_size, device,
                                                  fp8_padded_hidden_size=fp8_padded_hidden_size)
        return torch.from_numpy(cu_seqlens).to(device, non_blocking=True)

    def forward_native(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        raise AssertionError("the stub's forward_native is never the path under test")

    def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        raise AssertionError("vLLM's own forward_cuda ran: the out-of-tree class was not used")
