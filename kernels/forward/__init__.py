"""The forward attention kernel, one module per job: kernel.py (the launch and the kernel
skeleton), facts.py (what a variant is on the device), records.py (what the pieces pass each
other), host.py (the launch's host-side setup), producer.py (loads), mainloop.py (one tile's
key blocks), epilogue.py (O and the LSE out, split merges)."""

from .kernel import FlashAttentionForwardSm90

__all__ = ["FlashAttentionForwardSm90"]
