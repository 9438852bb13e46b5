from .mm_encoder_attention import MMEncoderAttention  # noqa: F401
