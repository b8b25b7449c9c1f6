"""Online softmax over the rows of a WGMMA score accumulator (fp32, base-2 exponentials).

softmax_scale * log2(e) is folded into one multiply-add per score: p = exp2(s * c - m * c).
O is rescaled only by the change of the row max, exp2((m_old - m_new) * c). Each thread keeps
a partial row sum over its own columns; the quad (4 threads sharing a row) reduces it once,
in finalize.
"""

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .hopper_mma import acc_as_rows_cols

LN2 = math.log(2.0)


@cute.jit
def _quad_allreduce_max(x: Float32) -> Float32:
    # The 4 lanes holding one accumulator row are lane%4 = 0..3 of the same quad.
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def _quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


@cute.jit
def _row_max(row: cute.Tensor, ncols: cutlass.Constexpr[int]) -> Float32:
    # Four independent chains keep the FMNMX latency off the critical path.
    m = [row[0], row[1], row[2], row[3]]
    for c in cutlass.range_constexpr(4, ncols, 4):
        for j in cutlass.range_constexpr(4):
            m[j] = cute.arch.fmax(m[j], row[c + j])
    return cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))


@cute.jit
def _row_sum(row: cute.Tensor, ncols: cutlass.Constexpr[int]) -> Float32:
    s = [row[0], row[1], row[2], row[3]]
    for c in cutlass.range_constexpr(4, ncols, 4):
        for j in cutlass.range_constexpr(4):
            s[j] = s[j] + row[c + j]
    return (s[0] + s[1]) + (s[2] + s[3])


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running row max and (per-thread partial) row sum for the rows a thread owns.

    Frozen: the DSL then treats it as read-only across dynamic control flow; the state lives in
    the register tensors it points to."""

    scale_log2: Float32
    num_rows: cutlass.Constexpr[int]
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2: Float32, num_rows: int) -> "OnlineSoftmax":
        return OnlineSoftmax(
            scale_log2, num_rows, cute.make_rmem_tensor(num_rows, Float32),
            cute.make_rmem_tensor(num_rows, Float32),
        )

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turn scores into unnormalized probabilities in place; return the O rescale per row."""
        scores = acc_as_rows_cols(acc_S)
        ncols = cute.size(scores, mode=[1])
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row = cute.make_rmem_tensor(ncols, Float32)
            row.store(scores[r, None].load())
            row_max = _row_max(row, ncols)
            if const_expr(not is_first):
                row_max = cute.arch.fmax(row_max, self.row_max[r])
            row_max = _quad_allreduce_max(row_max)
            row_max_prev = self.row_max[r]
            self.row_max[r] = row_max
            # A row masked out so far has max -inf: use 0 so exp2 gives 0, not NaN.
            row_max_safe = Float32(0.0) if row_max == -Float32.inf else row_max
            max_scaled = row_max_safe * self.scale_log2
            for c in cutlass.range_constexpr(ncols):
                row[c] = cute.math.exp2(row[c] * self.scale_log2 - max_scaled, fastmath=True)
            row_sum = _row_sum(row, ncols)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = row_sum
            else:
                scale = cute.math.exp2((row_max_prev - row_max_safe) * self.scale_log2, fastmath=True)
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + row_sum
            scores[r, None].store(row.load())
        return row_scale

    @cute.jit
    def finalize(self) -> tuple:
        """Return (1/row_sum, natural-log LSE) per row; an empty row gives (1, -inf)."""
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row_sum = _quad_allreduce_sum(self.row_sum[r])
            empty = row_sum == 0.0 or row_sum != row_sum
            inv_sum[r] = cute.arch.rcp_approx(Float32(1.0) if empty else row_sum)
            lse[r] = (
                -Float32.inf
                if empty
                else (self.row_max[r] * self.scale_log2 + cute.math.log2(row_sum, fastmath=True))
                * LN2
            )
        return inv_sum, lse


@cute.jit
def rescale_rows(acc_O: cute.Tensor, row_scale: cute.Tensor):
    """Multiply each row of a WGMMA accumulator by its scale."""
    out = acc_as_rows_cols(acc_O)
    for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
            out[r, c] = out[r, c] * row_scale[r]
