"""The latent decode kernel's mainloop: FlashMLA's "seesaw" schedule of two MMA warpgroups over
one tile of 64 query rows (heads x tokens of one sequence) against the 576-wide latent cache.

Key blocks go in pairs (a, b) = (n, n - 1), a in K buffer 0 and b in buffer 1 (an odd count's
last block goes alone first, as a pair with no b). Warpgroup 0 owns O's columns 0-255 (O_L),
warpgroup 1 columns 256-511 (O_R). Each computes the scores of one block over all 576 columns
(S_a = Q K_a^T by warpgroup 0, S_b by 1) and the P V of both blocks on its half of O, so each
softmax runs while the other warpgroup's GEMMs keep the tensor cores busy. Per pair, with M the
running row max (both warpgroups keep it; it moves through shared memory):

  WG0: S_a; m0 = max(M, rowmax S_a), to smem; O_L, l0 *= 2^(M - m0); P_a = 2^(S_a - m0)
       -> [MAX_0] -> O_L += P_a V_aL (P from registers)
  WG1: S_b; [MAX_0] m1 = max(m0, rowmax S_b), to smem; O_R, l1 *= 2^(M - m1); P_b = 2^(S_b - m1)
       -> [MAX_1]; P_b to sP1 -> [P_1]
  WG0: [MAX_1] P_a *= 2^(m0 - m1), to sP0 -> [P_0]; l0 *= 2^(m0 - m1)
  WG1: [P_0] O_R += P_a V_aR (P from smem); O_R += P_b V_bR (registers)
  WG0: [P_1] O_L *= 2^(m0 - m1); O_L += P_b V_bL (smem)

(exponents in log2 units, the softmax scale folded in; [X] is a named barrier, arrived on by
one warpgroup and waited on by the other). Each warpgroup keeps its own row sum l; they add up
at the end. sP1 is Q's rope columns (512-575): each warpgroup holds that part of Q in registers
(its Q K^T runs it from there), which frees the 8 KB a second P buffer needs.

Each K buffer half is freed by its last reader (kernels/mla_decode/loads.py loads them in that
order): buffer 0's left after WG0's P V on it, its right after WG1's; buffer 1's right after
WG1's P V on it, its left after WG0's.
"""

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .. import hopper_mma
from ..forward.facts import THREADS_PER_WARPGROUP, Piece
from ..forward.mainloop import zero_rows_from
from ..forward.records import MmaSetup, TileResult
from ..kv_dequant import apply_v_descale, convert_block, fold_descales
from ..masking import AttentionMask
from ..named_barriers import NamedBarrier
from ..softmax import (
    OnlineSoftmax,
    ScoreHalves,
    _quad_allreduce_max,
    _row_max,
    _row_sum,
    max_or_zero,
    max_rescale,
    rescale_rows,
)
from ..tile_scheduler import WorkTile
from .fp8_loads import HalfConverter
from .loads import LEFT, LEFT_TILES, RIGHT, HalfRings

ROWS = 64  # query rows of a tile
KEYS = 64  # keys of a block
D_LATENT = 512  # V's columns (the latent's first)
D_ROPE = 64
HALF_V = D_LATENT // 2  # a warpgroup's O columns


class SeesawMmas(NamedTuple):
    """The tiled MMAs: scores over the latent columns (Q and K from smem) and over the rope
    (Q from registers), and P V on a warpgroup's half of O with P from registers (its own) or
    from smem (the other's)."""

    qk: cute.TiledMma
    qk_rope: cute.TiledMma
    pv: cute.TiledMma
    pv_smem: cute.TiledMma


@dataclass(frozen=True)
class SeesawBuffers:
    """The CTA's tiles and rings as the MMA warpgroups see them."""

    sQ: cute.Tensor  # (64, 576), as the GEMMs read it
    sQ_loaded: cute.Tensor  # the same smem as Q is loaded (bf16 q with an FP8 cache: bf16)
    sK: cute.Tensor  # (64, 576, 2): the two K buffers
    sV: cute.Tensor  # (64, 512, 2): their first 512 columns
    sP0: cute.Tensor  # (64, 64): warpgroup 0's P
    sRows: cute.Tensor  # (2, 2, 64) fp32: (max or sum, warpgroup, row)
    pipeline_q: pipeline.PipelineAsync
    rings: HalfRings
    # An FP8 cache (each warpgroup converts the halves it reads first, in place): the K
    # buffers as raw (unswizzled) fp16 smem; None with a 16-bit cache.
    fp8_k: Optional[cute.Pointer] = None


@dataclass(frozen=True)
class Operands:
    """One MMA thread's view of the tile's GEMM operands (frozen: read-only to the DSL across
    dynamic control flow; the register tensors are its state)."""

    tSrQ: cute.Tensor  # Q's latent columns (smem), k-blocks 0..31
    tSrQ_rope: cute.Tensor  # Q's rope columns (registers), k-blocks 0..3
    tSrK: cute.Tensor  # (..., buffer)
    tSrK_rope: cute.Tensor
    tOrVt: cute.Tensor  # V^T (..., buffer), this warpgroup's columns
    tOrVt_smem: cute.Tensor
    tOrP: cute.Tensor  # this warpgroup's P as the A operand (registers)
    tOrP0: cute.Tensor  # sP0 (warpgroup 0's P) as the A operand, for warpgroup 1
    tOrP1: cute.Tensor  # sP1 (warpgroup 1's P, over Q's rope) as the A operand, for 0
    copy_P: cute.ThrCopy  # P (16-bit accumulator fragment) -> smem
    tPsP0: cute.Tensor  # sP0 as copy_P writes it (warpgroup 0)
    tPsP1: cute.Tensor  # sP1 (warpgroup 1)
    acc_S_shape: object
    acc_O: cute.Tensor
    softmax: OnlineSoftmax  # row_max: M as this warpgroup knows it; row_sum: its own l
    rows: cute.Tensor  # the thread's accumulator rows' tile rows
    writer: cutlass.Boolean  # the first lane of its quad: writes the row's values
    wg_thread: Int32  # the thread's index in its warpgroup
    thr_mma_qk: cute.ThrMma
    mask: AttentionMask
    mask_from: Int32  # key blocks from here on are masked (sequence end, causal diagonal)
    m_block: Int32
    last_block: Int32  # the tile's last key block, in buffer 0 of its first pair
    tail_keys: Int32  # its keys (fewer than 64: V's rows past them are zeroed)
    scale_log2: Float32


def _consumer_state() -> pipeline.PipelineState:
    return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)


class Seesaw(Piece):
    """One tile's mainloop on the two MMA warpgroups (`mma`)."""

    @cute.jit
    def mma(
        self,
        mmas: SeesawMmas,
        buf: SeesawBuffers,
        setup: MmaSetup,
        tile: WorkTile,
        shapes,
        q_state: pipeline.PipelineState,
    ) -> TileResult:
        """The tile's key blocks; returns O (normalized, this warpgroup's columns) and the LSE.
        Each warpgroup waits on its own buffer's half rings (0: buffer 0's, 1: buffer 1's) and
        releases the halves it reads."""
        seqlen, block_range, n_block_min, n_block_max = self.tile_problem(tile, shapes)
        # An FP8 cache's descales: K's multiplies every score, V's every O row.
        scale_log2, v_descale = fold_descales(shapes, tile, setup.softmax_scale_log2)
        setup = dataclasses.replace(setup, softmax_scale_log2=scale_log2)
        ops = self._operands(mmas, buf, setup, tile, seqlen, block_range, n_block_max)
        acc_O, softmax = ops.acc_O, ops.softmax
        acc_O.fill(0.0)
        softmax.row_max.fill(-Float32.inf)
        softmax.row_sum.fill(0.0)
        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        lse.fill(-Float32.inf)  # an empty tile or split: out = 0, lse = -inf
        if n_block_max > n_block_min:
            buf.pipeline_q.consumer_wait(q_state)
            if const_expr(self.converts_q):  # bf16 q, FP8 cache: the GEMMs run in fp16
                convert_block(
                    buf.sQ_loaded, buf.sQ, setup.tidx, self.num_mma_threads, ROWS, saturate=True
                )
                self._sync(NamedBarrier.Q_CONVERT)
            self._load_q_rope(buf, ops)
            count = n_block_max - n_block_min
            odd = count % 2
            if setup.warpgroup_idx == 0:
                state = _consumer_state()  # buffer 0's (both halves: one phase)
                if odd == 1:
                    state = self._wg0_pair(mmas, buf, ops, n_block_max - 1, state, False)
                for p in cutlass.range(count // 2, unroll=1):
                    hi = n_block_max - 1 - odd - 2 * p
                    state = self._wg0_pair(mmas, buf, ops, hi, state, True, p > 0)
                warpgroup.wait_group(0)
            else:
                state = _consumer_state()  # buffer 1's
                if odd == 1:
                    state = self._wg1_pair(mmas, buf, ops, n_block_max - 1, state, False)
                for p in cutlass.range(count // 2, unroll=1):
                    hi = n_block_max - 1 - odd - 2 * p
                    state = self._wg1_pair(mmas, buf, ops, hi, state, True)
            buf.pipeline_q.consumer_release(q_state)
            halves = ScoreHalves(
                smem=buf.sRows,
                rows=ops.rows,
                warpgroup=setup.warpgroup_idx,
                writer=ops.writer,
                barrier_id=int(NamedBarrier.SPLIT_SCORES),
                num_threads=self.num_mma_threads,
            )
            softmax.combine_halves(halves)
            inv_row_sum, row_lse = softmax.finalize()
            apply_v_descale(inv_row_sum, v_descale)
            rescale_rows(acc_O, inv_row_sum)
            lse.store(row_lse.load())
        return TileResult(acc_O=acc_O, lse=lse, seqlen=seqlen)

    # ------------------------------------------------------------------------------------
    # The two warpgroups' parts of a pair
    # ------------------------------------------------------------------------------------

    @cute.jit
    def _wg0_pair(
        self,
        mmas,
        buf,
        ops,
        n_block,
        state,
        has_b: cutlass.Constexpr,
        after_pair=False,
    ):
        """Warpgroup 0's part of the pair (n_block, n_block - 1): block a's scores, its P V on
        O_L, P_a for warpgroup 1, and (has_b) block b's P V on O_L, left in flight. after_pair:
        the last pair's P V on buffer 1 is in flight: its left half is freed as soon as that
        is done, before the scores wait for buffer 0 (warpgroup 1's next scores wait for
        that half's refill, so freeing it after this block's scores were issued put buffer
        0's load latency on warpgroup 1's path too: 285 -> 267 us at 64 x 8k, H100)."""
        rings = buf.rings
        if const_expr(has_b):
            if after_pair:
                warpgroup.wait_group(0)
                rings.left1.consumer_release(state)  # (one stage: any state's index)
        # Buffer 0's left half was freed first (its last reader was this warpgroup's P V).
        acc_S = self._scores(mmas, buf, ops, 0, (rings.left0, rings.right0), (LEFT, RIGHT), state)
        warpgroup.wait_group(0)
        rings.right0.consumer_release(state)
        self._mask(ops, acc_S, n_block)
        maxes = self._row_maxima(ops, acc_S)
        softmax = ops.softmax
        scale = cute.make_rmem_tensor(softmax.num_rows, Float32)
        for r in cutlass.range_constexpr(softmax.num_rows):
            m_new = cute.arch.fmax(maxes[r], softmax.row_max[r])
            scale[r] = self._move_max(buf, ops, r, m_new, publish=0)
        self._exponentiate(ops, acc_S, scale)
        rescale_rows(ops.acc_O, scale)
        self._clear_v_tail(buf, ops, n_block, 0)
        self._arrive(NamedBarrier.SEESAW_MAX_0)
        hopper_mma.convert_to_16bit(hopper_mma.acc_as_operand_a(acc_S), ops.tOrP)
        self._pv(mmas.pv, ops.tOrP, ops.tOrVt, ops.acc_O, 0)
        # P_a against warpgroup 1's max, for its P V.
        self._sync(NamedBarrier.SEESAW_MAX_1)
        for r in cutlass.range_constexpr(softmax.num_rows):
            m1 = buf.sRows[0, 1, ops.rows[r]]
            scale[r] = self._move_max(buf, ops, r, m1, rescale_sum=True)
        rescale_rows(acc_S, scale)
        self._store_p(ops, acc_S, ops.tPsP0)
        cute.arch.fence_view_async_shared()  # P's smem writes -> warpgroup 1's WGMMA reads
        self._arrive(NamedBarrier.SEESAW_P_0)
        warpgroup.wait_group(0)  # P_a V_aL: buffer 0's left half is free
        rings.left0.consumer_release(state)
        self._sync(NamedBarrier.SEESAW_P_1)
        rescale_rows(ops.acc_O, scale)
        if const_expr(has_b):
            self._pv(mmas.pv_smem, ops.tOrP1, ops.tOrVt_smem, ops.acc_O, 1)
        state.advance()
        return state

    @cute.jit
    def _wg1_pair(self, mmas, buf, ops, n_block, state, has_b: cutlass.Constexpr):
        """Warpgroup 1's part of the pair (n_block, n_block - 1): (has_b) block b's scores,
        its P V on O_R and P_b for warpgroup 0; then block a's P V on O_R with warpgroup 0's
        P_a. Without b it takes warpgroup 0's max as its own and writes no P (the barriers
        run as in a pair)."""
        rings = buf.rings
        softmax = ops.softmax
        scale = cute.make_rmem_tensor(softmax.num_rows, Float32)
        if const_expr(has_b):
            # Buffer 1's right half was freed first (its last reader was this warpgroup).
            acc_S = self._scores(
                mmas, buf, ops, 1, (rings.right1, rings.left1), (RIGHT, LEFT), state
            )
            warpgroup.wait_group(0)
            rings.left1.consumer_release(state)
            self._mask(ops, acc_S, n_block - 1)
            maxes = self._row_maxima(ops, acc_S)
            self._sync(NamedBarrier.SEESAW_MAX_0)
            for r in cutlass.range_constexpr(softmax.num_rows):
                m_new = cute.arch.fmax(maxes[r], buf.sRows[0, 0, ops.rows[r]])
                scale[r] = self._move_max(buf, ops, r, m_new, publish=1)
            self._exponentiate(ops, acc_S, scale)
            rescale_rows(ops.acc_O, scale)
            self._arrive(NamedBarrier.SEESAW_MAX_1)
            self._store_p(ops, acc_S, ops.tPsP1)
            hopper_mma.convert_to_16bit(hopper_mma.acc_as_operand_a(acc_S), ops.tOrP)
            cute.arch.fence_view_async_shared()  # P's smem writes -> warpgroup 0's WGMMA reads
            self._arrive(NamedBarrier.SEESAW_P_1)
        else:
            self._sync(NamedBarrier.SEESAW_MAX_0)
            for r in cutlass.range_constexpr(softmax.num_rows):
                m_new = buf.sRows[0, 0, ops.rows[r]]
                scale[r] = self._move_max(buf, ops, r, m_new, publish=1, rescale_sum=True)
            rescale_rows(ops.acc_O, scale)
            self._arrive(NamedBarrier.SEESAW_MAX_1)
            self._arrive(NamedBarrier.SEESAW_P_1)
        self._sync(NamedBarrier.SEESAW_P_0)
        self._clear_v_tail(buf, ops, n_block, 1)
        # Block a's P V first: its buffer's right half, which warpgroup 0's next scores need,
        # is freed as soon as it is done.
        self._pv(mmas.pv_smem, ops.tOrP0, ops.tOrVt_smem, ops.acc_O, 0)
        if const_expr(has_b):
            self._pv(mmas.pv, ops.tOrP, ops.tOrVt, ops.acc_O, 1)
            warpgroup.wait_group(1)
        else:
            warpgroup.wait_group(0)
        rings.right0.consumer_release(state)  # (one stage: any state's index)
        if const_expr(has_b):
            warpgroup.wait_group(0)
            rings.right1.consumer_release(state)
            state.advance()
        return state

    # ------------------------------------------------------------------------------------
    # Steps
    # ------------------------------------------------------------------------------------

    @cute.jit
    def _load_q_rope(self, buf, ops):
        """Q's rope columns into registers, as the A operand of the rope's Q K^T (its smem
        becomes sP1). The A operand of a register-sourced WGMMA is laid out as a 64 x 64
        accumulator's registers (how P V takes P), so each element comes from the tile
        coordinate that accumulator layout gives it."""
        sQ_rope = hopper_mma.column_slice(buf.sQ, D_LATENT, D_ROPE)
        coords = hopper_mma.acc_as_operand_a(
            ops.thr_mma_qk.partition_C(cute.make_identity_tensor((ROWS, D_ROPE)))
        )
        for i in cutlass.range_constexpr(cute.size(ops.tSrQ_rope)):
            ops.tSrQ_rope[i] = sQ_rope[coords[i]]

    @cute.jit
    def _scores(self, mmas, buf, ops, buffer: int, rings, halves, state):
        """S = Q K^T of the block in `buffer` (one commit group, left in flight): the latent
        columns from smem, the rope's from Q's registers, each half's k-blocks issued once
        that half has landed (an FP8 cache's: and this warpgroup has converted it), the half
        freed first (halves[0], its ring rings[0]) first."""
        acc_S = cute.make_rmem_tensor(ops.acc_S_shape, Float32)
        latent_blocks = cute.size(ops.tSrQ.shape[2])
        half_blocks = latent_blocks * LEFT_TILES // (D_LATENT // 64)  # (k-blocks of the left half)
        tSrK = ops.tSrK[None, None, None, buffer]
        warpgroup.fence()
        for i in cutlass.range_constexpr(2):
            rings[i].consumer_wait(state)
            if const_expr(buf.fp8_k is not None):  # FP8: this warpgroup converts the half
                HalfConverter(buf.fp8_k, ops.wg_thread).convert(buffer, halves[i])
            if const_expr(halves[i] == LEFT):
                k_blocks = (0, half_blocks)
            else:
                k_blocks = (half_blocks, latent_blocks)
            hopper_mma.issue_k_blocks(mmas.qk, acc_S, ops.tSrQ, tSrK, k_blocks, i > 0)
            if const_expr(halves[i] == RIGHT):  # (the rope's columns are the right half's)
                hopper_mma.issue_k_blocks(
                    mmas.qk_rope, acc_S, ops.tSrQ_rope, ops.tSrK_rope[None, None, None, buffer],
                    (0, cute.size(ops.tSrQ_rope.shape[2])), True,
                )  # fmt: skip
        warpgroup.commit_group()
        return acc_S

    def _store_p(self, ops, acc_S, tPsP):
        """P (fp32 in the score accumulator) rounded to 16 bits into this warpgroup's sP (not
        yet fenced for the WGMMAs)."""
        p_as_a = hopper_mma.acc_as_operand_a(acc_S)
        rP = cute.make_rmem_tensor_like(p_as_a, self.mma_dtype)
        hopper_mma.convert_to_16bit(p_as_a, rP)
        cute.copy(ops.copy_P, ops.copy_P.retile(rP), tPsP)

    def _pv(self, tiled_mma, tOrP, tOrVt, acc_O, buffer: int):
        """O += P V of the block in `buffer` (this warpgroup's columns), left in flight."""
        warpgroup.fence()
        hopper_mma.issue_k_blocks(
            tiled_mma, acc_O, tOrP, tOrVt[None, None, None, buffer],
            (0, cute.size(tOrP.shape[2])), True,
        )  # fmt: skip
        warpgroup.commit_group()

    @cute.jit
    def _mask(self, ops, acc_S, n_block: Int32):
        """Keys past the sequence's end and, causal, above the diagonal, to -inf: only in the
        blocks that hold such keys (the last one or two)."""
        if n_block >= ops.mask_from:
            ops.mask.apply(
                acc_S,
                ops.thr_mma_qk,
                ops.m_block,
                n_block,
                mask_seqlen=True,
                mask_causal=self.variant.causal,
            )

    @cute.jit
    def _row_maxima(self, ops, acc_S) -> cute.Tensor:
        """Each of the thread's rows' max over the block (reduced over its quad)."""
        scores = hopper_mma.acc_as_rows_cols(acc_S)
        ncols = cute.size(scores, mode=[1])
        maxes = cute.make_rmem_tensor(ops.softmax.num_rows, Float32)
        for r in cutlass.range_constexpr(ops.softmax.num_rows):
            maxes[r] = _quad_allreduce_max(_row_max(scores[r, None], ncols))
        return maxes

    @cute.jit
    def _exponentiate(self, ops, acc_S, scale: cute.Tensor):
        """Scores to probabilities against the rows' (new) max in place; the row sums rescaled
        by `scale` and the block's added (this thread's columns)."""
        softmax = ops.softmax
        scores = hopper_mma.acc_as_rows_cols(acc_S)
        ncols = cute.size(scores, mode=[1])
        for r in cutlass.range_constexpr(softmax.num_rows):
            m_scaled = max_or_zero(softmax.row_max[r]) * softmax.scale_log2
            row = cute.make_rmem_tensor(ncols, Float32)
            for c in cutlass.range_constexpr(ncols):
                row[c] = cute.math.exp2(scores[r, c] * softmax.scale_log2 - m_scaled, fastmath=True)
            softmax.row_sum[r] = softmax.row_sum[r] * scale[r] + _row_sum(row, ncols)
            scores[r, None].store(row.load())

    @cute.jit
    def _move_max(self, buf, ops, r: int, m_new: Float32, publish: int = -1, rescale_sum=False):
        """Row r's running max becomes m_new (published for the other warpgroup in its slot
        of sRows unless publish is -1); returns the row's rescale of what was taken against
        the old max (its row sum rescaled too where rescale_sum)."""
        softmax = ops.softmax
        if const_expr(publish >= 0):
            if ops.writer:
                buf.sRows[0, publish, ops.rows[r]] = m_new
        scale = max_rescale(softmax.row_max[r], max_or_zero(m_new), ops.scale_log2)
        softmax.row_max[r] = m_new
        if const_expr(rescale_sum):
            softmax.row_sum[r] = softmax.row_sum[r] * scale
        return scale

    @cute.jit
    def _clear_v_tail(self, buf, ops, n_block: Int32, warpgroup_idx: int):
        """Before a warpgroup's P V on buffer 0: where that block is the sequence's last and
        partial, zero its V rows past the last key in this warpgroup's columns (P is 0 there,
        but the rows hold whatever follows the sequence: 0 * NaN would reach O). Block a's
        readers of those columns are done (its scores) or are this warpgroup."""
        # (An FP8 cache's conversion leaves those rows as they are too, NaN bytes included:
        # needed there as well. Without it ptxas also serialized the FP8 variants'
        # WGMMAs, C7515.)
        if const_expr(self.clears_v_tail or self.kv_fp8):
            if n_block == ops.last_block and ops.tail_keys < KEYS:
                half = cute.local_tile(buf.sV[None, None, 0], (KEYS, HALF_V), (0, warpgroup_idx))
                zero_rows_from(half, ops.tail_keys, warpgroup_idx)

    def _arrive(self, barrier: NamedBarrier):
        cute.arch.barrier_arrive(barrier_id=int(barrier), number_of_threads=self.num_mma_threads)

    def _sync(self, barrier: NamedBarrier):
        cute.arch.barrier(barrier_id=int(barrier), number_of_threads=self.num_mma_threads)

    # ------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------

    def _operands(self, mmas, buf, setup, tile, seqlen, block_range, n_block_max) -> Operands:
        """The thread's fragments, O's accumulator, its softmax state and the tile's masks."""
        wg_thread = setup.tidx % THREADS_PER_WARPGROUP
        thr_qk = mmas.qk.get_slice(wg_thread)
        thr_qk_rope = mmas.qk_rope.get_slice(wg_thread)
        thr_pv = mmas.pv.get_slice(setup.tidx)
        thr_pv_smem = mmas.pv_smem.get_slice(setup.tidx)
        sQ_latent = hopper_mma.column_slice(buf.sQ, 0, D_LATENT)
        sK_latent = hopper_mma.column_slice(buf.sK, 0, D_LATENT)
        sK_rope = hopper_mma.column_slice(buf.sK, D_LATENT, D_ROPE)
        sVt = hopper_mma.transpose_smem_view(buf.sV)
        # Warpgroup 1's P goes over Q's rope columns (in registers by then).
        sP1 = hopper_mma.column_slice(buf.sQ, D_LATENT, D_ROPE)
        copy_P = cute.make_tiled_copy_C(self.stmatrix_atom(), mmas.qk).get_slice(wg_thread)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, D_LATENT)), Float32)
        softmax = OnlineSoftmax.create(
            setup.softmax_scale_log2, cute.size(hopper_mma.acc_as_rows_cols(acc_O), mode=[0])
        )
        coords = hopper_mma.acc_as_rows_cols(
            thr_qk.partition_C(cute.make_identity_tensor((ROWS, KEYS)))
        )
        rows = cute.make_rmem_tensor(softmax.num_rows, Int32)
        for r in range(softmax.num_rows):  # (a plain Python loop: this is not a jit function)
            rows[r] = coords[r, 0][0]
        mask_from = n_block_max - 1
        if const_expr(self.variant.causal):
            mask_from = cutlass.min(mask_from, block_range.first_causal_masked_block(tile.m_block))
        return Operands(
            tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ_latent)),
            tSrQ_rope=thr_qk_rope.make_fragment_A(thr_qk_rope.partition_shape_A((ROWS, D_ROPE))),
            tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK_latent)),
            tSrK_rope=thr_qk_rope.make_fragment_B(thr_qk_rope.partition_B(sK_rope)),
            tOrVt=thr_pv.make_fragment_B(thr_pv.partition_B(sVt)),
            tOrVt_smem=thr_pv_smem.make_fragment_B(thr_pv_smem.partition_B(sVt)),
            tOrP=thr_pv.make_fragment_A(thr_pv.partition_shape_A((ROWS, KEYS))),
            tOrP0=thr_pv_smem.make_fragment_A(thr_pv_smem.partition_A(buf.sP0)),
            tOrP1=thr_pv_smem.make_fragment_A(thr_pv_smem.partition_A(sP1)),
            copy_P=copy_P,
            tPsP0=copy_P.partition_D(buf.sP0),
            tPsP1=copy_P.partition_D(sP1),
            acc_S_shape=thr_qk.partition_shape_C((ROWS, KEYS)),
            acc_O=acc_O,
            softmax=softmax,
            rows=rows,
            writer=wg_thread % 4 == 0,
            wg_thread=wg_thread,
            thr_mma_qk=thr_qk,
            mask=AttentionMask(
                ROWS, KEYS, self.variant.pack_gqa_ratio, seqlen.seqlen_q, seqlen.seqlen_k
            ),
            mask_from=mask_from,
            m_block=tile.m_block,
            last_block=n_block_max - 1,
            tail_keys=seqlen.seqlen_k - (n_block_max - 1) * KEYS,
            scale_log2=setup.softmax_scale_log2,
        )
