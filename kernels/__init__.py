"""Device side of flash_cute: CuTe DSL kernels for Hopper (sm_90a) and the pieces they share."""

from .flash_combine import FlashAttentionCombine
from .forward import FlashAttentionForwardSm90

__all__ = ["FlashAttentionCombine", "FlashAttentionForwardSm90"]
