"""The loader's order: default dtype, device context, construction, load_weights, process_weights_after_loading;
no .to() anywhere."""
from vllm.config import ModelConfig, VllmConfig, get_current_vllm_config, set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype


def load_dummy_weights(model, seed=0):
    """Stands in for load_weights: deterministic values written in place into the parameters (wherever they
    are), the same for every dtype (drawn in fp32 and rounded to bf16 first), so a model built in float64 holds
    exactly the bf16 model's weights."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        if p.dim() >= 2:
            w = torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5)
        elif name.endswith("bias"):
            w = torch.randn(p.shape, generator=g) * 0.02
        else:  # norm weights
            w = 1.0 + torch.randn(p.shape, generator=g) * 0.02
        with torch.no_grad():
            p.copy_(w.bfloat16())


def build_model(model_cls, *args, dtype=None, device="cuda", vllm_config=None, seed=0, **kwargs):
    """model_cls(*args, **kwargs) as vLLM's BaseModelLoader.load_model builds a model: under the vLLM config,
    set_default_torch_dtype(dtype) and `with torch.device(device)`, then weights, then
    process_weights_after_loading(act_dtype) on every MMEncoderAttention; returns model.eval()."""
    import torch
    dtype = torch.bfloat16 if dtype is None else dtype
    cfg = vllm_config if vllm_config is not None else get_current_vllm_config()
    if cfg.model_config.dtype is None:
        cfg.model_config.dtype = dtype
    with set_current_vllm_config(cfg):
        with set_default_torch_dtype(dtype):
            with torch.device(device):
                model = model_cls(*args, **kwargs)
            load_dummy_weights(model, seed)
            process_weights_after_loading(model, dtype, torch.device(device))
    return model.eval()


__all__ = ["build_model", "load_dummy_weights", "ModelConfig", "VllmConfig"]
