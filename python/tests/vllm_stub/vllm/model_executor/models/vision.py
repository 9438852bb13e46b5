from vllm.config import get_current_vllm_config


def get_multimodal_config():
    """The multimodal config of the vLLM config current at model construction (None without one)."""
    return get_current_vllm_config().model_config.multimodal_config


def get_vit_attn_backend(head_size, dtype, attn_backend_override=None):
    """The ViT attention backend: the override (argument, else --mm-encoder-attn-backend), else FLASH_ATTN on
    CUDA SM80+ for fp16/bf16 and head sizes that are multiples of 8, else TORCH_SDPA."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    if attn_backend_override is None:
        cfg = get_multimodal_config()
        attn_backend_override = getattr(cfg, "mm_encoder_attn_backend", None)
    if attn_backend_override is not None:
        if isinstance(attn_backend_override, str):
            return AttentionBackendEnum[attn_backend_override.upper()]
        return attn_backend_override
    if (current_platform.is_cuda() and current_platform.get_device_capability().major >= 8
            and dtype in (torch.float16, torch.bfloat16) and head_size % 8 == 0):
        return AttentionBackendEnum.FLASH_ATTN
    return AttentionBackendEnum.TORCH_SDPA
