"""The transposed latent decode mainloop, for an FP8 latent cache and tiles of 16 or 32 query
rows (heads x tokens of one sequence; docs/mla_decode_design.md 3c).

A 64-row tile of 16 query rows issues 4x the tensor work it needs; here the keys take the
WGMMA's M and the rows its N (rows: 16 or 32, config.seesaw_rows):

  S^T = K Q^T        (M 64 keys, N rows, K 576 dims; A: K in registers, B: Q in smem)
  O^T += V^T P^T     (M 512 dims as eight m-atoms, N rows, K 64 keys; A: V^T in registers,
                      B: P^T in smem)

Both A operands come from the block's e4m3 bytes by ldmatrix and convert in registers
(fp8_fragments.py), so no fp16 copy of a block is written to shared memory. Warpgroup w takes
the tile's blocks of parity w (n_block_max - 1 - w, then every second one down) from its own
two-stage ring, with its own O^T, column maxima and sums: no exchange per block, and the other
warpgroup's GEMMs run under each softmax. The softmax runs down S^T's columns against
reference maxima that move only when a score passes one by more than HEADROOM: a barrier's OR
each block says whether any did, and only then the maxima are taken (a thread's 2 keys of 8
columns, shuffles across the 8 lanes sharing its columns, the four warps' through shared
memory) and O^T rescaled; a second barrier after P^T's stores. At the end the two warpgroups'
O^T, maxima and sums merge through the then idle stages into the seesaw's O layout, which the
forward epilogue stores.
"""

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .. import hopper_mma
from ..forward.facts import THREADS_PER_WARPGROUP, Piece
from ..forward.records import MmaSetup, TileResult
from ..kv_dequant import apply_v_descale, convert_block, fold_descales
from ..named_barriers import NamedBarrier
from ..softmax import LN2, max_or_zero
from ..tile_scheduler import WorkTile
from ..v_transpose import store_zeros_16
from .fp8_fragments import Q_PERMUTATION, STAGE_BYTES, FragmentLoads, box_offset, o_dim
from .loads import BOX, TILES
from .seesaw import D_LATENT, D_ROPE, KEYS

MAX_ROWS = 32  # query rows a tile serves at most (the WGMMAs' N: config.seesaw_rows)
D_QK = D_LATENT + D_ROPE
V_ATOMS = D_LATENT // BOX  # O^T's m-atoms
K_BOXES = TILES  # S^T's groups of four k-blocks (one box each)
STAGES = 2  # a warpgroup's ring
# A fragments converted ahead of the WGMMAs that read them, and groups whose bytes are loaded
# ahead of their conversion (H200, 16 and 32 heads: loads one group ahead 121-126 -> 102-104
# us, and non-causal variants spill-free; two ahead 103-114). Depths 3 and 4 do not fit in
# the registers: ptxas serializes the WGMMAs (C7514, at the slow path's O^T rescale), or
# without that rescale spills 224 bytes (depth 3). Their 1-33% slowdown was measured when O^T
# was rescaled every block: likely serialized then too (not checked).
DEPTH = 2
PREFETCH = 1
# How far (log2 units) a score may pass its column's reference max before the reference moves:
# P <= 2^8 in fp16 and the fp32 sums (FlashAttention-4's conditional rescale). H200, 16-32
# heads: 103-116 -> 97-108 us beside the maxima taken every block.
HEADROOM = 8.0
MERGE_STRIDE = D_LATENT + 8  # fp32 per row of a warpgroup's O in the merge (bank spread)


class GroupedGemm(NamedTuple):
    """A block's GEMM as commit groups of four k-blocks (Transposed._groups): how many, a
    group's e4m3 bytes from the stage (load(g)), those bytes into an A fragment's Int32 pairs
    (convert(raw, pairs)), and the group's WGMMAs on the fragment (issue(g, fragment))."""

    count: int
    load: Callable
    convert: Callable
    issue: Callable


class _Thread(NamedTuple):
    """A thread's place in the tile's MMA warpgroups: its warpgroup, warp (in it, uniform)
    and lane; it holds keys key0 + 8 r of a block (r < 2) in S^T's columns 2 q + ... (_column)."""

    wg: Int32
    warp: Int32
    lane: Int32
    key0: Int32
    q: Int32

    @staticmethod
    def of(wg: Int32, wg_thread: Int32) -> "_Thread":
        warp = cute.arch.make_warp_uniform(wg_thread // 32)
        lane = wg_thread % 32
        return _Thread(wg, warp, lane, 16 * warp + lane // 4, lane % 4)


class _MaskBounds(NamedTuple):
    """A thread's mask over a tile, from its first key in a block (key0): keys from key_end
    on are past the sequence's end, and the keys of the tile's token t (counted from the
    tile's first) from t + diagonal on are above its diagonal (both less n_block * KEYS;
    computed once a tile, so the loop holds two values, not the sequence's lengths)."""

    key_end: Int32
    diagonal: Int32

    @staticmethod
    def of(seqlen, thread: _Thread, first_token: Int32) -> "_MaskBounds":
        """first_token: the sequence's token in the tile's first row (tile_first_token)."""
        key_end = seqlen.seqlen_k - thread.key0
        return _MaskBounds(key_end, key_end - seqlen.seqlen_q + 1 + first_token)


class _Running(NamedTuple):
    """A warpgroup's running state over its blocks: O^T (V_ATOMS m-atoms of 64 dims x the
    rows, fp32), and per thread column its reference max and its sum of P."""

    acc_O: list
    col_max: cute.Tensor
    col_sum: cute.Tensor


class TransposedMmas(NamedTuple):
    """m64 n(rows) k16 with A from registers (S^T and O^T alike: named qk as the launch's
    MmaSetup takes it), and the seesaw's P V tiling, whose accumulator layout the merge leaves
    O in for the forward epilogue."""

    qk: cute.TiledMma
    pv: cute.TiledMma


@dataclass(frozen=True)
class TransposedBuffers:
    """The CTA's shared memory as the MMA warpgroups see it."""

    sQ: cute.Tensor  # (64, 576) fp16: its first rows are S^T's B (columns in Q_PERMUTATION order)
    sQ_loaded: cute.Tensor  # the same smem as Q lands (q's dtype)
    sPt: cute.Tensor  # (rows, 64, 2) fp16: each warpgroup's P^T (over Q's unused rows 32-63)
    stages: Int32  # smem address of the stages: warpgroup w's stage s at (2 w + s) * STAGE_BYTES
    merge: cute.Tensor  # (2, MAX_ROWS, MERGE_STRIDE) fp32 over the stages: each warpgroup's O
    exchange: cute.Tensor  # (2, 4, 32) fp32: (warpgroup, warp, column) maxima
    sums: cute.Tensor  # (2, 4, 32) fp32: (warpgroup, warp, column) sums at the end
    final: cute.Tensor  # (2, 2, 32) fp32: (warpgroup, max or sum, column)
    pipeline_q: pipeline.PipelineTmaAsync
    rings: tuple  # (warpgroup 0's, warpgroup 1's) PipelineTmaAsync


class Transposed(Piece):
    """One tile's mainloop on the two MMA warpgroups (`mma`)."""

    @property
    def rows(self) -> int:
        """The query rows a tile serves: the WGMMAs' N (16 or 32: plan.transposed_rows)."""
        return self.config.seesaw_rows

    @property
    def cols(self) -> int:
        """The S^T / O^T columns a thread holds: 2q + (j % 2) + 8 (j // 2), j < cols."""
        return self.rows // 4

    @cute.jit
    def mma(
        self,
        mmas: TransposedMmas,
        buf: TransposedBuffers,
        setup: MmaSetup,
        tile: WorkTile,
        shapes,
        q_state: pipeline.PipelineState,
    ) -> TileResult:
        """The tile's key blocks; returns O (normalized, the seesaw's pv layout: this
        warpgroup's 256 columns of 64 rows, rows past self.rows zero) and the LSE per row."""
        seqlen, block_range, n_block_min, n_block_max = self.tile_problem(tile, shapes)
        scale_log2, v_descale = fold_descales(shapes, tile, setup.softmax_scale_log2)
        wg = setup.warpgroup_idx
        wg_thread = setup.tidx % THREADS_PER_WARPGROUP
        thread = _Thread.of(wg, wg_thread)
        thr = mmas.qk.get_slice(wg_thread)
        sQ_rows = cute.local_tile(buf.sQ, (self.rows, D_QK), (0, 0))
        tSrQ = thr.make_fragment_B(thr.partition_B(sQ_rows))
        tOrPt = thr.make_fragment_B(thr.partition_B(buf.sPt[None, None, wg]))
        frags = [thr.make_fragment_A(thr.partition_shape_A((64, 64))) for _ in range(DEPTH)]
        acc_O = [
            cute.make_rmem_tensor(thr.partition_shape_C((64, self.rows)), Float32)
            for _ in range(V_ATOMS)
        ]
        for a in cutlass.range_constexpr(V_ATOMS):
            acc_O[a].fill(0.0)
        running = _Running(
            acc_O,
            cute.make_rmem_tensor(self.cols, Float32),
            cute.make_rmem_tensor(self.cols, Float32),
        )
        running.col_max.fill(-Float32.inf)
        running.col_sum.fill(0.0)
        loads = FragmentLoads(thread.lane, thread.warp)
        # V's first PREFETCH atoms' bytes, loaded under the softmax.
        v_first = cute.make_rmem_tensor(8 * max(PREFETCH, 1), Int32)
        mask_from = n_block_max - 1
        if const_expr(self.variant.causal):
            mask_from = cutlass.min(mask_from, block_range.first_causal_masked_block(tile.m_block))
        tail_keys = seqlen.seqlen_k - (n_block_max - 1) * KEYS
        bounds = _MaskBounds.of(seqlen, thread, self.tile_first_token(tile))
        if n_block_max > n_block_min:
            buf.pipeline_q.consumer_wait(q_state)
            self._prepare_q(buf, setup.tidx)
            count = n_block_max - n_block_min
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            ring = buf.rings[0]
            if wg == 1:
                ring = buf.rings[1]
            for i in cutlass.range((count - wg + 1) // 2, unroll=1):
                n_block = n_block_max - 1 - wg - 2 * i
                ring.consumer_wait(state)
                stage = buf.stages + (STAGES * wg + state.index) * STAGE_BYTES
                if n_block == n_block_max - 1 and tail_keys < KEYS:
                    self._zero_v_tail(stage, tail_keys, wg_thread, wg)
                acc_S = self._scores(mmas.qk, loads, stage, frags, tSrQ, thr, v_first)
                if n_block >= mask_from:
                    self._mask(acc_S, thread, n_block, bounds)
                self._softmax(buf, acc_S, running, scale_log2, thread)
                self._pv(mmas.qk, loads, stage, frags, tOrPt, acc_O, v_first)
                ring.consumer_release(state)
                state.advance()
            buf.pipeline_q.consumer_release(q_state)
        return self._merge(mmas, buf, setup, seqlen, running, scale_log2, v_descale, thread)

    # ------------------------------------------------------------------------------------
    # Steps of a block
    # ------------------------------------------------------------------------------------

    @cute.jit
    def _prepare_q(self, buf, tidx: Int32):
        """Q's first self.rows rows in fp16 (saturated from bf16), each 16 columns in
        Q_PERMUTATION's order (S^T's k-blocks as the K fragment holds them), in place; both
        warpgroups."""
        rows = cute.local_tile(buf.sQ_loaded, (self.rows, D_QK), (0, 0))
        dst = cute.local_tile(buf.sQ, (self.rows, D_QK), (0, 0))
        convert_block(
            rows, dst, tidx, self.num_mma_threads, self.rows, saturate=self.converts_q,
            permutation=Q_PERMUTATION,
        )  # fmt: skip
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.Q_CONVERT), number_of_threads=self.num_mma_threads
        )

    @cute.jit
    def _zero_v_tail(self, stage: Int32, tail_keys: Int32, wg_thread: Int32, wg: Int32):
        """The last block's V bytes past the sequence's end to zero (its P is 0 there, but
        they hold whatever follows: 0 * NaN would reach O); rows of a box are 64 bytes, four
        16-byte pieces a (key, box)."""
        pieces = (KEYS - tail_keys) * V_ATOMS * 4
        for p in cutlass.range(wg_thread, pieces, THREADS_PER_WARPGROUP, unroll=1):
            key = tail_keys + p // (V_ATOMS * 4)
            rest = p % (V_ATOMS * 4)
            store_zeros_16(stage + box_offset(key, 64 * (rest // 4), rest % 4))
        # (generic-proxy stores into a TMA stage: ordered before its refill's TMA writes)
        cute.arch.fence_view_async_shared()
        self._wg_sync(wg)

    @cute.jit
    def _scores(self, tiled_mma, loads, stage, frags, tSrQ, thr, v_first):
        """S^T = K Q^T, a box (four k-blocks) a group (_groups); V's first atoms' bytes loaded
        into v_first before the last group is waited for; returns once all are done."""
        acc_S = cute.make_rmem_tensor(thr.partition_shape_C((KEYS, self.rows)), Float32)
        atom = cute.make_mma_atom(tiled_mma.op)

        def issue(box, frag):
            for k in cutlass.range_constexpr(4):
                atom.set(warpgroup.Field.ACCUMULATE, box > 0 or k > 0)
                cute.gemm(atom, acc_S, frag[None, None, k], tSrQ[None, None, 4 * box + k], acc_S)

        gemm = GroupedGemm(K_BOXES, functools.partial(loads.load_k, stage), loads.convert_k, issue)
        self._groups(gemm, frags, [gemm.load(box) for box in range(PREFETCH)])
        for a in cutlass.range_constexpr(PREFETCH):
            raw = loads.load_v(stage, a)
            for i in cutlass.range_constexpr(8):
                v_first[8 * a + i] = raw[i]
        warpgroup.wait_group(0)
        return acc_S

    @cute.jit
    def _pv(self, tiled_mma, loads, stage, frags, tOrPt, acc_O, v_first):
        """O^T += V^T P^T, an m-atom a group (_groups; v_first: the first atoms' bytes, loaded
        before the softmax); returns once all are done (the stage is then free)."""
        ahead = [[v_first[8 * a + i] for i in range(8)] for a in range(PREFETCH)]
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)

        def issue(a, frag):
            for k in cutlass.range_constexpr(4):
                cute.gemm(atom, acc_O[a], frag[None, None, k], tOrPt[None, None, k], acc_O[a])

        gemm = GroupedGemm(V_ATOMS, functools.partial(loads.load_v, stage), loads.convert_v, issue)
        self._groups(gemm, frags, ahead)
        warpgroup.wait_group(0)

    def _groups(self, gemm: "GroupedGemm", frags, ahead: list):
        """gemm's commit groups: group g's bytes loaded PREFETCH groups ahead (ahead: groups
        0 .. PREFETCH - 1's, already loaded), converted into fragment buffer g % DEPTH while
        the previous group's WGMMAs run, then issued; the last DEPTH - 1 groups are left in
        flight."""
        for g in range(gemm.count):  # (a plain Python loop: not a jit function)
            if g + PREFETCH < gemm.count:
                ahead.append(gemm.load(g + PREFETCH))
            raw = ahead.pop(0) if PREFETCH > 0 else gemm.load(g)
            frag = frags[g % DEPTH]
            gemm.convert(raw, cute.recast_tensor(frag, Int32))
            warpgroup.fence()
            gemm.issue(g, frag)
            warpgroup.commit_group()
            warpgroup.wait_group(DEPTH - 1)  # (the next group's fragment buffer is free)

    @cute.jit
    def _mask(self, acc_S, thread: _Thread, n_block: Int32, bounds: "_MaskBounds"):
        """Keys past the sequence's end and, causal, above a row's diagonal (row r holds the
        tile's token r // rows_per_token, bounds.diagonal counting from its first) to -inf."""
        limit = bounds.key_end - n_block * KEYS  # (against the key's offset 8 r)
        for j in cutlass.range_constexpr(self.cols):
            col_limit = limit
            if const_expr(self.variant.causal):
                token = _column(thread.q, j) // self.variant.pack_gqa_ratio
                col_limit = cutlass.min(limit, token + bounds.diagonal - n_block * KEYS)
            for r in cutlass.range_constexpr(2):
                v = _value(r, j)
                acc_S[v] = -Float32.inf if 8 * r >= col_limit else acc_S[v]

    @cute.jit
    def _softmax(self, buf, acc_S, running: _Running, scale_log2, thread: _Thread):
        """S^T's columns to probabilities, stored as P^T (fp16) into sPt[wg]; the
        columns' sums and, where their maxima move, O^T rescaled. The maxima are references,
        not the true maxima: P is taken against them until a score passes one by more than
        HEADROOM (log2 units, so P <= 2^HEADROOM), which on a warm column is rare. Each block
        a barrier's OR (did any thread see such a score) decides: where none did, no maxima
        are exchanged and O^T is not rescaled."""
        # The thread's largest score less its column's reference (a tree: a chain of 16 fmax
        # would sit on the warpgroup's path to its P V).
        excess = _max_tree(
            [
                cute.arch.fmax(acc_S[_value(0, j)], acc_S[_value(1, j)]) - running.col_max[j]
                for j in range(self.cols)
            ]
        )
        if self._wg_any(thread.wg, excess * scale_log2 > HEADROOM):
            self._new_maxima(buf, acc_S, running, scale_log2, thread)
        self._store_pt(buf, acc_S, running, scale_log2, thread)
        cute.arch.fence_view_async_shared()  # P^T's stores -> the WGMMAs' reads
        self._wg_sync(thread.wg)

    @cute.jit
    def _new_maxima(self, buf, acc_S, running: _Running, scale_log2, thread: _Thread):
        """The columns' maxima over this block too (lanes, then the four warps through
        exchange[wg]) into col_max, O^T's columns and their sums rescaled to them, a column at
        a time (no rescale factors held: the registers are O^T's). (One exchange slot: the
        previous block's reads of it are before its P^T barrier.)"""
        for j in cutlass.range_constexpr(self.cols):  # (stored a column at a time: registers)
            m = _over_column_lanes(cute.arch.fmax(acc_S[_value(0, j)], acc_S[_value(1, j)]), True)
            if thread.lane < 4:
                buf.exchange[thread.wg, thread.warp, _column(thread.lane, j)] = m
        self._wg_sync(thread.wg)
        col_max, col_sum, acc_O = running.col_max, running.col_sum, running.acc_O
        for j in cutlass.range_constexpr(self.cols):
            m = col_max[j]
            for w in cutlass.range_constexpr(4):
                m = cute.arch.fmax(m, buf.exchange[thread.wg, w, _column(thread.q, j)])
            scale = cute.math.exp2((col_max[j] - max_or_zero(m)) * scale_log2, fastmath=True)
            col_max[j] = m
            col_sum[j] = col_sum[j] * scale
            for a in cutlass.range_constexpr(V_ATOMS):
                for v in cutlass.range_constexpr(cute.size(acc_O[a])):
                    if const_expr(_column_index(v) == j):
                        acc_O[a][v] = acc_O[a][v] * scale

    @cute.jit
    def _store_pt(self, buf, acc_S, running: _Running, scale_log2, thread: _Thread):
        """P = exp2((S - the column's reference max) scale_log2) as P^T (fp16) into sPt[wg]
        (column r of S^T is P^T's row r); this thread's P added to its columns' sums."""
        sPt = buf.sPt[None, None, thread.wg]
        key0, q, col_sum = thread.key0, thread.q, running.col_sum
        for j in cutlass.range_constexpr(self.cols):
            m_scaled = max_or_zero(running.col_max[j]) * scale_log2
            total = Float32(0.0)
            for r in cutlass.range_constexpr(2):
                p = cute.math.exp2(acc_S[_value(r, j)] * scale_log2 - m_scaled, fastmath=True)
                sPt[_column(q, j), key0 + 8 * r] = sPt.element_type(p)
                total = total + p
            col_sum[j] = col_sum[j] + total

    def _wg_any(self, wg, pred) -> cutlass.Boolean:
        """A warpgroup sync whose result is whether pred held in any of its threads."""
        barrier_id = int(NamedBarrier.TRANSPOSED_WG_0) + wg
        return hopper_mma.barrier_any(barrier_id, THREADS_PER_WARPGROUP, pred)

    def _wg_sync(self, wg):
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.TRANSPOSED_WG_0) + wg,
            number_of_threads=THREADS_PER_WARPGROUP,
        )

    # ------------------------------------------------------------------------------------
    # The merge
    # ------------------------------------------------------------------------------------

    @cute.jit
    def _merge(
        self, mmas, buf, setup, seqlen, running: _Running, scale_log2, v_descale, thread: _Thread
    ):
        """The warpgroups' O^T, maxima and sums into one normalized O in the seesaw's pv
        layout (its 64 x 512 over both warpgroups, rows from self.rows zero) and the rows' LSE."""
        wg, warp, lane = thread.wg, thread.warp, thread.lane
        q, g = thread.q, lane // 4
        acc_O, col_max, col_sum = running
        mma_threads = self.num_mma_threads
        # The columns' sums over this warpgroup's keys: lanes, then warps.
        for j in cutlass.range_constexpr(self.cols):
            col_sum[j] = _over_column_lanes(col_sum[j], False)
        if lane < 4:
            for j in cutlass.range_constexpr(self.cols):
                buf.sums[wg, warp, _column(lane, j)] = col_sum[j]
        self._wg_sync(wg)
        for j in cutlass.range_constexpr(self.cols):
            s = Float32(0.0)
            for w in cutlass.range_constexpr(4):
                s = s + buf.sums[wg, w, _column(q, j)]
            col_sum[j] = s
        if warp == 0 and lane < 4:
            for j in cutlass.range_constexpr(self.cols):
                buf.final[wg, 0, _column(lane, j)] = col_max[j]
                buf.final[wg, 1, _column(lane, j)] = col_sum[j]
        # Both warpgroups are past their last block (the stages are free) and have published.
        cute.arch.barrier(barrier_id=int(NamedBarrier.SPLIT_SCORES), number_of_threads=mma_threads)
        factor = cute.make_rmem_tensor(self.cols, Float32)
        for j in cutlass.range_constexpr(self.cols):
            col = _column(q, j)
            m_other = buf.final[1 - wg, 0, col]
            l_other = buf.final[1 - wg, 1, col]
            m_safe = max_or_zero(cute.arch.fmax(col_max[j], m_other))
            mine = cute.math.exp2((col_max[j] - m_safe) * scale_log2, fastmath=True)
            other = cute.math.exp2((m_other - m_safe) * scale_log2, fastmath=True)
            total = col_sum[j] * mine + l_other * other
            factor[j] = Float32(0.0) if total == 0.0 else mine * cute.arch.rcp_approx(total)
        apply_v_descale(factor, v_descale)
        merge = buf.merge[wg, None, None]
        for a in cutlass.range_constexpr(V_ATOMS):
            for v in cutlass.range_constexpr(cute.size(acc_O[a])):
                row = _column(q, _column_index(v))
                dim = o_dim(a, warp, g, (v // 2) % 2)
                merge[row, dim] = acc_O[a][v] * factor[_column_index(v)]
        cute.arch.barrier(barrier_id=int(NamedBarrier.SPLIT_SCORES), number_of_threads=mma_threads)
        # O and the LSE in the seesaw's layout.
        thr_pv = mmas.pv.get_slice(setup.tidx)
        out = cute.make_rmem_tensor(thr_pv.partition_shape_C((64, D_LATENT)), Float32)
        out_coords = thr_pv.partition_C(cute.make_identity_tensor((64, D_LATENT)))
        for v in cutlass.range_constexpr(cute.size(out)):
            row, dim = out_coords[v]
            out[v] = Float32(0.0)
            if row < self.rows:
                out[v] = buf.merge[0, row, dim] + buf.merge[1, row, dim]
        rows = hopper_mma.acc_as_rows_cols(out_coords)
        num_rows = cute.size(rows, mode=[0])
        lse = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = rows[r, 0][0]
            lse[r] = -Float32.inf
            if row < self.rows:
                m0, m1 = buf.final[0, 0, row], buf.final[1, 0, row]
                m_safe = max_or_zero(cute.arch.fmax(m0, m1))
                total = buf.final[0, 1, row] * cute.math.exp2(
                    (m0 - m_safe) * scale_log2, fastmath=True
                ) + buf.final[1, 1, row] * cute.math.exp2((m1 - m_safe) * scale_log2, fastmath=True)
                if total > 0.0:
                    lse[r] = (m_safe * scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
        return TileResult(acc_O=out, lse=lse, seqlen=seqlen)


def _over_column_lanes(x: Float32, is_max: bool) -> Float32:
    """The max or sum of x over the 8 lanes that hold the same columns (lane % 4 equal)."""
    for offset in (4, 8, 16):
        other = cute.arch.shuffle_sync_bfly(x, offset=offset)
        x = cute.arch.fmax(x, other) if is_max else x + other
    return x


def _max_tree(values: list):
    """The largest of values (a power of two of them), as a tree of pairwise maxima."""
    assert len(values) & (len(values) - 1) == 0, len(values)
    if len(values) == 1:
        return values[0]
    return _max_tree([cute.arch.fmax(a, b) for a, b in zip(values[::2], values[1::2])])


def _value(r: int, j: int) -> int:
    """The flat index in a thread's S^T / O^T atom of its key row g + 8 r, column j."""
    return (j % 2) + 2 * r + 4 * (j // 2)


def _column_index(v: int) -> int:
    """The column j (0-7) of a thread's atom value v."""
    return (v % 2) + 2 * (v // 4)


def _column(q: Int32, j: int) -> Int32:
    """The tile row (S^T / O^T column) of a thread's column j (q: its lane % 4)."""
    return 2 * q + (j % 2) + 8 * (j // 2)
