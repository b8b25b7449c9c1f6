"""The absorbed-MLA decode kernel, one module per job: kernel.py (the launch and the skeleton),
loads.py (the latent cache's key blocks by halves), seesaw.py (the two MMA warpgroups'
schedule), fp8_loads.py (an FP8 cache converted in place); and its transposed form for an FP8
cache and tiles of at most 32 rows: transposed_kernel.py, transposed.py (the mainloop),
fp8_fragments.py (e4m3 bytes into A-operand registers)."""

from .kernel import MlaDecodeSm90
from .transposed_kernel import MlaDecodeTransposedSm90

__all__ = ["MlaDecodeSm90", "MlaDecodeTransposedSm90"]
