import enum


class AttentionBackendEnum(enum.Enum):
    FLASH_ATTN = "FLASH_ATTN"
    TRITON_ATTN = "TRITON_ATTN"
    ROCM_AITER_FA = "ROCM_AITER_FA"
    TORCH_SDPA = "TORCH_SDPA"
    FLASHINFER = "FLASHINFER"
