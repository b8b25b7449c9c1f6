"""Score masking for one (m_block, n_block) tile of a WGMMA accumulator.

Causal masking is bottom-right aligned, as in FlashAttention: query row i may attend key j
iff j <= i + seqlen_k - seqlen_q. A local mask (block_range.LocalWindow) bounds j on both
sides of x = i + seqlen_k - seqlen_q. Keys at or past seqlen_k are always masked.

Column coordinates of thread 0's accumulator are compile-time constants; every thread's
columns are those plus one per-thread offset, so each comparison is against a constant.
With packed GQA (rows_per_token > 1) tile row r holds token r // rows_per_token.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .block_range import LocalWindow
from .hopper_mma import acc_as_rows_cols


@dataclass(frozen=True)
class AttentionMask:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    rows_per_token: cutlass.Constexpr[int]
    seqlen_q: Int32
    seqlen_k: Int32
    window: LocalWindow = LocalWindow()

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        thr_mma: cute.ThrMma,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool] = False,
    ):
        """Set the masked scores of key block n_block to -inf: keys at or past seqlen_k
        (mask_seqlen), above the diagonal (mask_causal), outside the local window
        (mask_local)."""
        if const_expr(mask_seqlen or mask_causal or mask_local):
            scores = acc_as_rows_cols(acc_S)
            coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
            thr_coords = acc_as_rows_cols(thr_mma.partition_C(coords))
            t0_coords = acc_as_rows_cols(thr_mma.get_slice(0).partition_C(coords))
            thr_col_offset = thr_coords[0][1]
            # Key index minus the column of thread 0's accumulator entry.
            col_base = n_block * self.tile_n + thr_col_offset
            seqlen_limit = self.seqlen_k - col_base
            ncols = cute.size(scores, mode=[1])
            for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                col_limit = seqlen_limit
                col_start = None
                if const_expr(mask_causal or mask_local):
                    row = (m_block * self.tile_m + thr_coords[r, 0][0]) // self.rows_per_token
                    x = row + self.seqlen_k - self.seqlen_q
                    if const_expr(mask_causal):
                        col_limit = x + 1 - col_base
                    else:
                        last = self.window.last_key(x)
                        if const_expr(last is not None):
                            col_limit = last + 1 - col_base
                        first = self.window.first_key(x)
                        if const_expr(first is not None):
                            col_start = first - col_base
                    if const_expr(mask_seqlen):
                        col_limit = cutlass.min(col_limit, seqlen_limit)
                for c in cutlass.range_constexpr(ncols):
                    # A select, not a branch: the compiler keeps it predicated.
                    col = t0_coords[0, c][1]
                    if const_expr(col_start is None):
                        scores[r, c] = -Float32.inf if col >= col_limit else scores[r, c]
                    else:
                        outside = col >= col_limit or col < col_start
                        scores[r, c] = -Float32.inf if outside else scores[r, c]
