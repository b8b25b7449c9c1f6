"""flash_cute: FlashAttention-3-style attention kernels for Hopper GPUs, in the CuTe DSL."""

# First: makes the CuTe DSL importable (flash_cute/_dsl.py).
from . import _dsl  # noqa: F401
from .config import (
    DECODE_CONFIGS,
    FORWARD_CONFIGS,
    SHORT_SEQUENCE_CONFIGS,
    AttentionConfig,
    decode_config,
    default_config,
)
from .interface import (
    empty_cache,
    flash_attn_combine,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "DECODE_CONFIGS",
    "FORWARD_CONFIGS",
    "SHORT_SEQUENCE_CONFIGS",
    "decode_config",
    "default_config",
    "empty_cache",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "__version__",
]
