"""Merge split-KV partial attention results (the LSE combine), a memory-bound CuTe DSL kernel.

The standalone form of the merge (flash_attn_combine); split forward launches merge in-kernel.
The per-row math and lane layout are split_merge's: a group of lanes of one warp per row, each
lane owning a 16-byte multiple of the head dim.
"""

from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from . import trace_records
from .hopper_mma import convert_to_16bit
from .split_merge import COMBINE_CHUNK_FLOATS, lanes_per_row, merge_row, splits_per_chunk
from .trace_records import TileTrace, linear_block_idx

THREADS = 128


class FlashAttentionCombine:
    """Static config (output dtype, head dim, whether the LSE is written) plus launch and kernel.

    Tensors (any strides, last dim contiguous; partials 16-byte aligned):
      out_partial (K, B, S, H, D) fp32, lse_partial (K, B, S, H) fp32,
      out (B, S, H, D) in out_dtype, lse (B, S, H) fp32 or None,
      trace (blocks, RECORD_WORDS) int64 or None: a traced kernel's records, one per CTA
      (kernels/trace_records.py; grid() gives the CTAs).
    """

    def __init__(self, out_dtype: Type[cutlass.Numeric], head_dim: int, writes_lse: bool):
        assert head_dim % 8 == 0
        self.out_dtype = out_dtype
        self.head_dim = head_dim
        self.writes_lse = writes_lse
        self.lanes_per_row = lanes_per_row(head_dim)
        self.floats_per_lane = head_dim // self.lanes_per_row
        self.rows_per_cta = THREADS // self.lanes_per_row

    @staticmethod
    def grid(batch, seqlen, nheads, head_dim: int):
        """The launch's grid: CTAs of rows_per_cta (token, head) rows, by batch (ints on the
        host, the tensor's dynamic sizes in the launch)."""
        rows_per_cta = THREADS // lanes_per_row(head_dim)
        return ((seqlen * nheads + rows_per_cta - 1) // rows_per_cta, batch, 1)

    @cute.jit
    def __call__(
        self,
        mO_partial: cute.Tensor,
        mLSE_partial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mTrace: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        grid = self.grid(mO.shape[0], mO.shape[1], mO.shape[2], self.head_dim)
        self.kernel(mO_partial, mLSE_partial, mO, mLSE, mTrace).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO_partial: cute.Tensor,
        mLSE_partial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mTrace: Optional[cute.Tensor],
    ):
        tidx = cute.arch.thread_idx()[0]
        bidx, batch, _ = cute.arch.block_idx()
        trace = None
        if const_expr(mTrace is not None):
            trace = TileTrace(mTrace, linear_block_idx(), tidx == 0)
            trace.begin(trace_records.COMBINE_BLOCK, linear_block_idx(), (bidx, 0, batch, 0))
        group = self.lanes_per_row
        sub = tidx % group  # lane within the row's group
        nheads = mO.shape[2]
        rows = mO.shape[1] * nheads
        row = bidx * self.rows_per_cta + tidx // group
        # Out-of-range rows (the last CTA's) neither load nor store.
        if row < rows:
            token = row // nheads
            head = row - token * nheads
            acc = cute.make_rmem_tensor(self.floats_per_lane, Float32)
            lse = merge_row(
                mLSE_partial[None, batch, token, head],
                mO_partial[None, batch, token, head, None],
                sub,
                acc,
                splits_per_chunk(self.floats_per_lane, COMBINE_CHUNK_FLOATS),
            )
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
        if const_expr(trace is not None):
            cute.arch.sync_threads()  # every row stored
            trace.stamp(trace_records.END)
