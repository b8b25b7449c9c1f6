"""The MMA warpgroups' side of the forward kernel: for each tile, the attention mainloop over
its key blocks, last first (it alone carries the sequence-length mask): S = Q K^T (WGMMA),
softcap and masks, the online softmax in fp32, O += P V (P from registers or shared memory),
with the intra-warpgroup overlap (block n's Q K^T issued before block n+1's P V finishes) and
ping-pong between warpgroups (one's softmax under another's GEMMs) as the config says.
"""

import functools
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .. import hopper_mma, trace_records
from ..kv_dequant import apply_v_descale, convert_block, fold_descales
from ..masking import AttentionMask
from ..named_barriers import NamedBarrier
from ..softmax import (
    OnlineSoftmax,
    ScoreHalves,
    apply_softcap,
    rescale_rows,
    rescale_rows_if_any_changed,
)
from ..tile_scheduler import WorkTile
from ..trace_records import TileTrace
from .facts import THREADS_PER_WARPGROUP, Piece
from .records import CtaBuffers, MainloopOperands, MmaSetup, ProblemShapes, QRelease, TileResult

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
# FP8 math: probabilities scaled by 2^8 before their cast to e4m3 (FlashAttention-3's
# Max_offset), so P spans [0, 256] of e4m3's range, not [0, 1], where fewer values are normal.
FP8_P_OFFSET = 8


# A fused append's Q rotation items per MMA thread whose angles are read before Q lands
# (decode: 4 query rows of 64 pairs over 128 threads are 2).
Q_ANGLES_AHEAD = 2


@cute.jit
def zero_rows_from(tile: cute.Tensor, first_row: Int32, warpgroup_idx: Int32):
    """A warpgroup zeroes rows first_row.. of a (rows, cols) smem tile (cols a multiple of 8)
    in 16-byte pieces, then makes the stores visible to its WGMMAs (its V_TAIL barrier): the V
    rows past a sequence's last key, which P's zeros would otherwise meet as NaN or inf."""
    rows = cute.size(tile, mode=[0])
    pieces_per_row = cute.size(tile, mode=[1]) // 8
    pieces = cute.zipped_divide(tile, (1, 8))  # ((1, 8), (rows, cols / 8))
    zeros = cute.make_rmem_tensor((1, 8), tile.element_type)
    zeros.fill(0.0)
    wg_thread = cute.arch.thread_idx()[0] % THREADS_PER_WARPGROUP
    first = cutlass.max(first_row, 0) * pieces_per_row
    for j in cutlass.range(
        first + wg_thread, rows * pieces_per_row, THREADS_PER_WARPGROUP, unroll=1
    ):
        row = j // pieces_per_row
        cute.autovec_copy(zeros, pieces[None, (row, j - row * pieces_per_row)])
    cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMA's reads
    cute.arch.barrier(
        barrier_id=int(NamedBarrier.V_TAIL_1) + warpgroup_idx,
        number_of_threads=THREADS_PER_WARPGROUP,
    )


class Mainloop(Piece):
    """One tile's mainloop (`mma`) and the per-key-block steps it is built from."""

    @cute.jit
    def mma(
        self,
        buf: CtaBuffers,
        setup: MmaSetup,
        tile: WorkTile,
        shapes: ProblemShapes,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
        trace: Optional[TileTrace] = None,
    ):
        """Consumer warpgroups, one tile: the attention mainloop over key blocks. Returns the
        K/V ring state after the tile and the tile's result for the epilogue (O normalized,
        the LSE). trace (traced variants): the tile's record, stamped when the first K block
        has landed and when the mainloop ends."""
        tidx, warpgroup_idx = setup.tidx, setup.warpgroup_idx
        seqlen, block_range, n_block_min, n_block_max = self.tile_problem(tile, shapes)
        ctx, v_descale = self._operands(buf, setup, tile, shapes, seqlen, n_block_max)
        acc_O, softmax = ctx.acc_O, ctx.softmax

        acc_O.fill(0.0)
        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        lse.fill(-Float32.inf)  # an empty tile or split: out = 0, lse = -inf
        sink_log2 = None
        if const_expr(shapes.learnable_sink is not None):
            sink_log2 = self._row_sinks_log2(shapes.learnable_sink, setup.tiled_mma_pv, tidx, tile)
            for r in cutlass.range_constexpr(softmax.num_rows):
                lse[r] = sink_log2[r] * LN2  # a row that sees no key: lse = its sink
        # Who frees Q when: after the mainloop, except in a persistent kernel whose O
        # overwrites Q's smem (then the epilogue's storing warp does, after the store).
        release_q_after_mainloop = const_expr(not self.o_overwrites_q)
        # (a fused append's: the first angles of Q's rotation and values of K(n_max-1)'s
        # patch, read while Q and K are in flight)
        angles = self._q_angles(tidx, tile, shapes, seqlen)
        k_patch = self._k_patch_ahead(tile, shapes, seqlen, n_block_max)
        if const_expr(self.persistent):
            buf.pipeline_q.consumer_wait(q_state)  # loaded for every tile, empty or not
            self._convert_q(buf, tidx, tile, shapes, seqlen, angles)
        if n_block_max > n_block_min:
            if const_expr(not self.persistent):
                buf.pipeline_q.consumer_wait(q_state)
                self._convert_q(buf, tidx, tile, shapes, seqlen, angles)
            if const_expr(trace is not None):
                # (a second wait on the same phase returns at once)
                self._wait_full(buf.pipeline_k, kv_state)
                trace.stamp(trace_records.KV_READY)

            # The last key block goes first: it alone carries the sequence-length mask.
            patch = functools.partial(self._patch_k_tail, buf.sK, k_patch, tile, shapes)
            if const_expr(self.config.intra_wg_overlap):
                self._wait_full(buf.pipeline_k, kv_state)
                patch(kv_state.index, warpgroup_idx)
                acc_S = self._qk_gemm(ctx, kv_state.index, 0)
                self._release_k(ctx, kv_state)
                self._mask_scores(ctx, acc_S, n_block_max - 1, mask_seqlen=True, masked=True)
                softmax.step(acc_S, is_first=True, halves=ctx.halves)
                self._scores_to_p(ctx, acc_S)
                if const_expr(self.config.rescale_o_before_pv):
                    ctx.pending_scale.fill(1.0)
            else:
                self._schedule_wait(warpgroup_idx)
                kv_state = self._block_no_overlap(
                    ctx, kv_state, n_block_max - 1, True, is_first=True, patch=patch
                )
            kv_state = self._mainloop_rest(ctx, block_range, kv_state, n_block_min, n_block_max - 1)
            if const_expr(release_q_after_mainloop):
                buf.pipeline_q.consumer_release(q_state)

            if const_expr(self.config.intra_wg_overlap):
                # The P V of the first key block is still to do.
                if const_expr(self.config.rescale_o_before_pv):
                    self._rescale_o(acc_O, ctx.pending_scale)
                self._wait_v(ctx, kv_state)
                if const_expr(self.clears_v_tail):
                    self._clear_v_tail(ctx, kv_state.index, n_block_min)
                self._pv_gemm(ctx, kv_state.index, 0)
                self._release_v(ctx, kv_state)
                kv_state.advance()
            else:
                self._schedule_signal_next(warpgroup_idx)

            # A split's partial O is normalized by its own row sum; the merge (_merge_splits)
            # weighs it by exp(lse_split - lse).
            if const_expr(self.split_scores):
                softmax.combine_halves(ctx.halves)
            inv_row_sum, row_lse = softmax.finalize(sink_log2)
            apply_v_descale(inv_row_sum, v_descale)
            rescale_rows(acc_O, inv_row_sum)
            lse.store(row_lse.load())
        else:
            if const_expr(self.persistent and not self.o_overwrites_q):
                buf.pipeline_q.consumer_release(q_state)

        if const_expr(trace is not None):
            trace.stamp(trace_records.MAINLOOP_END)
        q_release = None
        if const_expr(not release_q_after_mainloop):
            q_release = QRelease(ring=buf.pipeline_q, state=q_state)
        return kv_state, TileResult(acc_O=acc_O, lse=lse, seqlen=seqlen, q_release=q_release)

    def _operands(
        self,
        buf: CtaBuffers,
        setup: MmaSetup,
        tile: WorkTile,
        shapes: ProblemShapes,
        seqlen,
        n_block_max: Int32,
    ):
        """(MainloopOperands, V's descale or None) of a tile: its mask, the warpgroup's WGMMA
        fragments, O's accumulator, P's path (registers or smem), the softmax with its scale
        (K's FP8 descale and softcap folded in)."""
        softmax_scale_log2, tidx, warpgroup_idx = (
            setup.softmax_scale_log2,
            setup.tidx,
            setup.warpgroup_idx,
        )
        mask = AttentionMask(
            self.config.tile_m,
            self.config.tile_n,
            self.variant.pack_gqa_ratio,
            seqlen.seqlen_q,
            seqlen.seqlen_k,
            self.window,
        )
        m_block = tile.m_block
        # WGMMA operands are per warpgroup: slice at the warpgroup's first thread. Warpgroups
        # splitting O share the scores' rows: the Q K^T slices of the first one.
        own_scores = self.o_split == 1 or self.split_scores
        qk_tidx = tidx if const_expr(own_scores) else tidx % THREADS_PER_WARPGROUP
        qk_warpgroup = warpgroup_idx if const_expr(own_scores) else 0
        wg_mma_qk = setup.tiled_mma_qk.get_slice(qk_warpgroup * THREADS_PER_WARPGROUP)
        wg_mma_pv = setup.tiled_mma_pv.get_slice(warpgroup_idx * THREADS_PER_WARPGROUP)
        acc_O = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.config.tile_m, self.variant.head_dim_v)), Float32
        )
        smem_copy_P, tPsP = None, None
        if const_expr(self.config.pv_from_registers):
            tOrP = wg_mma_pv.make_fragment_A(
                wg_mma_pv.partition_shape_A((self.config.tile_m, self.config.tile_n))
            )
        else:
            tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_A(buf.sP))
            smem_copy_P = cute.make_tiled_copy_C(
                self.stmatrix_atom(), setup.tiled_mma_qk
            ).get_slice(tidx)
            tPsP = smem_copy_P.partition_D(buf.sP)
        # FP8 K/V: K's descale (and with FP8 math q's) multiplies every score (folded into the
        # softmax scale), V's every output row (folded into the final 1 / row sum).
        softmax_scale_log2, v_descale = fold_descales(shapes, tile, softmax_scale_log2)
        # Softcap: the scores become tanh(s * scale / softcap), and the softmax's scale is
        # softcap * log2(e).
        softcap_prescale = None
        if const_expr(self.variant.softcap > 0):
            softcap_log2 = self.variant.softcap * LOG2_E
            softcap_prescale = softmax_scale_log2 * (1.0 / softcap_log2)
            softmax_scale_log2 = Float32(softcap_log2)
        softmax = OnlineSoftmax.create(
            softmax_scale_log2,
            cute.size(hopper_mma.acc_as_rows_cols(acc_O), mode=[0]),
            self.config.exp2_on_fma,
            self.config.rescale_threshold,
            # e4m3 P: probabilities up to 2^8 use its range (its largest value is 448).
            max_offset=FP8_P_OFFSET if const_expr(self.fp8_math) else 0,
        )
        ctx = MainloopOperands(
            tiled_mma_qk=setup.tiled_mma_qk,
            tiled_mma_pv=setup.tiled_mma_pv,
            thr_mma_qk=setup.tiled_mma_qk.get_slice(qk_tidx),
            tSrQ=wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(buf.sQ_mma)),
            tSrK=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(buf.sK)),
            # (With fp8_math, sV is V^T already: kernels/v_transpose.py.)
            tOrVt=wg_mma_pv.make_fragment_B(
                wg_mma_pv.partition_B(
                    buf.sV if const_expr(self.fp8_math) else hopper_mma.transpose_smem_view(buf.sV)
                )
            ),
            tOrP=tOrP,
            smem_copy_P=smem_copy_P,
            tPsP=tPsP,
            acc_S_shape=wg_mma_qk.partition_shape_C((self.config.tile_m, self.config.tile_n)),
            acc_O=acc_O,
            softmax=softmax,
            softcap_prescale=softcap_prescale,
            # With rescale_o_before_pv, the O rescale owed by the last softmax step.
            pending_scale=cute.make_rmem_tensor(softmax.num_rows, Float32)
            if const_expr(self.config.rescale_o_before_pv)
            else None,
            mask=mask,
            m_block=m_block,
            pipeline_k=buf.pipeline_k,
            pipeline_v=buf.pipeline_v,
            warpgroup_idx=warpgroup_idx,
            sV=buf.sV,
            last_block=n_block_max - 1,
            last_block_keys=seqlen.seqlen_k - (n_block_max - 1) * self.config.tile_n,
            halves=self._score_halves(buf.sRows, setup.tiled_mma_qk, tidx, warpgroup_idx)
            if const_expr(self.split_scores)
            else None,
        )
        return ctx, v_descale

    @cute.jit
    def _mainloop_rest(self, ctx, block_range, kv_state, n_block_min: Int32, n_block_next: Int32):
        """Key blocks n_block_next - 1 down to n_block_min: those crossing the diagonal (causal)
        or the window's right edge (local) first, masked, then the unmasked ones, then those
        crossing the window's left edge, masked."""
        m_block = ctx.m_block
        block_step = (
            self._block_overlap
            if const_expr(self.config.intra_wg_overlap)
            else self._block_no_overlap
        )
        if const_expr(self.variant.causal):
            n_block_masked_min = cutlass.max(
                block_range.first_causal_masked_block(m_block), n_block_min
            )
            for i in cutlass.range(n_block_next - n_block_masked_min, unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_next - 1 - i, True)
            n_block_next = cutlass.min(n_block_next, n_block_masked_min)
        n_block_unmasked_min = n_block_min
        if const_expr(self.variant.local):
            right_from = cutlass.max(block_range.first_right_masked_block(m_block), n_block_min)
            for i in cutlass.range(cutlass.max(n_block_next - right_from, 0), unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_next - 1 - i, True)
            n_block_next = cutlass.min(n_block_next, right_from)
            n_block_unmasked_min = cutlass.min(
                cutlass.max(block_range.left_masked_blocks_end(m_block), n_block_min),
                n_block_next,
            )
        for i in cutlass.range(n_block_next - n_block_unmasked_min, unroll=1):
            kv_state = block_step(ctx, kv_state, n_block_next - 1 - i, False)
        if const_expr(self.variant.local):
            for i in cutlass.range(n_block_unmasked_min - n_block_min, unroll=1):
                kv_state = block_step(ctx, kv_state, n_block_unmasked_min - 1 - i, True)
        return kv_state

    def _mask_scores(self, ctx, acc_S, n_block, mask_seqlen: bool, masked: bool):
        """Scores of key block n_block, softcapped where the variant says so, then masked: keys
        past seqlen_k where mask_seqlen, and where masked (a block crossing the diagonal or an
        edge of the window) the variant's causal or local mask."""
        if const_expr(self.variant.softcap > 0):
            apply_softcap(acc_S, ctx.softcap_prescale)
        ctx.mask.apply(
            acc_S,
            ctx.thr_mma_qk,
            ctx.m_block,
            n_block,
            mask_seqlen=mask_seqlen,
            mask_causal=masked and self.variant.causal,
            mask_local=masked and self.variant.local,
        )

    @cute.jit
    def _row_sinks_log2(self, mLearnableSink: cute.Tensor, tiled_mma_pv, tidx: Int32, tile):
        """Per row of the thread's accumulator, its head's sink logit times log2(e); -inf in
        splits other than the first, so that a split launch counts each sink once."""
        coords = hopper_mma.acc_as_rows_cols(
            tiled_mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.config.tile_m, self.variant.head_dim_v))
            )
        )
        num_rows = cute.size(coords, mode=[0])
        sinks = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            _, head = self.row_of_tile(coords[r, 0][0], tile)
            sinks[r] = mLearnableSink[head].to(Float32) * LOG2_E
            if const_expr(self.variant.split):
                if tile.split_idx != 0:
                    sinks[r] = -Float32.inf
        return sinks

    def _qk_gemm(self, ctx, stage, wait_groups):
        acc_S = cute.make_rmem_tensor(ctx.acc_S_shape, Float32)
        hopper_mma.warpgroup_gemm(
            ctx.tiled_mma_qk,
            acc_S,
            ctx.tSrQ,
            ctx.tSrK[None, None, None, stage],
            zero_init=True,
            wait_groups=wait_groups,
        )
        return acc_S

    def _pv_gemm(self, ctx, stage, wait_groups):
        hopper_mma.warpgroup_gemm(
            ctx.tiled_mma_pv,
            ctx.acc_O,
            ctx.tOrP,
            ctx.tOrVt[None, None, None, stage],
            zero_init=False,
            wait_groups=wait_groups,
        )

    def _rescale_o(self, acc_O, row_scale):
        """O *= the softmax's row scales (with lazy_rescale, only if some row's max moved)."""
        if const_expr(self.config.lazy_rescale):
            rescale_rows_if_any_changed(acc_O, row_scale)
        else:
            rescale_rows(acc_O, row_scale)

    def _scores_to_p(self, ctx, acc_S):
        """Round probabilities to the input dtype where the P V GEMM reads them."""
        if const_expr(self.fp8_math):  # (P from registers: the plan's rule)
            hopper_mma.pack_p_e4m3(acc_S, ctx.tOrP)
            return
        p_as_a = hopper_mma.acc_as_operand_a(acc_S)
        if const_expr(self.config.pv_from_registers):
            hopper_mma.convert_to_16bit(p_as_a, ctx.tOrP)
        else:
            rP = cute.make_rmem_tensor_like(p_as_a, self.mma_dtype)
            hopper_mma.convert_to_16bit(p_as_a, rP)
            if const_expr(self.split_scores and self.config.intra_wg_overlap):
                # Both warpgroups' P V reads all of sP: the other's last one (which it waited
                # for before arriving) must be done before this half is overwritten. Without
                # the overlap each waits for its P V before the next block's Q K^T, so the
                # row-max exchange's barrier has already ordered it.
                self._split_scores_barrier()
            cute.copy(ctx.smem_copy_P, ctx.smem_copy_P.retile(rP), ctx.tPsP)
            cute.arch.fence_view_async_shared()
            if const_expr(self.split_scores):
                self._split_scores_barrier()  # both halves written before either P V
            else:
                # Each warp reads back only the P rows it wrote, so a warp barrier suffices.
                cute.arch.sync_warp()

    def _block_overlap(self, ctx, kv_state, n_block, masked: bool):
        """Issue S = Q K(n), then O += P(n+1) V(n+1); the softmax of S(n) runs under P V."""
        v_state = kv_state.clone()
        kv_state.advance()
        self._wait_full(ctx.pipeline_k, kv_state)
        self._schedule_wait(ctx.warpgroup_idx)
        acc_S = self._qk_gemm(ctx, kv_state.index, -1)
        if const_expr(self.config.rescale_o_before_pv):
            self._rescale_o(ctx.acc_O, ctx.pending_scale)
        self._wait_v(ctx, v_state)
        if const_expr(self.clears_v_tail):
            self._clear_v_tail(ctx, v_state.index, n_block + 1)
        self._pv_gemm(ctx, v_state.index, -1)
        self._schedule_signal_next(ctx.warpgroup_idx)
        warpgroup.wait_group(1)
        self._release_k(ctx, kv_state)
        self._mask_scores(ctx, acc_S, n_block, mask_seqlen=False, masked=masked)
        row_scale = ctx.softmax.step(acc_S, is_first=False, halves=ctx.halves)
        warpgroup.wait_group(0)
        self._release_v(ctx, v_state)
        self._scores_to_p(ctx, acc_S)
        if const_expr(self.config.rescale_o_before_pv):
            ctx.pending_scale.store(row_scale.load())
        else:
            self._rescale_o(ctx.acc_O, row_scale)
        return kv_state

    def _block_no_overlap(
        self, ctx, kv_state, n_block, masked: bool, is_first: bool = False, patch=None
    ):
        """S = Q K(n); softmax; O += P V(n). A warpgroup's ping-pong turn spans this block's
        P V and the next block's Q K^T: the caller waits before the first block and signals
        after the last. patch (the first block): _patch_k_tail, bound to the tile."""
        self._wait_full(ctx.pipeline_k, kv_state)
        if const_expr(patch is not None):
            patch(kv_state.index, ctx.warpgroup_idx)
        acc_S = self._qk_gemm(ctx, kv_state.index, -1)
        self._schedule_signal_next(ctx.warpgroup_idx)
        warpgroup.wait_group(0)
        self._release_k(ctx, kv_state)
        self._mask_scores(ctx, acc_S, n_block, mask_seqlen=is_first, masked=masked)
        row_scale = ctx.softmax.step(acc_S, is_first=is_first, halves=ctx.halves)
        self._scores_to_p(ctx, acc_S)
        self._rescale_o(ctx.acc_O, row_scale)
        self._wait_v(ctx, kv_state)
        if const_expr(is_first and self.clears_v_tail):
            self._clear_v_tail(ctx, kv_state.index, n_block)
        self._schedule_wait(ctx.warpgroup_idx)
        self._pv_gemm(ctx, kv_state.index, 0)
        self._release_v(ctx, kv_state)
        kv_state.advance()
        return kv_state

    def _convert_q(self, buf: CtaBuffers, tidx: Int32, tile: WorkTile, shapes, seqlen, angles):
        """Q's tile once loaded, by the MMA warps (tidx: this one's thread), which then sync:
        FP8 cache, bf16 q: to fp16 in place (buf.sQ_mma), saturating; a fused append with
        rotary: rotated in place (_rotate_q)."""
        if const_expr(self.converts_q):
            convert_block(
                buf.sQ, buf.sQ_mma, tidx, self.num_mma_threads, self.config.tile_m, saturate=True
            )
        if const_expr(self.variant.rotary_dim > 0):
            self._rotate_q(buf.sQ, tidx, tile, shapes, seqlen, angles)
        if const_expr(self.converts_q or self.variant.rotary_dim > 0):
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.Q_CONVERT), number_of_threads=self.num_mma_threads
            )

    @cute.jit
    def _q_rotation_item(self, i, tile: WorkTile, start: Int32):
        """(row, pair, table position) of Q's rotation item i (items run row by row): the row's
        position is its sequence's length before the append, plus its token index with
        rotary_per_row."""
        pairs = self.rotary.pairs
        row = i // pairs
        position = start
        if const_expr(self.variant.rotary_per_row):
            position = start + self.row_of_tile(row, tile)[0]
        return row, i - row * pairs, position

    @cute.jit
    def _q_angles(self, tidx: Int32, tile: WorkTile, shapes, seqlen):
        """A fused append with rotary: this thread's first Q_ANGLES_AHEAD rotation items'
        angles (cos, sin), read before Q has landed (a decode tile's items are all of them);
        None without rotary."""
        if const_expr(self.variant.rotary_dim == 0):
            return None
        rot = self.rotary
        count = self.tile_query_rows(tile, seqlen) * rot.pairs
        start = shapes.seqused_k[tile.batch_idx]
        angles = cute.make_rmem_tensor(2 * Q_ANGLES_AHEAD, Float32)
        for k in cutlass.range_constexpr(Q_ANGLES_AHEAD):
            i = tidx + k * self.num_mma_threads
            if i < count:
                _, j, position = self._q_rotation_item(i, tile, start)
                row = rot.table_row(shapes.append_cos, position)
                angles[2 * k], angles[2 * k + 1] = rot.angle(
                    shapes.append_cos, shapes.append_sin, row, j
                )
        return angles

    @cute.jit
    def _rotate_q(self, sQ: cute.Tensor, tidx: Int32, tile: WorkTile, shapes, seqlen, angles):
        """Q's rows that hold a query rotated in place, a (row, pair) item per thread at a
        time (the first ones with the angles _q_angles read), then made visible to the
        WGMMAs."""
        rot = self.rotary
        count = self.tile_query_rows(tile, seqlen) * rot.pairs
        start = shapes.seqused_k[tile.batch_idx]
        threads = self.num_mma_threads
        for k in cutlass.range_constexpr(Q_ANGLES_AHEAD):
            i = tidx + k * threads
            if i < count:
                row, j, _ = self._q_rotation_item(i, tile, start)
                a, b = rot.columns(j)
                rot.rotate_pair(sQ, sQ, (row, a), (row, b), angles[2 * k], angles[2 * k + 1])
        for i in cutlass.range(tidx + Q_ANGLES_AHEAD * threads, count, threads, unroll=1):
            row, j, position = self._q_rotation_item(i, tile, start)
            table_row = rot.table_row(shapes.append_cos, position)
            c, s = rot.angle(shapes.append_cos, shapes.append_sin, table_row, j)
            a, b = rot.columns(j)
            rot.rotate_pair(sQ, sQ, (row, a), (row, b), c, s)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMAs' reads

    def _k_patch_span(self, tile: WorkTile, shapes, seqlen, n_block_max):
        """A fused append's appended rows in K(n_max-1): (the sequence's length before the
        append, the first such slot, the block's first slot, the rows)."""
        start = shapes.seqused_k[tile.batch_idx]
        block_start = (n_block_max - 1) * self.config.tile_n
        first = cutlass.max(start, block_start)
        end = cutlass.min(cutlass.min(start + shapes.kv_length, seqlen.seqlen_k),
                          block_start + self.config.tile_n)  # fmt: skip
        return start, first, block_start, cutlass.max(end - first, 0)

    def _k_patch_row_items(self) -> int:
        """Items of one patched row: its rotated pairs, then its other dims one by one."""
        return self.rotary.pairs + self.variant.head_dim - self.variant.rotary_dim

    @cute.jit
    def _k_patch_load(self, i, span, tile: WorkTile, shapes, regs: cute.Tensor):
        """K patch item i's values into regs (x0, x1, cos, sin of a pair; x of a dim);
        returns (its row in the block, its dims a, b: a == b for a dim copied as it is)."""
        start, first, block_start, _ = span
        rot = self.rotary
        per_row = self._k_patch_row_items()
        row = i // per_row
        item = i - row * per_row
        slot = first + row
        src = shapes.append_k[tile.batch_idx, slot - start, tile.head_kv_idx, None]
        a = item - rot.pairs + rot.rotary_dim
        b = a
        if const_expr(rot.pairs > 0):
            if item < rot.pairs:
                a, b = rot.columns(item)
                table_row = rot.table_row(shapes.append_cos, slot)
                regs[2], regs[3] = rot.angle(shapes.append_cos, shapes.append_sin, table_row, item)
        regs[0], regs[1] = src[a].to(Float32), src[b].to(Float32)
        return slot - block_start, a, b

    @cute.jit
    def _k_patch_store(self, sK: cute.Tensor, row, a, b, regs: cute.Tensor):
        if a == b:
            sK[row, a] = regs[0].to(sK.element_type)
        else:
            x0, x1, c, s = regs[0], regs[1], regs[2], regs[3]
            sK[row, a] = (x0 * c - x1 * s).to(sK.element_type)
            sK[row, b] = (x0 * s + x1 * c).to(sK.element_type)

    @cute.jit
    def _k_patch_ahead(self, tile: WorkTile, shapes, seqlen, n_block_max):
        """A fused append: (the patch's span, its items, this thread's first item's values and
        (row, a, b)), read before K(n_max-1) lands; None otherwise."""
        if const_expr(not self.variant.fused_append):
            return None
        span = self._k_patch_span(tile, shapes, seqlen, n_block_max)
        count = span[3] * self._k_patch_row_items()
        wg_thread = cute.arch.thread_idx()[0] % THREADS_PER_WARPGROUP
        regs = cute.make_rmem_tensor(4, Float32)
        row, a, b = Int32(0), Int32(0), Int32(0)
        if wg_thread < count:
            row, a, b = self._k_patch_load(wg_thread, span, tile, shapes, regs)
        return span, count, regs, row, a, b

    @cute.jit
    def _patch_k_tail(self, sK, k_patch, tile: WorkTile, shapes, stage, warpgroup_idx):
        """A fused append, once K(n_max-1) has landed: its appended rows (k rotated) written
        over the stage (TMA read them as the cache held them before the append). Each MMA
        warpgroup writes them all before its own Q K^T (they write the same values), then
        makes the stores visible to its WGMMA."""
        if const_expr(k_patch is not None):
            span, count, regs, row, a, b = k_patch
            if count > 0:
                sK_stage = sK[None, None, stage]
                wg_thread = cute.arch.thread_idx()[0] % THREADS_PER_WARPGROUP
                if wg_thread < count:
                    self._k_patch_store(sK_stage, row, a, b, regs)
                threads = THREADS_PER_WARPGROUP
                for i in cutlass.range(wg_thread + threads, count, threads, unroll=1):
                    more = cute.make_rmem_tensor(4, Float32)
                    row_i, a_i, b_i = self._k_patch_load(i, span, tile, shapes, more)
                    self._k_patch_store(sK_stage, row_i, a_i, b_i, more)
                cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMA's reads
                cute.arch.barrier(  # (its V tail's barrier: the two are one after the other)
                    barrier_id=int(NamedBarrier.V_TAIL_1) + warpgroup_idx,
                    number_of_threads=THREADS_PER_WARPGROUP,
                )

    def _split_scores_barrier(self):
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.SPLIT_SCORES), number_of_threads=self.num_mma_threads
        )

    def _score_halves(self, sRows, tiled_mma_qk, tidx, warpgroup_idx) -> ScoreHalves:
        """split_scores: the row exchange of this thread (its accumulator rows' tile rows)."""
        coords = hopper_mma.acc_as_rows_cols(
            tiled_mma_qk.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.config.tile_m, self.config.tile_n))
            )
        )
        rows = cute.make_rmem_tensor(cute.size(coords, mode=[0]), Int32)
        for r in range(cute.size(rows)):  # (a plain Python loop: this is not a jit function)
            rows[r] = coords[r, 0][0]
        return ScoreHalves(
            smem=sRows,
            rows=rows,
            warpgroup=warpgroup_idx,
            writer=tidx % 4 == 0,
            barrier_id=int(NamedBarrier.SPLIT_SCORES),
            num_threads=self.num_mma_threads,
        )

    @cute.jit
    def _clear_v_tail(self, ctx, stage, v_block: Int32):
        """Before the P V of key block v_block (V in stage `stage`): if that block is the
        tile's last and partial, zero its V rows past the sequence's last key. P is 0 there,
        but the rows hold whatever follows the sequence in memory (a cache's unused slots,
        another sequence's keys), and 0 * NaN or 0 * inf would reach O; only padded K/V
        without seqused_k end where the tensor (and TMA's zero fill) does. Each MMA warpgroup
        zeroes the whole tail before its own P V (they write the same zeros), in 16-byte
        pieces, then makes the stores visible to its WGMMA. Runs while Q K^T is in flight."""
        valid = ctx.last_block_keys
        if v_block == ctx.last_block and valid < self.config.tile_n:
            zero_rows_from(ctx.sV[None, None, stage], valid, ctx.warpgroup_idx)

    # With v_in_k, V is part of K's stage: the stage stays held from its Q K^T (whose wait
    # covers V) until its P V is done, and is released once, then.
    def _release_k(self, ctx, state):
        if const_expr(not self.variant.v_in_k):
            ctx.pipeline_k.consumer_release(state)

    def _wait_v(self, ctx, state):
        if const_expr(not self.variant.v_in_k):
            self._wait_full(ctx.pipeline_v, state)

    def _release_v(self, ctx, state):
        if const_expr(self.variant.v_in_k):
            ctx.pipeline_k.consumer_release(state)
        else:
            ctx.pipeline_v.consumer_release(state)

    def _wait_full(self, ring, state):
        """Wait for a K/V stage. With mbarrier_probe, poll the barrier once first and take
        the blocking wait (with its suspend hint) only if the stage is not yet full."""
        if const_expr(self.config.mbarrier_probe):
            ring.consumer_wait(state, ring.consumer_try_wait(state))
        else:
            ring.consumer_wait(state)
        if const_expr(self.gemm_reads_gathered_rows):  # cp.async's writes -> WGMMA's reads
            cute.arch.fence_view_async_shared()

    def _schedule_wait(self, warpgroup_idx):
        if const_expr(self.config.pingpong):
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.WG_SCHEDULE_1) + warpgroup_idx,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )

    def _schedule_signal_next(self, warpgroup_idx):
        if const_expr(self.config.pingpong):
            next_wg = warpgroup_idx + 1
            if const_expr(self.num_mma_warpgroups == 2):
                next_wg = 1 - warpgroup_idx
            else:
                next_wg = next_wg % self.num_mma_warpgroups
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.WG_SCHEDULE_1) + next_wg,
                number_of_threads=2 * THREADS_PER_WARPGROUP,
            )
