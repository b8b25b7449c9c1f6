"""The producer warpgroup's side of the forward kernel: for each tile, Q's tile and the K and
V key blocks into their shared-memory rings, by TMA boxes (whole blocks, or page by page),
rows gathered with cp.async (pages no TMA box follows), or FP8 blocks that spare warps
convert to fp16 (kernels/kv_dequant.py); with qv (FlashAttention-3's absorbed MLA) Q's and K's
stages are filled from two tensors each, side by side.
"""

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import hopper_mma
from ..kv_dequant import ConvertingBlockLoader
from ..paged_kv_gather import GatherPagedBlockLoader
from ..tile_scheduler import WorkTile
from ..tma_loads import PairedBlockLoader, TmaBlockLoader, TmaPagedBlockLoader
from ..v_transpose import SkippedBlockLoader, TransposingBlockLoader
from .facts import Piece
from .records import CtaBuffers, GmemLoads, ProblemShapes, QLoad, TmaAtoms


class Producer(Piece):
    """The loads of one tile (`load`, by the loading warps) and, with an FP8 cache, its
    conversion (`convert_tile`, by the others)."""

    @cute.jit
    def load(
        self,
        loads: GmemLoads,
        atoms: TmaAtoms,
        buf: CtaBuffers,
        tile: WorkTile,
        shapes: ProblemShapes,
        q_state: pipeline.PipelineState,
        kv_state: pipeline.PipelineState,
    ):
        """Producer warp, one tile: Q once, then K and V blocks from the last to the first;
        returns the K/V ring state after them.

        With intra-warpgroup overlap the consumer needs K(n) one step before V(n), so V runs
        one block behind K: K(n_max-1), Q, [K(n-1), V(n)]..., V(n_min).
        An empty tile (no rows, no keys, or an empty split) loads no K/V, and Q only in a
        persistent kernel (whose consumers wait for Q on every tile).
        Behind an append, as a programmatically dependent launch (overlaps_append), Q waits
        for the append kernel's writes (it rotates q), and so does K(n_max-1) where the tile
        holds appended rows; the other blocks stream meanwhile. A fused append loads Q first,
        then K(n_max-1) (whose appended rows the MMA warps patch in its stage:
        Mainloop._patch_k_tail), then writes the tile's appended rows to the cache
        (_write_appended), which the later blocks (V(n_max-1) among them) read.
        """
        seqlen, _, n_block_min, n_block_max = self.tile_problem(tile, shapes)
        d, dv = self.variant.head_dim, self.variant.head_dim_v
        # The cache row of this batch (cache_batch_idx picks it; the lengths stay per batch).
        kv_batch = tile.batch_idx
        if const_expr(shapes.kv_batch_idx is not None):  # clamped: a bad index reads a real row
            rows = (
                shapes.page_table.shape[0]
                if const_expr(self.variant.kv_layout == "paged")
                else shapes.k.shape[3]
            )
            kv_batch = cutlass.max(cutlass.min(shapes.kv_batch_idx[tile.batch_idx], rows - 1), 0)
        # (mX, sX, ring, atom, width) -> this tile's loader of those key blocks
        block_loader = functools.partial(
            self._block_loader, tile=tile, kv_batch=kv_batch, seqlen=seqlen,
            mPageTable=shapes.page_table,
        )  # fmt: skip
        if const_expr(self.variant.qv):  # K's stage: v's columns 0..dv, then k's
            k_loader = PairedBlockLoader(
                block_loader(loads.v, buf.sV, buf.pipeline_k, atoms.v, dv),
                block_loader(
                    loads.k, hopper_mma.column_slice(buf.sK, dv, d - dv), buf.pipeline_k,
                    atoms.k, d - dv,
                ),
            )  # fmt: skip
        else:
            sK_ring, k_ring = buf.sK, buf.pipeline_k
            if const_expr(self.converts_kv):  # (the converting warps fill buf.sK from these)
                sK_ring, k_ring = buf.sK8, buf.pipeline_k8
            k_loader = block_loader(loads.k, sK_ring, k_ring, atoms.k, d)
        v_loader = None  # (v_in_k: V is in K's stages)
        if const_expr(not self.variant.v_in_k):
            sV_ring, v_ring = buf.sV, buf.pipeline_v
            if const_expr(self.kv_fp8):
                sV_ring, v_ring = buf.sV8, buf.pipeline_v8
            v_loader = block_loader(loads.v, sV_ring, v_ring, atoms.v, dv)
        q_load = QLoad(
            copies=self.q_copies(loads, atoms, buf.sQ, tile, seqlen),
            ring=buf.pipeline_q,
            state=q_state,
        )

        # (Every loading warp runs this; Q is warp 0's.)
        loads_q = True
        if const_expr(self.load_warps > 1):
            loads_q = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        if n_block_max > n_block_min:
            if const_expr(self.variant.fused_append):
                # Q first: it needs none of the writes (the MMA warps rotate it meanwhile).
                if loads_q:
                    self.load_q(q_load)
            if const_expr(self.overlaps_append):
                # (the rows appended to the sequence start at seqlen_k - kv_length)
                if n_block_max * self.config.tile_n > seqlen.seqlen_k - shapes.kv_length:
                    cute.arch.griddepcontrol_wait()
            k_loader.load(n_block_max - 1, kv_state)
            if const_expr(self.variant.fused_append):
                # (K(n_max-1) reads the rows as they were: the MMA warps patch its stage)
                self._write_appended(shapes, tile, n_block_min, n_block_max)
            if const_expr(self.overlaps_append):
                cute.arch.griddepcontrol_wait()  # (the append rotates q)
            if const_expr(not self.variant.fused_append):
                if loads_q:
                    self.load_q(q_load)
            if const_expr(self.variant.v_in_k):  # V is in K's stages: K blocks only
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    kv_state.advance()
                    k_loader.load(n_block_max - 2 - i, kv_state)
                kv_state.advance()
            else:
                kv_state = self._load_kv_blocks(
                    k_loader, v_loader, kv_state, n_block_min, n_block_max
                )
        else:
            if const_expr(self.persistent):
                if const_expr(self.overlaps_append):
                    cute.arch.griddepcontrol_wait()
                self.load_q(q_load)
        return kv_state

    @cute.jit
    def _write_appended(self, shapes: ProblemShapes, tile: WorkTile, n_block_min, n_block_max):
        """Fused append (each loading warp): the appended rows of this tile's kv head that lie
        in its key blocks, k rotated, into the cache (through the page table; slots past its
        capacity or on a page out of range are not written), then made visible to this warp's
        later loads (TMA's async proxy; loading warps that gather rows each write them all,
        so each one's reads follow its own writes). Every
        row an append writes lies in the key range of a tile that reads it (no left window):
        it writes them itself, so no tile waits for another; tiles of one kv head's rows (q
        heads not packed, several query tiles) write the same bytes."""
        lane = cute.arch.lane_idx()
        batch, head = tile.batch_idx, tile.head_kv_idx
        d, dv = self.variant.head_dim, self.variant.head_dim_v
        start = shapes.seqused_k[batch]  # (the rows before the append)
        tile_n = self.config.tile_n
        first = cutlass.max(n_block_min * tile_n - start, 0)
        capacity = self.kv_capacity(shapes.k, shapes.page_table)
        end = cutlass.min(n_block_max * tile_n, capacity) - start
        for r in cutlass.range(first, cutlass.min(end, shapes.kv_length), unroll=1):
            slot = start + r
            row, cache_row, ok = slot, batch, True  # (a padded cache: the batch's row)
            if const_expr(self.variant.kv_layout == "paged"):
                page_size = shapes.k.shape[0]
                page_index = slot // page_size
                row, cache_row = slot - page_index * page_size, shapes.page_table[batch, page_index]
                ok = (cache_row >= 0) & (cache_row < shapes.k.shape[3])  # (else not in the cache)
            if ok:
                self.rotary.write_kv_row(
                    shapes.append_k[batch, r, head, None], shapes.k[row, None, head, cache_row],
                    shapes.append_v[batch, r, head, None], shapes.v[row, None, head, cache_row],
                    shapes.append_cos, shapes.append_sin, slot, d, dv, lane,
                    self.producer_writes_loads_first,
                )  # fmt: skip
        cute.arch.fence_proxy("async.global")  # (generic-proxy stores -> this warp's TMA reads)
        cute.arch.sync_warp()

    @cute.jit
    def convert_tile(
        self,
        buf: CtaBuffers,
        tile: WorkTile,
        shapes: ProblemShapes,
        state: pipeline.PipelineState,
    ):
        """Converting warps, one tile: each FP8 K and V block the loading warps bring in, in
        their order, into the fp16 rings (kernels/kv_dequant.py); with fp8_math each V block
        transposed into V^T's ring (kernels/v_transpose.py), K's left in the loads' ring.
        state: the rings' producer state, walked as the loading warps walk theirs; returns it
        after the tile."""
        seqlen, _, n_block_min, n_block_max = self.tile_problem(tile, shapes)
        if n_block_max > n_block_min:
            thread = cute.arch.thread_idx()[0] - 32 * self.load_warps
            handoff = functools.partial(self._handoff, thread)
            if const_expr(self.fp8_math):
                k_loader = SkippedBlockLoader()
                v_loader = handoff(
                    TransposingBlockLoader, buf.sV8, buf.sV, buf.pipeline_v8, buf.pipeline_v,
                    seqlen_k=seqlen.seqlen_k, batch=self.config.transpose_batch,
                )  # fmt: skip
            else:
                k_loader = handoff(
                    ConvertingBlockLoader, buf.sK8, buf.sK, buf.pipeline_k8, buf.pipeline_k
                )
                v_loader = handoff(
                    ConvertingBlockLoader, buf.sV8, buf.sV, buf.pipeline_v8, buf.pipeline_v,
                    seqlen_k=seqlen.seqlen_k,
                )  # fmt: skip
            k_loader.load(n_block_max - 1, state)
            state = self._load_kv_blocks(k_loader, v_loader, state, n_block_min, n_block_max)
        return state

    def _handoff(self, thread, cls, src, dst, ring8, ring_out, seqlen_k=None, **fields):
        """A converting warp's loader of one ring's blocks (cls: converting or transposing,
        with its own fields)."""
        return cls(
            src, dst, ring8, ring_out, thread, self.convert_threads, self.config.tile_n,
            seqlen_k, **fields,
        )  # fmt: skip

    @cute.jit
    def _load_kv_blocks(
        self,
        k_loader,
        v_loader,
        kv_state: pipeline.PipelineState,
        n_block_min: Int32,
        n_block_max: Int32,
    ):
        """Everything after the first K block (already issued at kv_state)."""
        if const_expr(self.config.intra_wg_overlap):
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block_v = n_block_max - 1 - i
                v_state = kv_state.clone()
                kv_state.advance()
                k_loader.load(n_block_v - 1, kv_state)
                v_loader.load(n_block_v, v_state)
            v_loader.load(n_block_min, kv_state)
            kv_state.advance()
        else:
            v_loader.load(n_block_max - 1, kv_state)
            kv_state.advance()
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block = n_block_max - 2 - i
                k_loader.load(n_block, kv_state)
                v_loader.load(n_block, kv_state)
                kv_state.advance()
        return kv_state

    def _block_loader(self, mX, sX, ring, atom, width, tile, kv_batch, seqlen, mPageTable):
        """The loader of K or V key blocks (width: d or dv) for one tile: rows gathered with
        cp.async from pages, TMA boxes following pages, or TMA boxes of whole key blocks."""
        if const_expr(self.kv_gather):
            return GatherPagedBlockLoader.create(
                mX[None, None, tile.head_kv_idx, None],
                sX,
                ring,
                mPageTable[kv_batch, None],
                seqlen.offset_k,
                seqlen.seqlen_k,
                cute.arch.thread_idx()[0],
                self.variant.gather_page_size,
                self.config.tile_n,
                32 * self.load_warps,
                self.config.gather_lookahead,
            )
        if const_expr(self.variant.kv_layout == "paged"):
            return TmaPagedBlockLoader.create(
                atom,
                mX[None, None, tile.head_kv_idx, None],
                sX,
                ring,
                mPageTable[kv_batch, None],
                self.config.tile_n,
                self.variant.page_box_rows,
            )
        rows = self._rows_of(
            mX, tile.head_kv_idx, kv_batch, seqlen.offset_k, self.variant.leftpad_k
        )
        return TmaBlockLoader.create(
            atom, cute.local_tile(rows, (self.config.tile_n, width), (None, 0)), sX, ring
        )

    def q_copies(self, loads: GmemLoads, atoms: TmaAtoms, sQ: cute.Tensor, tile: WorkTile, seqlen):
        """The (atom, src, dst) TMA copies filling Q's tile sQ for one tile: q's, or with qv
        qv's dv columns and then q's d - dv."""
        d, dv = self.variant.head_dim, self.variant.head_dim_v
        q_head = tile.head_idx  # (packed GQA: the group of q heads in the packed view)
        q_parts = [(atoms.q, loads.q, sQ, d)]
        if const_expr(self.variant.qv):
            q_parts = [
                (atoms.qv, loads.qv, hopper_mma.column_slice(sQ, 0, dv), dv),
                (atoms.q, loads.q, hopper_mma.column_slice(sQ, dv, d - dv), d - dv),
            ]
        q_copies = []
        for atom, mX, sX, width in q_parts:
            rows = self._rows_of(mX, q_head, tile.batch_idx, seqlen.offset_q)
            m_block = tile.m_block
            if const_expr(self.config.tile_rows < self.config.tile_m):
                # A tile of tile_rows rows, loaded as the layouts' tile_m from its first (the
                # rows past it are read, not used).
                rows = _offset_rows(rows, self.tile_first_token(tile))
                m_block = 0
            gX = cute.local_tile(rows, (self.config.tile_m, width), (m_block, 0))
            dst, src = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
            )
            q_copies.append((atom, src, dst))
        return tuple(q_copies)

    def load_q(self, q_load: QLoad):
        q_load.ring.producer_acquire(q_load.state)
        for atom, src, dst in q_load.copies:  # (one barrier: its tx_count is Q's whole tile)
            cute.copy(atom, src, dst, tma_bar_ptr=q_load.ring.producer_get_barrier(q_load.state))

    def _rows_of(
        self, mX: cute.Tensor, head: Int32, batch: Int32, offset: Int32, padded_offset=False
    ) -> cute.Tensor:
        """The (rows, head_dim) slice of a q/k/v-like tensor in kernel mode order for one
        head and batch; packed (varlen) tensors are offset to the batch's first row, padded
        ones only with padded_offset (a left-padded cache row)."""
        if const_expr(cute.rank(mX) == 3):
            return _offset_rows(mX[None, None, head], offset)
        if const_expr(padded_offset):
            return cute.domain_offset((offset, 0), mX[None, None, head, batch])
        return mX[None, None, head, batch]


def _offset_rows(x: cute.Tensor, tokens: Int32) -> cute.Tensor:
    """A (rows, head_dim) view moved down `tokens` tokens (rows folded as (q head in group,
    token) under packed GQA: the token mode)."""
    row_offset = (0, tokens) if const_expr(cute.rank(x.shape[0]) == 2) else tokens
    return cute.domain_offset((row_offset, 0), x)
