"""fovea: FP8/BF16 varlen attention for vision encoders (docs/python.md).

    fovea.attention     the C ABI over raw pointers, FP8 state and scale files (no torch)
    fovea.torch         torch.library ops: fovea::varlen_attention (+ fake kernels), FP8 scale books
    fovea.transformers  an attention implementation for Qwen3-VL / Qwen3.5 vision towers
    fovea.vllm          a vLLM general plugin replacing MMEncoderAttention
Importing this package loads nothing; the library is loaded on first use (fovea._lib).
"""
__version__ = "0.1.0"
