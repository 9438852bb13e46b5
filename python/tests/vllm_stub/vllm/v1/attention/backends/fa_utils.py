from vllm.platforms import current_platform


def get_flash_attn_version(requires_alibi=False, head_size=None):
    """FA3 on Hopper, FA2 elsewhere (vLLM's choice on CUDA)."""
    return 3 if current_platform.get_device_capability().major == 9 else 2
