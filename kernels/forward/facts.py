"""What a forward variant is on the device, derived once: `ForwardFacts`.

The plan step's ForwardVariant (flash_cute.plan) says what to compile; the facts say what
that means for the kernel's pieces (which dtype the GEMMs run in, how many warps load, whether
O goes through shared memory, which scheduler runs the tiles, ...). Every piece (the producer,
the mainloop, the epilogue, the kernel skeleton) reads them and none derives them again. The
helpers every piece shares (a tile's key range, a tile row's token and head) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..block_range import KeyBlockRange, LocalWindow
from ..kv_dequant import FP8_GATHER_WARPS
from ..paged_kv_gather import PRODUCER_THREADS
from ..rotary import Rotary
from ..seqlen_info import SeqlenInfo
from ..tile_scheduler import PersistentTileScheduler, SingleTileScheduler, TileSpace, WorkTile
from ..v_transpose import FP8_MATH_GATHER_WARPS
from .records import ProblemShapes

THREADS_PER_WARPGROUP = 128


@dataclass(frozen=True)
class ForwardFacts:
    """A variant's device-side facts: each derived once, from the variant alone, on first use
    (the pieces read them at trace time)."""

    variant: object  # flash_cute.plan.ForwardVariant

    @cached_property
    def config(self):
        """The variant's effective AttentionConfig."""
        return self.variant.config

    @cached_property
    def dtype(self) -> type:
        """O's, and q's unless fp8_math."""
        return {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[self.variant.dtype]

    @cached_property
    def fp8_math(self) -> bool:
        """FP8 q, K and V, and both GEMMs in e4m3 (kernels/v_transpose.py)."""
        return self.variant.q_dtype is not None

    @cached_property
    def q_dtype(self) -> type:
        return cutlass.Float8E4M3FN if self.fp8_math else self.dtype

    @cached_property
    def kv_fp8(self) -> bool:
        return self.variant.kv_dtype is not None

    @cached_property
    def kv_dtype(self) -> type:
        """The cache's."""
        return cutlass.Float8E4M3FN if self.kv_fp8 else self.dtype

    @cached_property
    def mma_dtype(self) -> type:
        """The GEMMs'. With fp8_math e4m3. Otherwise FP8 blocks are converted before each GEMM
        to fp16 (one conversion instruction per two values, where bf16 would take four): with
        an FP8 cache the GEMMs run in fp16, and a bf16 Q tile is converted to fp16 once it
        lands (converts_q)."""
        if self.fp8_math:
            return cutlass.Float8E4M3FN
        return cutlass.Float16 if self.kv_fp8 else self.dtype

    @cached_property
    def converts_q(self) -> bool:
        return self.mma_dtype is not self.q_dtype

    @cached_property
    def converts_kv(self) -> bool:
        """FP8 K and V blocks converted to fp16 by the producer's spare warps (with fp8_math
        K goes to the GEMMs as it lands, and V is transposed instead)."""
        return self.kv_fp8 and not self.fp8_math

    @cached_property
    def num_mma_warpgroups(self) -> int:
        return self.config.num_mma_warpgroups

    @cached_property
    def o_split(self) -> int:
        """Warpgroups sharing the tile's 64 rows, each with its part of O's columns (each
        computing the rows' scores itself, or with split_scores its half of each key block's);
        1: warpgroup w has rows 64w..64w+63."""
        return self.config.o_split

    @cached_property
    def split_scores(self) -> bool:
        return self.config.split_scores

    @cached_property
    def num_mma_threads(self) -> int:
        return THREADS_PER_WARPGROUP * self.num_mma_warpgroups

    @cached_property
    def num_threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + self.num_mma_warpgroups)

    @cached_property
    def window(self) -> LocalWindow:
        v = self.variant
        return LocalWindow(v.window_left, v.window_right, v.attention_chunk)

    @cached_property
    def clears_v_tail(self) -> bool:
        """Whether K/V rows past a sequence's end can be loaded (Mainloop._clear_v_tail; with
        an FP8 cache the forward kernel's converting warps write them as zeros instead; the
        latent decode kernel's do not, and it clears them itself: Seesaw._clear_v_tail)."""
        v = self.variant
        return not self.kv_fp8 and (
            v.kv_layout != "padded" or v.seqused_k or v.scalar_kv_length or v.leftpad_k
        )

    @cached_property
    def rotary(self) -> Rotary:
        """A fused append's rotation (rotary_dim 0: none)."""
        return Rotary(self.variant.rotary_dim, self.variant.rotary_interleaved)

    @cached_property
    def producer_writes_loads_first(self) -> bool:
        """A fused append's row writes load k and v before storing either (one round trip)
        where the loading warp's registers hold both: decode configs' producer registers (56)
        and rows of 128 + 128 dims; else v loads after k's stores (no spills)."""
        v = self.variant
        return self.config.producer_registers >= 56 and v.head_dim + v.head_dim_v <= 256

    @cached_property
    def overlaps_append(self) -> bool:
        """Launched as a programmatically dependent launch behind the append kernel, whose
        writes the producer waits for where it reads them (Producer.load): split launches
        only, the latency-bound decode steps (1 x 8k on an H100: 13.2 us a step rather than
        14.4); a launch of one tile per (batch, kv head), each of which holds new rows and
        waits anyway, ran slower that way (16 x 64k: 1391 us rather than 1382). A fused
        append has no append kernel to follow."""
        return self.variant.after_append and self.variant.split and not self.variant.fused_append

    @cached_property
    def persistent(self) -> bool:
        """A grid of at most max_ctas CTAs, each looping over tiles, so one tile's epilogue
        overlaps the next tile's Q and K/V loads (kernels/tile_scheduler.py)."""
        return self.config.scheduler != "single_tile"

    @cached_property
    def scheduler_cls(self) -> type:
        return PersistentTileScheduler if self.persistent else SingleTileScheduler

    @cached_property
    def tma_store_o(self) -> bool:
        """O through smem and one TMA store (which clips rows past seqlen_q), or straight from
        registers, row-predicated."""
        return not self.config.store_o_from_registers

    @cached_property
    def separate_o_smem(self) -> bool:
        """A TMA-stored O gets its own smem when it fits (the config's smem model), so the next
        Q can load during the epilogue; otherwise O reuses Q's tile and Q is freed once the O
        store has read it."""
        v = self.variant
        return self.config.separate_o_smem(v.head_dim, 2, v.head_dim_v, v.v_in_k)

    @cached_property
    def o_overwrites_q(self) -> bool:
        """A persistent kernel's O through Q's tile: the storing warp frees Q after the O
        store (otherwise the MMA warps free it after the mainloop)."""
        return self.persistent and self.tma_store_o and not self.separate_o_smem

    smem_align = 1024

    @cached_property
    def kv_gather(self) -> bool:
        """Paged K/V gathered with cp.async (pages no TMA box follows); one CTA per tile, so
        every producer warp walks the same tile."""
        return self.variant.gather_page_size is not None

    @cached_property
    def load_warps(self) -> int:
        """The producer warps that load K/V (0 .. load_warps - 1; warp 0 also loads Q): warp 0
        issuing TMA loads, the whole warpgroup gathering 16-bit rows straight into the WGMMAs'
        stages, or FP8_GATHER_WARPS gathering FP8 rows (FP8_MATH_GATHER_WARPS with
        fp8_math). With an FP8 cache the others convert its blocks (kernels/kv_dequant.py)
        or transpose V's (kernels/v_transpose.py)."""
        if not self.kv_gather:
            return 1
        if self.fp8_math:
            assert FP8_MATH_GATHER_WARPS < PRODUCER_THREADS // 32  # (one warp left to transpose)
            return FP8_MATH_GATHER_WARPS
        return FP8_GATHER_WARPS if self.kv_fp8 else PRODUCER_THREADS // 32

    @cached_property
    def gemm_reads_gathered_rows(self) -> bool:
        """The GEMMs read stages that cp.async fills (a 16-bit cache's K and V, FP8 math's
        K): each wait for one is followed by a proxy fence (cp.async writes through the
        generic proxy, the WGMMAs read through the async one)."""
        return self.kv_gather and not self.converts_kv

    @cached_property
    def convert_threads(self) -> int:
        return PRODUCER_THREADS - 32 * self.load_warps if self.kv_fp8 else 0

    # ------------------------------------------------------------------------------------
    # What every piece asks of a tile
    # ------------------------------------------------------------------------------------

    def tile_space(
        self,
        mQ_shape: cute.Tensor,
        mK_shape: cute.Tensor,
        mCuSeqlensQ,
        mPageTable,
        num_splits: Int32,
        max_ctas: Int32,
    ) -> TileSpace:
        """The launch's work tiles (q and k in kernel mode order, for their run-time shapes)."""
        v = self.variant
        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(v.varlen_q) else mQ_shape.shape[3]
        return TileSpace(
            tile_m=self.config.tile_rows,
            rows_per_token=v.pack_gqa_ratio,
            causal=v.causal,
            varlen=v.varlen_q,
            split=v.split,
            kv_bytes_per_key=(v.head_dim + v.head_dim_v) * self.kv_dtype.width // 8,
            l2_section_mb=self.config.l2_section_mb,
            seqlen_q=mQ_shape.shape[0],
            nheads=mQ_shape.shape[2],
            nheads_kv=mK_shape.shape[2],
            batch=batch,
            num_splits=num_splits,
            kv_capacity=self.kv_capacity(mK_shape, mPageTable),
            max_ctas=max_ctas,
            cu_seqlens_q=mCuSeqlensQ,
        )

    def kv_capacity(self, mK_shape: cute.Tensor, mPageTable: Optional[cute.Tensor]):
        """Keys a (batch, head) can hold: k's rows, or a paged cache's pages x page size (packed
        k: the total, split by cu_seqlens_k per tile)."""
        if const_expr(self.variant.kv_layout == "paged"):
            return mK_shape.shape[0] * mPageTable.shape[1]
        return mK_shape.shape[0]

    @cute.jit
    def tile_problem(self, tile: WorkTile, shapes: ProblemShapes):
        """(seqlen info, key block range, n_block_min, n_block_max) of a tile."""
        seqlen = SeqlenInfo.create(
            tile.batch_idx,
            shapes.q.shape[0],
            self.kv_capacity(shapes.k, shapes.page_table),
            shapes.cu_seqlens_q,
            shapes.cu_seqlens_k,
            shapes.seqused_k,
            shapes.kv_length if const_expr(self.variant.scalar_kv_length) else None,
            shapes.seqused_q,
            shapes.leftpad_k,
            shapes.kv_length if const_expr(self.variant.after_append) else None,
        )
        block_range = KeyBlockRange(
            self.config.tile_rows,
            self.config.tile_n,
            self.variant.causal,
            self.variant.pack_gqa_ratio,
            seqlen.seqlen_q,
            seqlen.seqlen_k,
            self.window,
        )
        n_block_min, n_block_max = block_range.bounds(
            tile.m_block,
            tile.split_idx if const_expr(self.variant.split) else None,
            shapes.num_splits if const_expr(self.variant.split) else None,
        )
        return seqlen, block_range, n_block_min, n_block_max

    @cute.jit
    def row_of_tile(self, local_row: Int32, tile: WorkTile):
        """(token index within the batch's sequence, q head) of a tile row. Rows of the 64-row
        layouts past config.tile_rows map into the next tile's tokens: callers bound stores by
        tile_token_end."""
        row = tile.m_block * self.config.tile_rows + local_row
        if const_expr(self.variant.pack_gqa_ratio > 1):
            token = row // self.variant.pack_gqa_ratio
            return token, tile.head_idx * self.variant.pack_gqa_ratio + (
                row - token * self.variant.pack_gqa_ratio
            )
        return row, tile.head_idx

    def tile_query_rows(self, tile: WorkTile, seqlen) -> Int32:
        """The rows of a tile that hold a query (a prefix of its config.tile_rows)."""
        rows = seqlen.seqlen_q * self.variant.pack_gqa_ratio - tile.m_block * self.config.tile_rows
        return cutlass.max(cutlass.min(rows, self.config.tile_rows), 0)

    def tile_first_token(self, tile: WorkTile, m_block_offset: int = 0) -> Int32:
        """The sequence's token in a tile's first row (tiles of config.tile_rows rows, whole
        tokens each); m_block_offset 1: the next tile's."""
        return (tile.m_block + m_block_offset) * (
            self.config.tile_rows // self.variant.pack_gqa_ratio
        )

    def tile_token_end(self, tile: WorkTile, seqlen) -> Int32:
        """The token from which a tile's rows of the 64-row layouts hold nothing: the
        sequence's end, and where a tile serves fewer rows than its layouts (config.tile_rows,
        the transposed latent kernel), the next tile's first token."""
        end = seqlen.seqlen_q
        if const_expr(self.config.tile_rows < self.config.tile_m):
            end = cutlass.min(end, self.tile_first_token(tile, 1))
        return end

    def stmatrix_atom(self):
        """The copy atom of 16-bit accumulator fragments to shared memory (P, O)."""
        return cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )


class Piece:
    """The kernel or a part of it (the producer, the mainloop, the epilogue): it holds the
    variant's facts and reads them as its own attributes (self.config, self.variant, ...)."""

    def __init__(self, facts: ForwardFacts):
        self.facts = facts

    def __getattr__(self, name):  # (only names the piece does not have itself)
        return getattr(self.__dict__["facts"], name)
