"""TMA tile loads into a multi-stage smem ring guarded by a PipelineTmaAsync."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync


@dataclass(frozen=True)
class TmaBlockLoader:
    """Copies block n of a gmem tensor tiled along its blocks mode into one ring stage."""

    atom: cute.CopyAtom
    src_blocks: cute.Tensor  # (TMA, num_blocks)
    dst_stages: cute.Tensor  # (TMA, num_stages)
    ring: pipeline.PipelineAsync

    @staticmethod
    def create(atom, gmem_blocks: cute.Tensor, smem_stages: cute.Tensor, ring) -> "TmaBlockLoader":
        """gmem_blocks: (rows, cols, num_blocks); smem_stages: (rows, cols, num_stages)."""
        dst, src = cpasync.tma_partition(
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(smem_stages, 0, 2),
            cute.group_modes(gmem_blocks, 0, 2),
        )
        return TmaBlockLoader(atom, src, dst, ring)

    def load(self, n_block: Int32, state: pipeline.PipelineState):
        """Wait for the stage to be free, then issue the copy; it completes on the stage's
        full barrier (the pipeline's tx_count is the bytes of one block)."""
        self.ring.producer_acquire(state)
        self.copy(n_block, state)

    def commit(self, state: pipeline.PipelineState):
        """(A TMA copy arrives on the stage's barrier by itself.)"""

    def copy(self, n_block: Int32, state: pipeline.PipelineState):
        cute.copy(
            self.atom,
            self.src_blocks[None, n_block],
            self.dst_stages[None, state.index],
            tma_bar_ptr=self.ring.producer_get_barrier(state),
        )


@cute.jit
def page_of_key(page_table_row: cute.Tensor, key: Int32, page_size: Int32, num_pages: Int32):
    """The page holding a sequence's key, from its row of the page table: positions past the
    table's width (only in a last block's masked tail) reuse its last entry, and entries are
    clamped to the pages there are (a stray one reads a real page)."""
    last_entry = cute.size(page_table_row) - 1
    page = page_table_row[cutlass.min(key // page_size, last_entry)]
    return cutlass.max(cutlass.min(page, num_pages - 1), 0)


@dataclass(frozen=True)
class TmaPagedBlockLoader:
    """Copies key block n of a paged cache into one ring stage as tile_n / box_rows TMA boxes.

    box_rows divides both the page size and tile_n, so no box straddles a page; each box's
    page comes from this batch's row of the page table. Positions past the table's width
    (only in the masked tail of the last block) reuse its last entry, and entries are clamped
    to the pages there are (a stray one reads a real page, as the gather loader's do).
    """

    atom: cute.CopyAtom
    src_boxes: cute.Tensor  # (TMA, boxes_per_page, 1, num_pages)
    dst_boxes: cute.Tensor  # (TMA, boxes_per_stage, 1, num_stages)
    ring: pipeline.PipelineAsync
    page_table_row: cute.Tensor  # (max_pages_per_seq,) int32
    page_size: Int32
    tile_n: int
    box_rows: int

    @staticmethod
    def create(
        atom,
        gmem_pages: cute.Tensor,
        smem_stages: cute.Tensor,
        ring,
        page_table_row,
        tile_n: int,
        box_rows: int,
    ) -> "TmaPagedBlockLoader":
        """gmem_pages: (page_size, cols, num_pages); smem_stages: (tile_n, cols, num_stages)."""
        cols = cute.size(smem_stages, mode=[1])
        dst, src = cpasync.tma_partition(
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(cute.flat_divide(smem_stages, (box_rows, cols)), 0, 2),
            cute.group_modes(cute.flat_divide(gmem_pages, (box_rows, cols)), 0, 2),
        )
        return TmaPagedBlockLoader(
            atom, src, dst, ring, page_table_row, gmem_pages.shape[0], tile_n, box_rows
        )

    def load(self, n_block: Int32, state: pipeline.PipelineState):
        self.ring.producer_acquire(state)
        self.copy(n_block, state)

    def commit(self, state: pipeline.PipelineState):
        """(A TMA copy arrives on the stage's barrier by itself.)"""

    @cute.jit
    def copy(self, n_block: Int32, state: pipeline.PipelineState):
        num_pages = cute.size(self.src_boxes, mode=[3])
        for j in cutlass.range_constexpr(self.tile_n // self.box_rows):
            key = n_block * self.tile_n + j * self.box_rows
            page = page_of_key(self.page_table_row, key, self.page_size, num_pages)
            box_in_page = (key % self.page_size) // self.box_rows
            cute.copy(
                self.atom,
                self.src_boxes[None, box_in_page, 0, page],
                self.dst_boxes[None, j, 0, state.index],
                tma_bar_ptr=self.ring.producer_get_barrier(state),
            )


@dataclass(frozen=True)
class PairedBlockLoader:
    """Fills each stage from two tensors, side by side in its columns (FlashAttention-3's qv
    form of absorbed MLA: a K stage is v_cache's columns, then k_cache's), under one acquire
    and one barrier; the loaders are any two of this module's or the gather loader."""

    first: object
    second: object

    def load(self, n_block: Int32, state: pipeline.PipelineState):
        self.first.ring.producer_acquire(state)
        self.first.copy(n_block, state)
        self.second.copy(n_block, state)
        self.first.commit(state)
