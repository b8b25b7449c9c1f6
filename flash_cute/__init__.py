"""flash_cute: FlashAttention-3-style attention kernels for Hopper GPUs, in the CuTe DSL."""

from .config import FORWARD_CONFIGS, AttentionConfig, default_config
from .interface import flash_attn_func

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "FORWARD_CONFIGS", "default_config", "flash_attn_func", "__version__"]
