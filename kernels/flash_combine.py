"""Merge split-KV partial attention results (the LSE combine), a memory-bound CuTe DSL kernel.

For every row (batch b, token s, head h), over the splits k:
    lse = log(sum_k exp(lse_k)),  out = sum_k exp(lse_k - lse) * out_k
where out_k is split k's output normalized over its own keys. Splits with lse_k = -inf (empty)
are skipped without reading their out_k; a row whose splits are all empty gives out = 0 and
lse = -inf.

Each row is handled by a group of lanes of one warp, each lane owning a 16-byte multiple of the
head dim, so the fp32 partials stream in with 16-byte loads.
"""

import math
from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .hopper_mma import convert_to_16bit

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
THREADS = 128


class FlashAttentionCombine:
    """Static config (output dtype, head dim, whether the LSE is written) plus launch and kernel.

    Tensors (any strides, last dim contiguous; partials 16-byte aligned):
      out_partial (K, B, S, H, D) fp32, lse_partial (K, B, S, H) fp32,
      out (B, S, H, D) in out_dtype, lse (B, S, H) fp32 or None.
    With lse_heads_major the LSE tensors come as (K, B, H, S) and (B, H, S) instead, the
    forward kernel's own layout, so its buffers pass through without views.
    """

    def __init__(self, out_dtype: Type[cutlass.Numeric], head_dim: int, writes_lse: bool,
                 lse_heads_major: bool = False):
        assert head_dim % 8 == 0
        self.out_dtype = out_dtype
        self.head_dim = head_dim
        self.writes_lse = writes_lse
        self.lse_heads_major = lse_heads_major
        # Lanes per row: a power of two (rows stay inside a warp for the butterfly reductions)
        # dividing head_dim / 4, so each lane takes whole 16-byte chunks of the head dim.
        self.lanes_per_row = 32
        while (head_dim // 4) % self.lanes_per_row:
            self.lanes_per_row //= 2
        self.floats_per_lane = head_dim // self.lanes_per_row
        self.rows_per_cta = THREADS // self.lanes_per_row

    @cute.jit
    def __call__(
        self,
        mO_partial: cute.Tensor,
        mLSE_partial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        if const_expr(self.lse_heads_major):
            mLSE_partial = cute.make_tensor(mLSE_partial.iterator, cute.select(mLSE_partial.layout, mode=[0, 1, 3, 2]))
            if const_expr(mLSE is not None):
                mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[0, 2, 1]))
        rows = mO.shape[1] * mO.shape[2]
        grid = (cute.ceil_div(rows, self.rows_per_cta), mO.shape[0], 1)
        self.kernel(mO_partial, mLSE_partial, mO, mLSE).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor,
               mLSE: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        bidx, batch, _ = cute.arch.block_idx()
        group = self.lanes_per_row
        sub = tidx % group  # lane within the row's group
        num_splits = mO_partial.shape[0]
        nheads = mO.shape[2]
        rows = mO.shape[1] * nheads
        row = bidx * self.rows_per_cta + tidx // group
        valid = row < rows
        # Out-of-range rows compute on row 0 (no stores) so every lane reaches the shuffles.
        row = row if valid else 0
        token = row // nheads
        head = row - token * nheads

        # lse = log(sum exp(lse_k)), computed as max + log2-sum, split across the row's lanes.
        lse_max = -Float32.inf
        for k in cutlass.range(sub, num_splits, group, unroll=1):
            lse_max = cute.arch.fmax(lse_max, mLSE_partial[k, batch, token, head])
        lse_max = self._group_allreduce(lse_max, group, is_max=True)
        max_safe = Float32(0.0) if lse_max == -Float32.inf else lse_max
        sum_exp = Float32(0.0)
        for k in cutlass.range(sub, num_splits, group, unroll=1):
            sum_exp += cute.math.exp2((mLSE_partial[k, batch, token, head] - max_safe) * LOG2_E, fastmath=True)
        sum_exp = self._group_allreduce(sum_exp, group, is_max=False)
        empty = sum_exp == 0.0
        lse = -Float32.inf if empty else max_safe + cute.math.log2(sum_exp, fastmath=True) * LN2

        acc = cute.make_rmem_tensor(self.floats_per_lane, Float32)
        acc.fill(0.0)
        if not empty:
            for k in cutlass.range(num_splits, unroll=1):
                lse_k = mLSE_partial[k, batch, token, head]
                if lse_k != -Float32.inf:
                    weight = cute.math.exp2((lse_k - lse) * LOG2_E, fastmath=True)
                    part = cute.local_tile(mO_partial[k, batch, token, head, None], (self.floats_per_lane,), (sub,))
                    acc.store(acc.load() + weight * part.load())

        if valid:
            dst = cute.local_tile(mO[batch, token, head, None], (self.floats_per_lane,), (sub,))
            if const_expr(self.out_dtype == Float32):
                dst.store(acc.load())
            else:
                out = cute.make_rmem_tensor(self.floats_per_lane, self.out_dtype)
                convert_to_16bit(acc, out)
                dst.store(out.load())
            if const_expr(mLSE is not None):
                if sub == 0:
                    mLSE[batch, token, head] = lse

    @cute.jit
    def _group_allreduce(self, x: Float32, group: cutlass.Constexpr[int], is_max: cutlass.Constexpr[bool]) -> Float32:
        offset = group // 2
        while const_expr(offset > 0):
            other = cute.arch.shuffle_sync_bfly(x, offset=offset)
            x = cute.arch.fmax(x, other) if const_expr(is_max) else x + other
            offset //= 2
        return x
