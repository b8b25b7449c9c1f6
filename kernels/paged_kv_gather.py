"""Paged K/V loads row by row with cp.async, for pages TMA boxes cannot follow.

A TMA box covers whole rows of one page, so the TMA loader needs boxes of a multiple of 16
rows that divide both the page size and the key block (kernels/tma_loads.py). Page sizes of
1 (SGLang's default), 8 or 24, and caches whose rows start at a per-sequence offset
(cache_leftpad), take this loader instead: the gathering threads (the producer warpgroup's 128
with a 16-bit cache; with an FP8 cache its first FP8_GATHER_WARPS warps', as the others
convert the blocks, or with FP8 math its first FP8_MATH_GATHER_WARPS', as the last transposes
V's) each copy 16-byte pieces of the block's rows, looking up each row's page
in the page table, into the swizzled smem stage, and signal the stage's full barrier when
their copies land (cp.async.mbarrier.arrive.noinc, a PipelineCpAsync with that many producer
threads). Rows past the sequence's last key are not loaded: their page-table entries need not
be valid, and the consumer masks those keys (and zeroes their V rows).

The MMA warps read a 16-bit stage (and with FP8 math an FP8 K stage) with WGMMA (the async
proxy) after cp.async's generic-proxy writes: they fence after each wait
(kernels/forward/mainloop.py, Mainloop._wait_full). The other FP8 stages' readers are the
converting or transposing warps' generic loads.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

PRODUCER_THREADS = 128  # a 16-bit cache's gathering threads: the producer warpgroup
PIECE_BITS = 128  # one 16-byte cp.async


@dataclass(frozen=True)
class GatherPagedBlockLoader:
    """Copies key block n of a paged cache into one ring stage; every gathering thread calls
    load() with the same arguments."""

    gmem_pages: cute.Tensor  # (page_size, d, num_pages)
    smem_stages: cute.Tensor  # (tile_n, d, num_stages)
    ring: pipeline.PipelineAsync
    page_table_row: cute.Tensor  # (max_pages_per_seq,) int32
    num_pages: Int32
    first_key: Int32  # the sequence's first key slot (cache_leftpad)
    end_key: Int32  # one past its last key slot
    thread: Int32  # 0 .. num_threads - 1
    page_size: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    head_dim: cutlass.Constexpr[int]
    num_threads: cutlass.Constexpr[int]
    lookahead: cutlass.Constexpr[int]  # rows whose pages a thread reads before copying them

    @staticmethod
    def create(
        gmem_pages: cute.Tensor,
        smem_stages: cute.Tensor,
        ring,
        page_table_row,
        first_key: Int32,
        num_keys: Int32,
        thread: Int32,
        page_size: int,
        tile_n: int,
        num_threads: int = PRODUCER_THREADS,
        lookahead: int = 1,
    ) -> "GatherPagedBlockLoader":
        """gmem_pages: (page_size, d, num_pages) for one kv head; smem_stages: (tile_n, d,
        num_stages). Keys first_key .. first_key + num_keys - 1 of the sequence's slots."""
        return GatherPagedBlockLoader(
            gmem_pages,
            smem_stages,
            ring,
            page_table_row,
            gmem_pages.shape[2],
            first_key,
            first_key + num_keys,
            thread,
            page_size,
            tile_n,
            cute.size(smem_stages, mode=[1]),
            num_threads,
            lookahead,
        )

    def load(self, n_block: Int32, state: pipeline.PipelineState):
        """Wait for the stage to be free, copy the block's valid rows, and arrive on the stage's
        full barrier once this thread's copies have landed."""
        self.ring.producer_acquire(state)
        self.copy(n_block, state)
        self.commit(state)

    def commit(self, state: pipeline.PipelineState):
        self.ring.producer_commit(state)

    @cute.jit
    def copy(self, n_block: Int32, state: pipeline.PipelineState):
        """This thread's copies of the block's valid rows into the stage (no barrier)."""
        pieces_per_row = self.head_dim // self._piece()
        rows_per_pass = self.num_threads // pieces_per_row
        piece = self.thread % pieces_per_row
        row0 = self.thread // pieces_per_row
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
            self.gmem_pages.element_type,
            num_bits_per_copy=PIECE_BITS,
        )
        dst = self.smem_stages[None, None, state.index]
        block_key = self.first_key + n_block * self.tile_n
        if const_expr(pieces_per_row > 32 or rows_per_pass == 0):
            # Rows wider than 256 elements (absorbed MLA's 576): the threads walk the block's
            # (row, piece) pairs in order, a dynamic loop (one row per pass would unroll
            # tile_n copies per thread).
            count = self.tile_n * pieces_per_row
            for j in cutlass.range(cute.ceil_div(count, self.num_threads), unroll=2):
                index = self.thread + j * self.num_threads
                row = index // pieces_per_row
                if index < count:
                    self._copy_piece(atom, dst, block_key, row, index - row * pieces_per_row)
        elif row0 < rows_per_pass:  # (threads past a whole number of rows per pass idle)
            # Rows row0, row0 + rows_per_pass, ... unrolled. With a lookahead, the page-table
            # reads of `lookahead` rows first, then their copies (each copy's address waits on
            # its read: read just before it, each row waits out the read's latency).
            passes = cute.ceil_div(self.tile_n, rows_per_pass)
            for first in cutlass.range_constexpr(0, passes, self.lookahead):
                rows = [
                    row0 + i * rows_per_pass
                    for i in range(first, min(first + self.lookahead, passes))
                ]
                pages = [None] * len(rows)
                if const_expr(self.lookahead > 1):
                    pages = [self._page_of(block_key + row) for row in rows]
                for row, page in zip(rows, pages):
                    if const_expr(self.tile_n % rows_per_pass != 0):
                        if row < self.tile_n:
                            self._copy_row(atom, dst, block_key, row, piece, page)
                    else:
                        self._copy_row(atom, dst, block_key, row, piece, page)

    def _copy_row(self, atom, dst, block_key: Int32, row: Int32, piece: Int32, page):
        if const_expr(page is None):
            self._copy_piece(atom, dst, block_key, row, piece)
        else:
            self._copy_from_page(atom, dst, block_key, row, piece, page)

    def _piece(self) -> int:
        """Elements per 16-byte copy: 8 of a 16-bit cache, 16 of an FP8 one."""
        return PIECE_BITS // self.gmem_pages.element_type.width

    @cute.jit
    def _page_of(self, key: Int32) -> Int32:
        """The page holding key's slot (clamped to real pages), read from the table at the last
        key's entry for keys past the sequence (entries past it need not exist)."""
        return self._real_page(
            self.page_table_row[cutlass.min(key, self.end_key - 1) // self.page_size]
        )

    def _real_page(self, page: Int32) -> Int32:
        """A page-table entry clamped to the cache's pages (a stray entry reads a real page)."""
        return cutlass.max(cutlass.min(page, self.num_pages - 1), 0)

    @cute.jit
    def _copy_piece(self, atom, dst, block_key: Int32, row: Int32, piece: Int32):
        """One 16-byte copy, piece `piece` of block row `row`, if its key is the sequence's
        (a branch around the page-table read and the copy: fewest registers)."""
        key = block_key + row
        if key < self.end_key:
            page = self._real_page(self.page_table_row[key // self.page_size])
            cute.copy(atom, self._source(key, page, piece), self._piece_of(dst, row, piece))

    @cute.jit
    def _copy_from_page(self, atom, dst, block_key: Int32, row: Int32, piece: Int32, page: Int32):
        """_copy_piece with the row's page already read, predicated rather than branched (keys
        past the sequence copy nothing and zero their piece), so that the compiler overlaps
        the address math of successive copies."""
        key = block_key + row
        valid = cute.make_rmem_tensor(
            cute.make_layout(((self._piece(),), 1), stride=((0,), 0)), cutlass.Boolean
        )
        valid[0] = key < self.end_key
        cute.copy(atom, self._source(key, page, piece), self._piece_of(dst, row, piece), pred=valid)

    def _source(self, key: Int32, page: Int32, piece: Int32) -> cute.Tensor:
        src_row = self.gmem_pages[key % self.page_size, None, page]
        return cute.zipped_divide(src_row, (self._piece(),))[None, piece]

    def _piece_of(self, dst: cute.Tensor, row: Int32, piece: Int32) -> cute.Tensor:
        return cute.zipped_divide(dst[row, None], (self._piece(),))[None, piece]
