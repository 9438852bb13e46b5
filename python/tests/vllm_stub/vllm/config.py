"""vLLM's config objects as far as MMEncoderAttention, the loader and the encoder CUDA-graph manager read them."""
import contextlib
from dataclasses import dataclass, field


@dataclass
class MultiModalConfig:
    mm_encoder_attn_backend: object = None          # None, an AttentionBackendEnum member or its name
    mm_encoder_attn_dtype: str | None = None        # "fp8" or None
    mm_encoder_fp8_scale_path: str | None = None
    mm_encoder_fp8_scale_save_path: str | None = None
    mm_encoder_fp8_scale_save_margin: float = 1.5
    mm_encoder_tp_mode: str = "weights"


@dataclass
class CompilationConfig:
    custom_ops: list = field(default_factory=lambda: ["all"])  # "none" is the default under Inductor
    enabled_custom_ops: set = field(default_factory=set)
    disabled_custom_ops: set = field(default_factory=set)
    mode: int = 0                                   # CompilationMode.NONE
    backend: str = "eager"
    cudagraph_mm_encoder: bool = False
    compile_mm_encoder: bool = False
    encoder_cudagraph_token_budgets: list = field(default_factory=list)
    encoder_cudagraph_max_vision_items_per_batch: int = 0


@dataclass
class ModelConfig:
    dtype: object = None
    multimodal_config: MultiModalConfig | None = None


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)


_default = VllmConfig()
_current = None


def get_current_vllm_config():
    """The config set by set_current_vllm_config (model construction), else the process default."""
    return _current if _current is not None else _default


def get_cached_compilation_config():
    return get_current_vllm_config().compilation_config


@contextlib.contextmanager
def set_current_vllm_config(cfg):
    global _current
    old, _current = _current, cfg
    try:
        yield cfg
    finally:
        _current = old


def _reset():
    global _default, _current
    _default, _current = VllmConfig(), None
