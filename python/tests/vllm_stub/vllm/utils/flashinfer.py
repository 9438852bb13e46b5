from vllm.platforms import current_platform


def is_flashinfer_cudnn_fp8_prefill_attn_supported():
    """vLLM's gate for FP8 encoder attention: FlashInfer's cuDNN prefill, SM100+ and cuDNN >= 9.17.1."""
    if not current_platform.is_cuda() or current_platform.get_device_capability().major < 10:
        return False
    import torch
    v = torch.backends.cudnn.version() or 0
    return v >= 91701
