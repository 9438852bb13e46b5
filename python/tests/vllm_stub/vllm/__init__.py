"""A double of vLLM where fovea's plugin meets it: written from vLLM's source (no vLLM code copied), same
names, signatures and behaviour at the plugin's contact points; real attention (torch SDPA per segment).

Pinned sources (vllm-project/vllm as stored in the code index; "id" where the index gives no commit):
  vllm/model_executor/custom_op.py ............ index id 409924691 (CustomOp/PluggableLayer/op_registry_oot,
                                                dispatch_forward with forward_oot); older stored 8b74282de066
  vllm/model_executor/layers/attention/mm_encoder_attention.py
                                                index id 52153638207 (2026, _init_fp8_state, FP8 buffers,
                                                process_weights_after_loading, 2026_09 classmethods);
                                                also read c0ea3dc11a9d and 03037b4293e3 (pre-FP8)
  vllm/plugins/__init__.py .................... 01425553bdbed63400efa72ff14a8f4ffe20bada
  vllm/model_executor/model_loader/base_loader.py 01f62d3ec2d08e2e2c818871f69099831dd02f44
  vllm/model_executor/model_loader/utils.py ... 000796acdf1e (set_default_torch_dtype); the MMEncoderAttention
                                                auto-scan of process_weights_after_loading from index ids
                                                56390487452 / 70247175139 (annotated copies) and vllm-facts.md
  vllm/model_executor/models/qwen2_5_vl.py .... 002d181a55a0 (split_qkv, block shape); the 2026 forward
                                                (cos/sin tables, self.attn(query=...)) from index id 34624758
                                                (glm4v, same pattern); qwen3_vl.py stored at 4f5768c74b6f
  vllm/v1/worker/encoder_cudagraph.py ......... 034e78dd993c850fb567588030004d61ee161d2c
  vllm/utils/torch_utils.py ................... 959009b402c3 (set_default_torch_dtype)
Modelled from ../shared/docs/vllm-facts.md, not from a stored version: the 2026_05 classmethod signature (no
`device`, numpy returned), max_seqlen as a CPU 0-d tensor, the FP8 SM100+ gate's wording of PR #45251,
cu_seqlens padding by repeats for encoder CUDA graphs.

Not modelled: tensor parallelism (tp = 1), flash-attn/FlashInfer kernels (SDPA stands in; FlashInfer's
element-offset cu_seqlens are not produced), torch.compile of forward_native, window attention, DP sharding,
multi-path/axis encoder graphs, device_loading_context.

Test knobs: reset(signature=...), set_config(MultiModalConfig|None), vllm.platforms.simulate_device_capability,
vllm.plugins.register_entry_point, build_model (the loader's construction order).
"""
from vllm.config import CompilationConfig, ModelConfig, MultiModalConfig, VllmConfig  # noqa: F401


def set_config(cfg):
    """Sets the multimodal config of the process's default vLLM config (None: no multimodal config)."""
    from vllm import config
    config.get_current_vllm_config().model_config.multimodal_config = cfg


def current_config():
    from vllm import config
    return config.get_current_vllm_config()


def build_model(model_cls, *args, **kwargs):
    from vllm.model_executor.model_loader.base_loader import build_model as _build
    return _build(model_cls, *args, **kwargs)


def reset(signature="2026_09"):
    """A fresh process as far as the double goes: empty OOT registry, default config, no plugins loaded,
    Qwen2_5_VisionAttention.forward restored, classmethods of `signature`."""
    from vllm import config, plugins
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.attention import mm_encoder_attention
    from vllm.model_executor.models import qwen2_5_vl
    custom_op.op_registry_oot.clear()
    config._reset()
    plugins._reset()
    mm_encoder_attention._reset()
    mm_encoder_attention.use_signature(signature)
    qwen2_5_vl.Qwen2_5_VisionAttention.forward = qwen2_5_vl.ORIGINAL_FORWARD
