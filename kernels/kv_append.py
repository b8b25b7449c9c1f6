"""Append new keys and values to a KV cache, rotating them (and the queries) on the way: one
SIMT kernel for FlashAttention-3's k, v, rotary_cos, ... of flash_attn_with_kvcache
(flash_cute/kv_append.py checks the arguments and launches it ahead of the attention).

One warp per item: a new row's (row, kv head), its k rotated and its v copied to the row's
cache slot, or with rotary a query's (token, head), rotated into q_out. Lanes stride over the
head dim, so each warp's loads and stores are contiguous runs. Rotations run in float32 and
round once. Every index is read on the device (a packed row's sequence by counting
cu_seqlens, its slot through cache_batch_idx and the page table), so graphs capture the launch
and replays see new lengths. A row whose slot is not in the cache (past its capacity or the
page table's width, a cache row or page out of range, a packed row of no sequence) writes
nothing. The first threads also write each sequence's length after the append, unless the
attention adds the new rows itself (new_lengths None: it may run beside this kernel, a
programmatically dependent launch, so nothing it could reuse is written late).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .rotary import Rotary
from .signature_record import signature_record

WARPS = 4  # items per CTA


class KVAppendKernel:
    """Static config plus launch and kernel.

    Tensors (last dim contiguous, any other strides):
      k_new (N, Hkv, D), v_new (N, Hkv, Dv): the new rows, packed (cu_new) or batch-major
        (seqlen_new rows a sequence); k_cache (R, S, Hkv, D), v_cache (R, S, Hkv, Dv): R cache
        rows of capacity S, or R pages of S slots (page_table (rows, width) int32);
      lengths (B,) int32 or None (then every sequence's is `length`): the cached rows;
      new_lengths (B,) int32: written, lengths + each sequence's new rows; or None where the
        attention adds the rows itself (then lengths gives B);
      cu_new (B + 1,), batch_idx (B,), rotary_seqlens (B,), cu_q (B + 1,): int32 or None;
      q (T, H, D) and q_out (same shape): the queries (rows batch-major, seqlen_q a sequence, or
        packed by cu_q) and their rotated copy, with rotary only; cos, sin (seqlen_ro,
        rotary_dim / 2).
    """

    def __init__(
        self,
        head_dim: int,
        head_dim_v: int,
        rotary_dim: int = 0,
        interleaved: bool = False,
        per_row: bool = False,
    ):
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.rotary_dim = rotary_dim
        self.rotary = Rotary(rotary_dim, interleaved)
        self.per_row = per_row  # queries at rotary position + their index (causal / local)

    @cute.jit
    def __call__(
        self,
        k_new: cute.Tensor,
        v_new: cute.Tensor,
        k_cache: cute.Tensor,
        v_cache: cute.Tensor,
        lengths: Optional[cute.Tensor],
        length: Int32,
        new_lengths: Optional[cute.Tensor],
        cu_new: Optional[cute.Tensor],
        seqlen_new: Int32,
        batch_idx: Optional[cute.Tensor],
        page_table: Optional[cute.Tensor],
        q: Optional[cute.Tensor],
        q_out: Optional[cute.Tensor],
        seqlen_q: Int32,
        cu_q: Optional[cute.Tensor],
        cos: Optional[cute.Tensor],
        sin: Optional[cute.Tensor],
        rotary_seqlens: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        """The whole signature: its parameters are the one declaration of the arguments and
        their order (AppendArgs, APPEND_ARGUMENTS)."""
        args = AppendArgs.of(locals())
        items = k_new.shape[0] * k_new.shape[1]
        if const_expr(self.rotary_dim > 0):
            items = items + q.shape[0] * q.shape[1]
        blocks = cutlass.max((items + WARPS - 1) // WARPS, 1)  # (no new rows: a launch still)
        if const_expr(new_lengths is not None):  # (a thread per sequence, for its new length)
            blocks = cutlass.max(blocks, (new_lengths.shape[0] + WARPS * 32 - 1) // (WARPS * 32))
        self.kernel(args).launch(grid=[blocks, 1, 1], block=[WARPS * 32, 1, 1], stream=stream)

    @cute.jit
    def _sequence(self, row: Int32, mCu: Optional[cute.Tensor], per_seq: Int32, batch: Int32):
        """(sequence, index within it) of a packed row (the number of cu[1..B] at or below it,
        at most B - 1) or of a batch-major one (per_seq rows a sequence)."""
        seq = Int32(0)
        if const_expr(mCu is not None):
            for b in cutlass.range(1, batch + 1, unroll=1):
                if mCu[b] <= row:
                    seq = seq + 1
            seq = cutlass.min(seq, batch - 1)
            index = row - mCu[seq]
        else:
            seq = row // per_seq
            index = row - seq * per_seq
        return seq, index

    @cute.jit
    def _start(self, seq: Int32, mLengths: Optional[cute.Tensor], length: Int32) -> Int32:
        start = length
        if const_expr(mLengths is not None):
            start = mLengths[seq]
        return start

    @cute.kernel
    def kernel(self, args):
        mKNew, mVNew, mKCache, mVCache = args.k_new, args.v_new, args.k_cache, args.v_cache
        mLengths, length, mNewLengths = args.lengths, args.length, args.new_lengths
        mCuNew, seqlen_new, mBatchIdx = args.cu_new, args.seqlen_new, args.batch_idx
        mPageTable, mQ, mQOut, seqlen_q = args.page_table, args.q, args.q_out, args.seqlen_q
        mCuQ, mCos, mSin, mRotarySeqlens = args.cu_q, args.cos, args.sin, args.rotary_seqlens
        # The attention launch behind this one may start now (it waits for these writes where
        # it reads them: an after_append forward variant).
        cute.arch.griddepcontrol_launch_dependents()
        tidx = cute.arch.thread_idx()[0]
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        batch = mLengths.shape[0] if const_expr(mNewLengths is None) else mNewLengths.shape[0]

        # Each sequence's length after the append.
        if const_expr(mNewLengths is not None):
            seq_t = bidx * WARPS * 32 + tidx
            if seq_t < batch:
                count = seqlen_new
                if const_expr(mCuNew is not None):
                    count = cutlass.max(mCuNew[seq_t + 1] - mCuNew[seq_t], 0)
                mNewLengths[seq_t] = self._start(seq_t, mLengths, length) + count

        item = bidx * WARPS + warp
        nheads_kv = mKNew.shape[1]
        kv_items = mKNew.shape[0] * nheads_kv
        if item < kv_items:
            row = item // nheads_kv
            head = item - row * nheads_kv
            seq, index = self._sequence(row, mCuNew, seqlen_new, batch)
            start = self._start(seq, mLengths, length)
            position = start + index
            cache_row = seq
            if const_expr(mBatchIdx is not None):
                cache_row = mBatchIdx[seq]
            ok = position >= 0
            if const_expr(mCuNew is not None):  # rows outside cu_new[0] .. cu_new[B]
                ok = ok & (row >= mCuNew[0]) & (row < mCuNew[batch])
            slots = mKCache.shape[1]
            c0, c1 = cache_row, position
            if const_expr(mPageTable is not None):
                page_index = position // slots
                ok = ok & (page_index < mPageTable.shape[1])
                ok = ok & (cache_row >= 0) & (cache_row < mPageTable.shape[0])
                page = Int32(-1)
                if ok:
                    page = mPageTable[cache_row, page_index]
                ok = ok & (page >= 0) & (page < mKCache.shape[0])
                c0, c1 = page, position - page_index * slots
            else:
                ok = ok & (position < slots) & (cache_row >= 0) & (cache_row < mKCache.shape[0])
            if ok:
                offset = start
                if const_expr(mRotarySeqlens is not None):
                    offset = mRotarySeqlens[seq]
                self.rotary.write_kv_row(
                    mKNew[row, head, None], mKCache[c0, c1, head, None], mVNew[row, head, None],
                    mVCache[c0, c1, head, None], mCos, mSin, offset + index, self.head_dim,
                    self.head_dim_v, lane,
                )  # fmt: skip
        if const_expr(self.rotary_dim > 0):
            q_item = item - kv_items
            nheads = mQ.shape[1]
            if (q_item >= 0) & (q_item < mQ.shape[0] * nheads):
                token = q_item // nheads
                head = q_item - token * nheads
                seq, step = self._sequence(token, mCuQ, seqlen_q, batch)
                offset = self._start(seq, mLengths, length)
                if const_expr(mRotarySeqlens is not None):
                    offset = mRotarySeqlens[seq]
                if const_expr(self.per_row):
                    offset = offset + step
                self.rotary.rotate_row(mQ[token, head, None], mQOut[token, head, None], mCos,
                                       mSin, offset, self.head_dim, lane)  # fmt: skip


# The launch's arguments as __call__ declares them, which the kernel takes as one record.
AppendArgs = signature_record("AppendArgs", KVAppendKernel.__call__)
# The compiled function's arguments in order, by name (compile_cache.compile_append and
# flash_cute.kv_append build theirs from it; the stream follows).
APPEND_ARGUMENTS = AppendArgs._fields
