"""Which key blocks a query tile visits, and which of them need masking.

Key blocks are visited from the last to the first. The last visited block (processed first)
is the only one that can straddle seqlen_k, so it alone gets the sequence-length mask.

With causal masking, key blocks wholly above the diagonal are never visited (never loaded),
and only the blocks that cross the diagonal are masked. A local mask (FlashAttention-3's
sliding window and chunk: query i sees key j iff x - window_left <= j <= x + window_right, x =
i + seqlen_k - seqlen_q, and with a chunk of c keys floor(x / c) == floor(j / c)) bounds the
blocks on both sides: the tile's first row gives the lowest visible key, its last row the
highest, and only the blocks crossing either edge of the band are masked. With split-KV,
split s of num_splits takes the s-th contiguous share of the tile's visible key blocks
(trailing shares may be empty).

With packed GQA a tile row is (token, q head) folded as row = token * rows_per_token + head,
so token indices are row // rows_per_token.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# A multiple of the chunk added before dividing, so that chunk_start divides non-negative
# numbers (x = i + seqlen_k - seqlen_q is negative for rows before the first key).
_CHUNK_BIAS_AT_LEAST = 1 << 30


@dataclass(frozen=True)
class LocalWindow:
    """A local mask's static shape: window sides (-1: unbounded) and chunk (0: none)."""

    left: cutlass.Constexpr[int] = -1
    right: cutlass.Constexpr[int] = -1
    chunk: cutlass.Constexpr[int] = 0

    @property
    def active(self) -> bool:
        return self.left >= 0 or self.right >= 0 or self.chunk > 0

    def chunk_start(self, x: Int32) -> Int32:
        """The first key of the chunk holding position x (floor division, x may be < 0)."""
        bias = -(-_CHUNK_BIAS_AT_LEAST // self.chunk) * self.chunk
        return (x + bias) // self.chunk * self.chunk - bias

    def first_key(self, x: Int32):
        """The lowest key a row at position x sees (before clamping to 0), or None."""
        first = None
        if const_expr(self.left >= 0):
            first = x - self.left
        if const_expr(self.chunk > 0):
            start = self.chunk_start(x)
            first = start if const_expr(first is None) else cutlass.max(first, start)
        return first

    def last_key(self, x: Int32):
        """The highest key a row at position x sees (before clamping to seqlen_k - 1), or
        None."""
        last = None
        if const_expr(self.right >= 0):
            last = x + self.right
        if const_expr(self.chunk > 0):
            end = self.chunk_start(x) + (self.chunk - 1)
            last = end if const_expr(last is None) else cutlass.min(last, end)
        return last


@dataclass(frozen=True)
class KeyBlockRange:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    rows_per_token: cutlass.Constexpr[int]
    seqlen_q: Int32
    seqlen_k: Int32
    window: LocalWindow = LocalWindow()

    def _first_x(self, m_block: Int32) -> Int32:
        """x = token + seqlen_k - seqlen_q of the tile's first row."""
        return (m_block * self.tile_m) // self.rows_per_token + self.seqlen_k - self.seqlen_q

    def _last_x(self, m_block: Int32) -> Int32:
        """x of the tile's last row."""
        last_token = cute.ceil_div((m_block + 1) * self.tile_m, self.rows_per_token) - 1
        return last_token + self.seqlen_k - self.seqlen_q

    @cute.jit
    def bounds(self, m_block: Int32, split_idx: Int32 = None, num_splits: Int32 = None) -> tuple:
        """[n_block_min, n_block_max) for query tile m_block (and split); empty when the tile
        has no query rows or no visible keys.

        A causal tile whose rows all precede the first key (seqlen_q > seqlen_k) still visits
        block 0, fully masked, so it writes out = 0 and lse = -inf through the common path; a
        local tile that sees no key visits none (its epilogue writes the same).
        """
        n_block_max = cute.ceil_div(self.seqlen_k, self.tile_n)
        n_block_min = Int32(0)
        if const_expr(self.causal):
            last_key = self._last_x(m_block) + 1
            n_block_max = cutlass.min(
                n_block_max, cute.ceil_div(cutlass.max(last_key, 1), self.tile_n)
            )
        if const_expr(self.window.active):
            last = self.window.last_key(self._last_x(m_block))
            if const_expr(last is not None):
                n_block_max = cutlass.min(
                    n_block_max, cute.ceil_div(cutlass.max(last + 1, 0), self.tile_n)
                )
            first = self.window.first_key(self._first_x(m_block))
            if const_expr(first is not None):
                n_block_min = cutlass.max(first, 0) // self.tile_n
        if m_block * self.tile_m >= self.seqlen_q * self.rows_per_token:
            n_block_max = Int32(0)
        if const_expr(num_splits is not None):
            per_split = cute.ceil_div(cutlass.max(n_block_max - n_block_min, 0), num_splits)
            n_block_min = n_block_min + split_idx * per_split
            n_block_max = cutlass.min(n_block_min + per_split, n_block_max)
        return n_block_min, n_block_max

    @cute.jit
    def first_causal_masked_block(self, m_block: Int32) -> Int32:
        """Blocks at or after this index may cross the diagonal (a safe lower bound)."""
        first_token = (m_block * self.tile_m) // self.rows_per_token
        first_key = first_token + self.seqlen_k - self.seqlen_q
        return cutlass.max(first_key, 0) // self.tile_n

    @cute.jit
    def first_right_masked_block(self, m_block: Int32) -> Int32:
        """Local mask: blocks at or after this index hold a key past the window's right edge
        for some row of the tile (its first row's edge is the lowest)."""
        result = cute.ceil_div(self.seqlen_k, self.tile_n)
        last = self.window.last_key(self._first_x(m_block))
        if const_expr(last is not None):
            result = cutlass.max(last + 1, 0) // self.tile_n
        return result

    @cute.jit
    def left_masked_blocks_end(self, m_block: Int32) -> Int32:
        """Local mask: blocks below this index hold a key before the window's left edge for
        some row of the tile (its last row's edge is the highest)."""
        result = Int32(0)
        first = self.window.first_key(self._last_x(m_block))
        if const_expr(first is not None):
            result = cute.ceil_div(cutlass.max(first, 0), self.tile_n)
        return result
