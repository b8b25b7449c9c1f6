"""Which key blocks a query tile visits, and which of them need the causal mask.

Key blocks are visited from the last to the first. The last visited block (processed first)
is the only one that can straddle seqlen_k, so it alone gets the sequence-length mask.
With causal masking, key blocks wholly above the diagonal are never visited (never loaded),
and only the blocks that cross the diagonal are masked.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class KeyBlockRange:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    seqlen_q: Int32
    seqlen_k: Int32

    @cute.jit
    def bounds(self, m_block: Int32) -> tuple:
        """[n_block_min, n_block_max) for query tile m_block; never empty when seqlen_k > 0.

        A causal tile whose rows all precede the first key (seqlen_q > seqlen_k) still visits
        block 0, fully masked, so it writes out = 0 and lse = -inf through the common path.
        """
        n_block_max = cute.ceil_div(self.seqlen_k, self.tile_n)
        if const_expr(self.causal):
            last_key = (m_block + 1) * self.tile_m + self.seqlen_k - self.seqlen_q
            n_block_max = cutlass.min(
                n_block_max, cute.ceil_div(cutlass.max(last_key, 1), self.tile_n)
            )
        return Int32(0), n_block_max

    @cute.jit
    def first_causal_masked_block(self, m_block: Int32) -> Int32:
        """Blocks at or after this index may cross the diagonal (a safe lower bound)."""
        first_key = m_block * self.tile_m + self.seqlen_k - self.seqlen_q
        return cutlass.max(first_key, 0) // self.tile_n
