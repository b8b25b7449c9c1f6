"""Device side of flash_cute: CuTe DSL kernels for Hopper (sm_90a) and the pieces they share."""

from .flash_combine import FlashAttentionCombine
from .forward import FlashAttentionForwardSm90
from .mla_decode import MlaDecodeSm90

__all__ = ["FlashAttentionCombine", "FlashAttentionForwardSm90", "MlaDecodeSm90", "forward_kernel"]


def forward_kernel(variant) -> FlashAttentionForwardSm90:
    """The kernel object of a ForwardVariant: the latent decode kernel where its config asks for
    the seesaw, the forward kernel otherwise (both take the forward kernel's signature)."""
    cls = MlaDecodeSm90 if variant.config.seesaw else FlashAttentionForwardSm90
    return cls(variant)
