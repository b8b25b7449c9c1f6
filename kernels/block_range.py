"""Which key blocks a query tile visits, and which of them need the causal mask.

Key blocks are visited from the last to the first. The last visited block (processed first)
is the only one that can straddle seqlen_k, so it alone gets the sequence-length mask.
With causal masking, key blocks wholly above the diagonal are never visited (never loaded),
and only the blocks that cross the diagonal are masked. With split-KV, split s of num_splits
takes the s-th contiguous share of the tile's key blocks (trailing shares may be empty).

With packed GQA a tile row is (token, q head) folded as row = token * rows_per_token + head,
so token indices are row // rows_per_token.
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
    rows_per_token: cutlass.Constexpr[int]
    seqlen_q: Int32
    seqlen_k: Int32

    @cute.jit
    def bounds(self, m_block: Int32, split_idx: Int32 = None, num_splits: Int32 = None) -> tuple:
        """[n_block_min, n_block_max) for query tile m_block (and split); empty when the tile
        has no query rows or no keys.

        A causal tile whose rows all precede the first key (seqlen_q > seqlen_k) still visits
        block 0, fully masked, so it writes out = 0 and lse = -inf through the common path.
        """
        n_block_max = cute.ceil_div(self.seqlen_k, self.tile_n)
        if const_expr(self.causal):
            last_token = cute.ceil_div((m_block + 1) * self.tile_m, self.rows_per_token)
            last_key = last_token + self.seqlen_k - self.seqlen_q
            n_block_max = cutlass.min(
                n_block_max, cute.ceil_div(cutlass.max(last_key, 1), self.tile_n)
            )
        if m_block * self.tile_m >= self.seqlen_q * self.rows_per_token:
            n_block_max = Int32(0)
        n_block_min = Int32(0)
        if const_expr(num_splits is not None):
            per_split = cute.ceil_div(n_block_max, num_splits)
            n_block_min = split_idx * per_split
            n_block_max = cutlass.min(n_block_min + per_split, n_block_max)
        return n_block_min, n_block_max

    @cute.jit
    def first_causal_masked_block(self, m_block: Int32) -> Int32:
        """Blocks at or after this index may cross the diagonal (a safe lower bound)."""
        first_token = (m_block * self.tile_m) // self.rows_per_token
        first_key = first_token + self.seqlen_k - self.seqlen_q
        return cutlass.max(first_key, 0) // self.tile_n
