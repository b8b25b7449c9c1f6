"""The MMA warpgroups' last step of a tile: O and the LSE out, through shared memory and one
TMA store or straight from registers; a split tile's partials, and the merge of a tile's splits
by the last of them to finish (in the kernel, so a split launch needs no combine kernel unless
its partials are too large or too wide for one CTA: plan._combine_merges).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import hopper_mma
from ..named_barriers import NamedBarrier
from ..seqlen_info import SeqlenInfo
from ..split_merge import (
    EPILOGUE_CHUNK_FLOATS,
    lanes_per_row,
    merge_row,
    splits_per_chunk,
)
from ..tile_scheduler import WorkTile
from .facts import Piece
from .records import MmaSetup, ProblemShapes, TileResult


class Epilogue(Piece):
    """A tile's results out (`store`) and a split tile's merge (`merge_splits`)."""

    @cute.jit
    def store(
        self,
        result: TileResult,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        setup: MmaSetup,
        tile: WorkTile,
    ):
        """O and LSE out. Padded, unsplit (unless the config stores O from registers): O
        registers -> smem (its own tile, or over Q's) -> one TMA store (which clips rows past
        seqlen_q); each warpgroup writes only the 64 rows of sO whose sQ rows it alone read, so
        no barrier is needed before the smem writes. Otherwise: O straight from registers, one
        column pair per store, rows predicated.
        The LSE always goes from registers; the 4 threads of a quad share rows and the one
        holding column 0 writes. result.q_release: where O overwrites Q's tile, Q's ring and
        state, released once the store has read it."""
        acc_O, lse, seqlen, q_release = result.acc_O, result.lse, result.seqlen, result.q_release
        tma_atom_O, tiled_mma_pv, tidx = setup.tma_atom_O, setup.tiled_mma_pv, setup.tidx
        thr_mma = tiled_mma_pv.get_slice(tidx)
        coords = hopper_mma.acc_as_rows_cols(
            thr_mma.partition_C(
                cute.make_identity_tensor((self.config.tile_m, self.variant.head_dim_v))
            )
        )
        token_end = self.tile_token_end(tile, seqlen)
        if const_expr(mLSE is not None):
            if coords[0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    token, head = self.row_of_tile(coords[r, 0][0], tile)
                    if token < token_end:
                        mLSE[self._out_index(token, head, tile, seqlen)] = lse[r]

        if const_expr(self.tma_store_o):
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            hopper_mma.convert_to_16bit(acc_O, rO)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if const_expr(self.separate_o_smem):
                # sO is reused tile after tile: the previous tile's store must have read it.
                if warp_idx == 4:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(
                    barrier_id=int(NamedBarrier.O_SMEM_FREE), number_of_threads=self.num_mma_threads
                )
            smem_copy_O = cute.make_tiled_copy_C(self.stmatrix_atom(), tiled_mma_pv).get_slice(tidx)
            cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
            cute.arch.fence_view_async_shared()  # smem writes -> visible to the TMA (async proxy)
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads + 32
            )
            if warp_idx == 4:
                cute.arch.barrier(
                    barrier_id=int(NamedBarrier.EPILOGUE),
                    number_of_threads=self.num_mma_threads + 32,
                )
                gO = cute.local_tile(
                    mO[None, None, tile.head_idx, tile.batch_idx],
                    (self.config.tile_m, self.variant.head_dim_v),
                    (tile.m_block, 0),
                )
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_O,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sO, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_atom_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.separate_o_smem):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                if const_expr(q_release is not None):  # sO was Q's tile: the next Q may load
                    q_release.ring.consumer_release(q_release.state)
        else:
            out = acc_O
            if const_expr(mO.element_type != Float32):
                out = cute.make_rmem_tensor_like(acc_O, mO.element_type)
                hopper_mma.convert_to_16bit(acc_O, out)
            out_rc = hopper_mma.acc_as_rows_cols(out)
            pair = cute.make_rmem_tensor(2, mO.element_type)
            for r in cutlass.range_constexpr(cute.size(out_rc, mode=[0])):
                token, head = self.row_of_tile(coords[r, 0][0], tile)
                if token < token_end:
                    idx = self._out_index(token, head, tile, seqlen)
                    o_row = mO[(idx[0], None, *idx[1:])]
                    for c in cutlass.range_constexpr(0, cute.size(out_rc, mode=[1]), 2):
                        pair[0] = out_rc[r, c]
                        pair[1] = out_rc[r, c + 1]
                        cute.autovec_copy(
                            pair, cute.local_tile(o_row, (2,), (coords[r, c][1] // 2,))
                        )

    def _out_index(
        self,
        token: Int32,
        head: Int32,
        tile: WorkTile,
        seqlen: SeqlenInfo,
        with_split: bool = True,
    ):
        """Coordinates of (row, head[, batch][, split]) in out/lse (kernel mode order; the split
        in split kernels' partials), without the head_dim mode."""
        if const_expr(self.variant.varlen_q):
            idx = (seqlen.offset_q + token, head)
        else:
            idx = (token, head, tile.batch_idx)
        if const_expr(self.variant.split and with_split):
            idx = idx + (tile.split_idx,)
        return idx

    @cute.jit
    def merge_splits(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mOPartial: cute.Tensor,
        mLSEPartial: cute.Tensor,
        mArrivals: cute.Tensor,
        split_last: cute.Tensor,
        tile: WorkTile,
        shapes: ProblemShapes,
        tidx: Int32,
    ):
        """MMA warps of a split CTA, after its partials are stored: count this split in; the
        last of the tile's splits to arrive merges all of them into O and the LSE and resets
        the tile's counter (every split has arrived, so none touches it again this launch)."""
        num_splits = shapes.num_splits
        # The CTA's partial stores happen before the arrival: the barrier orders them before
        # thread 0's release (fence + atomic); its acquire orders the other splits' partials
        # before the merge's loads, which the second barrier passes on to every thread.
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.SPLIT_MERGE), number_of_threads=self.num_mma_threads
        )
        if tidx == 0:
            bidx, bidy, bidz = cute.arch.block_idx()
            grid_x, grid_y, _ = cute.arch.grid_dim()
            slot = (bidz * (grid_y // num_splits) + bidy // num_splits) * grid_x + bidx
            cute.arch.fence_acq_rel_gpu()
            arrived = cute.arch.atomic_add(
                (mArrivals.iterator + slot).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu"
            )
            is_last = arrived == num_splits - 1
            if is_last:
                mArrivals[slot] = Int32(0)
            split_last[0] = Int32(1) if is_last else Int32(0)
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.SPLIT_MERGE), number_of_threads=self.num_mma_threads
        )
        seqlen = SeqlenInfo.create(
            tile.batch_idx,
            shapes.q.shape[0],
            Int32(0),
            shapes.cu_seqlens_q,
            mSeqUsedQ=shapes.seqused_q,
        )
        token_end = self.tile_token_end(tile, seqlen)
        valid_rows = self.tile_query_rows(tile, seqlen)
        # (Uniform over the CTA: the counter's verdict, and whether the tile has rows at all.)
        if split_last[0] != 0 and valid_rows > 0:
            group = lanes_per_row(self.variant.head_dim_v)
            rows_per_pass = self.num_mma_threads // group
            sub = tidx % group
            acc = cute.make_rmem_tensor(self.variant.head_dim_v // group, Float32)
            out = cute.make_rmem_tensor(self.variant.head_dim_v // group, mO.element_type)
            for i in cutlass.range(cute.ceil_div(valid_rows, rows_per_pass), unroll=1):
                token, head = self.row_of_tile(i * rows_per_pass + tidx // group, tile)
                # (rows past the last token neither load nor store)
                if token < token_end:
                    idx = self._out_index(token, head, tile, seqlen, with_split=False)
                    o_splits = mOPartial[(idx[0], None, *idx[1:], None)]  # (d, S)
                    lse = merge_row(
                        mLSEPartial[(*idx, None)],
                        cute.make_tensor(
                            o_splits.iterator, cute.select(o_splits.layout, mode=[1, 0])
                        ),
                        sub,
                        acc,
                        splits_per_chunk(self.variant.head_dim_v // group, EPILOGUE_CHUNK_FLOATS),
                    )
                    hopper_mma.convert_to_16bit(acc, out)
                    dst = cute.local_tile(
                        mO[(idx[0], None, *idx[1:])], (self.variant.head_dim_v // group,), (sub,)
                    )
                    dst.store(out.load())
                    if const_expr(mLSE is not None):
                        if sub == 0:
                            mLSE[idx] = lse
