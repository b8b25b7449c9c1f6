"""Device side of flash_cute: CuTe DSL kernels for Hopper (sm_90a) and the pieces they share."""

from .flash_combine import FlashAttentionCombine
from .forward import FlashAttentionForwardSm90
from .mla_decode import MlaDecodeSm90, MlaDecodeTransposedSm90

__all__ = [
    "FlashAttentionCombine",
    "FlashAttentionForwardSm90",
    "MlaDecodeSm90",
    "MlaDecodeTransposedSm90",
    "forward_kernel",
]


def forward_kernel(variant) -> FlashAttentionForwardSm90:
    """The kernel object of a ForwardVariant: the latent decode kernel where its config asks for
    the seesaw (its transposed form for seesaw_rows 16 or 32), the forward kernel otherwise
    (all take the forward kernel's signature)."""
    config = variant.config
    if config.seesaw:
        return (MlaDecodeTransposedSm90 if config.seesaw_rows < 64 else MlaDecodeSm90)(variant)
    return FlashAttentionForwardSm90(variant)
