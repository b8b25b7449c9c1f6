"""Rotary embedding on the device: FlashAttention-3's rotation of a query or key row by the
angles of one table row (rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2)). Interleaved
rotary pairs dims (2j, 2j + 1), the other form (j, j + rotary_dim / 2); dims past rotary_dim
are left as they are. Rotations run in float32 and round once. Used by the KV append kernel
(kernels/kv_append.py) and by the forward kernel's fused append (kernels/forward/).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


@dataclass(frozen=True)
class Rotary:
    """rotary_dim 0: rows are copied as they are."""

    rotary_dim: int
    interleaved: bool

    @property
    def pairs(self) -> int:
        return self.rotary_dim // 2

    def columns(self, j):
        """The two dims pair j rotates."""
        if const_expr(self.interleaved):
            return 2 * j, 2 * j + 1
        return j, j + self.pairs

    @cute.jit
    def table_row(self, mCos: cute.Tensor, position: Int32) -> Int32:
        """A rotary position as a table row, clamped into the table (a position past it is a
        caller's error, read as its nearest row rather than out of bounds)."""
        return cutlass.max(cutlass.min(position, mCos.shape[0] - 1), 0)

    @cute.jit
    def angle(self, mCos: cute.Tensor, mSin: cute.Tensor, row: Int32, j):
        """(cos, sin) of pair j at table row `row` (table_row's), in float32."""
        return mCos[row, j].to(Float32), mSin[row, j].to(Float32)

    @cute.jit
    def rotate_pair(self, src, dst, a, b, c: Float32, s: Float32):
        """dst[a], dst[b] = src's pair at coordinates (a, b) rotated by (c, s); src may be
        dst."""
        x0, x1 = src[a].to(Float32), src[b].to(Float32)
        dst[a] = (x0 * c - x1 * s).to(dst.element_type)
        dst[b] = (x0 * s + x1 * c).to(dst.element_type)

    # One warp's rows: every load issued before the first store. (A store may alias a later
    # load's address as far as the compiler knows, so a load after a store waits for it: a
    # row moved piece by piece pays a global round trip per piece.)

    def _slots(self, width: int):
        """(pair slots, other slots) of one lane's registers for a row of width dims."""
        return (self.pairs + 31) // 32, (width - self.rotary_dim + 31) // 32

    @cute.jit
    def load_row(self, src, mCos, mSin, position: Int32, width: int, lane: Int32):
        """One warp: a row's values (src, width dims) and the angles of table row position,
        into this lane's registers (float32: every dtype this rounds back exactly)."""
        n_pair, n_rest = self._slots(width)
        regs = cute.make_rmem_tensor(4 * n_pair + n_rest, Float32)
        if const_expr(n_pair > 0):
            row = self.table_row(mCos, position)
            for p in cutlass.range_constexpr(n_pair):
                j = 32 * p + lane
                if j < self.pairs:
                    a, b = self.columns(j)
                    regs[4 * p], regs[4 * p + 1] = src[a].to(Float32), src[b].to(Float32)
                    regs[4 * p + 2], regs[4 * p + 3] = self.angle(mCos, mSin, row, j)
        for i in cutlass.range_constexpr(n_rest):
            col = self.rotary_dim + 32 * i + lane
            if col < width:
                regs[4 * n_pair + i] = src[col].to(Float32)
        return regs

    @cute.jit
    def store_row(self, dst, regs: cute.Tensor, width: int, lane: Int32):
        """One warp: dst = the row load_row read, rotated over its first rotary_dim dims."""
        n_pair, n_rest = self._slots(width)
        for p in cutlass.range_constexpr(n_pair):
            j = 32 * p + lane
            if j < self.pairs:
                a, b = self.columns(j)
                x0, x1, c, s = regs[4 * p], regs[4 * p + 1], regs[4 * p + 2], regs[4 * p + 3]
                dst[a] = (x0 * c - x1 * s).to(dst.element_type)
                dst[b] = (x0 * s + x1 * c).to(dst.element_type)
        for i in cutlass.range_constexpr(n_rest):
            col = self.rotary_dim + 32 * i + lane
            if col < width:
                dst[col] = regs[4 * n_pair + i].to(dst.element_type)

    @cute.jit
    def rotate_row(self, src, dst, mCos, mSin, position: Int32, width: int, lane: Int32):
        """One warp: dst[:width] = src rotated at table row position."""
        self.store_row(dst, self.load_row(src, mCos, mSin, position, width, lane), width, lane)

    @cute.jit
    def write_kv_row(self, k_src, k_dst, v_src, v_dst, mCos, mSin, position, d: int, dv: int,
                     lane: Int32, loads_first: bool = True):  # fmt: skip
        """One warp: an appended row, k rotated at position, into the cache: k's and v's
        loads first (loads_first: one round trip; else v's after k's stores, for warps with
        few registers), then k's stores, then v's (where v's columns are k's, as in a latent
        cache, v lands last)."""
        copy = Rotary(0, False)
        if const_expr(loads_first):
            k_regs = self.load_row(k_src, mCos, mSin, position, d, lane)
            v_regs = copy.load_row(v_src, None, None, position, dv, lane)
            self.store_row(k_dst, k_regs, d, lane)
            cute.arch.sync_warp()
            copy.store_row(v_dst, v_regs, dv, lane)
        else:  # (k's rotated dims, k's others, v: one piece in registers at a time)
            if const_expr(self.rotary_dim > 0):
                pairs = self.load_row(k_src, mCos, mSin, position, self.rotary_dim, lane)
                self.store_row(k_dst, pairs, self.rotary_dim, lane)
            copy_dims(k_src, k_dst, self.rotary_dim, d, lane)
            cute.arch.sync_warp()
            copy_dims(v_src, v_dst, 0, dv, lane)


@cute.jit
def copy_dims(src, dst, first: int, width: int, lane: Int32):
    """One warp: dst[first:width] = src[first:width], the loads before the stores."""
    count = (width - first + 31) // 32
    if const_expr(count > 0):
        regs = cute.make_rmem_tensor(count, src.element_type)
        for i in cutlass.range_constexpr(count):
            if first + 32 * i + lane < width:
                regs[i] = src[first + 32 * i + lane]
        for i in cutlass.range_constexpr(count):
            if first + 32 * i + lane < width:
                dst[first + 32 * i + lane] = regs[i]
