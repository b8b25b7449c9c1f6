"""The absorbed-MLA decode kernel, one module per job: kernel.py (the launch and the skeleton),
loads.py (the latent cache's key blocks by halves), seesaw.py (the two MMA warpgroups'
schedule)."""

from .kernel import MlaDecodeSm90

__all__ = ["MlaDecodeSm90"]
