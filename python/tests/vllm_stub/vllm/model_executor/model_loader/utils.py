from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: F401  (re-exported, as vLLM's older layout)


def process_weights_after_loading(model, model_config_dtype, target_device=None):
    """The loader's auto-scan: process_weights_after_loading(act_dtype) on every MMEncoderAttention (PR #38065)
    after the other modules (the double has no quantized modules; vLLM's device_loading_context is a no-op here,
    every parameter being on the target device already)."""
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
    for _, module in model.named_modules():
        if isinstance(module, MMEncoderAttention) and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(model_config_dtype)
