"""The latent decode kernel's key loads: a key block's 576 columns (V's 512, then the rope's 64)
as nine TMA boxes of 64 keys x 64 columns into one of two K buffers, each buffer in two halves
with a one-stage ring of its own, so a half is refilled as soon as its last reader is done
(kernels/mla_decode/seesaw.py says who reads what).

Halves: "left", columns 0-255 (the first half of V, warpgroup 0's O columns), and "right",
columns 256-575 (V's second half and the rope). The latent form reads all nine boxes from the
576-wide cache; FlashAttention-3's qv form reads boxes 0-7 from v_cache and box 8 from
k_cache (the rope, 64 wide).
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import hopper_mma
from ..tma_loads import page_of_key

BOX = 64  # keys and columns of one TMA box (a 128-byte swizzle row of 16-bit elements)
TILES = 9  # boxes across a block's 576 columns
LEFT_TILES = 4  # boxes 0-3: the left half
# (first box, end box) of each half, by half index (0: left, 1: right).
HALVES = ((0, LEFT_TILES), (LEFT_TILES, TILES))
LEFT, RIGHT = 0, 1
# L2 eviction hint of the key loads: evict first (streamed once; FlashMLA's choice). H100,
# same processes as FlashAttention-3: 2-3% faster than no hint, evict-last no faster.
EVICT_FIRST = 0x12F0000000000000


def half_bytes(half: int, element_bytes: int) -> int:
    """Bytes TMA brings into one half of a buffer (its ring's transaction count; an FP8
    cache's: element_bytes 1)."""
    return half_boxes(half) * BOX * BOX * element_bytes


def half_boxes(half: int) -> int:
    first, end = HALVES[half]
    return end - first


def half_start(buffer: int, half: int) -> int:
    """Bytes from the K buffers' first byte to the half's (16-bit boxes of 8 KB, each buffer
    TILES of them)."""
    return (buffer * TILES + HALVES[half][0]) * BOX * BOX * 2


def staged_offset(half: int, box: int) -> int:
    """An FP8 cache (kernels/mla_decode/fp8_loads.py): bytes from the half's first byte to
    where its box `box` (0-based) is staged, in the half's upper half (4 KB a box)."""
    return BOX * BOX * (half_boxes(half) + box)


def staged_box(base: cute.Pointer, buffer: int, half: int, box: int) -> cute.Tensor:
    """An FP8 cache: where box `box` of the half lands (base: the K buffers' first byte as
    e4m3): 64 keys x 64 e4m3, row-major, unswizzled."""
    return cute.make_tensor(
        base + half_start(buffer, half) + staged_offset(half, box),
        cute.make_layout((BOX, BOX), stride=(BOX, 1)),
    )


@dataclass(frozen=True)
class HalfRings:
    """The four one-stage rings over the K buffers' halves, by (buffer, half): buffer 0 holds
    each pair's later block (warpgroup 0's scores; an odd count's lone last block too), buffer
    1 its earlier one (warpgroup 1's)."""

    left0: pipeline.PipelineAsync
    right0: pipeline.PipelineAsync
    left1: pipeline.PipelineAsync
    right1: pipeline.PipelineAsync

    def ring(self, buffer: int, half: int) -> pipeline.PipelineAsync:
        return ((self.left0, self.right0), (self.left1, self.right1))[buffer][half]


@dataclass(frozen=True)
class LatentBlockLoads:
    """One tile's key loads: for each of the nine column boxes, its TMA atom, the tensor it
    reads ((rows, 64-column boxes) of this tile's kv head and cache row, or of every page),
    and the box's column index in that tensor."""

    boxes: tuple  # ((atom, src (rows, cols[, pages]), column box), ...) by column box 0..8
    sK: cute.Tensor  # (keys, 576, 2): the two buffers
    rings: HalfRings
    page_table_row: cute.Tensor  # paged caches: this batch's row of the table; else None
    page_size: Int32
    staged: Optional[cute.Pointer] = None  # an FP8 cache's K buffers as e4m3 (staged_box)

    @staticmethod
    def create(atoms, loads, sK, rings, variant, head, batch, page_table, staged=None):
        """atoms/loads: the launch's TmaAtoms and GmemLoads (k: the 576 latent, or with qv k
        the rope's 64 and v the 512), TMA views in kernel mode order (rows, cols, heads,
        batch or pages). staged: an FP8 cache's K buffers as e4m3 (its boxes land in each
        half's upper bytes; kernels/mla_decode/fp8_loads.py)."""
        paged = variant.kv_layout == "paged"

        def view(mX):
            return mX[None, None, head, None] if const_expr(paged) else mX[None, None, head, batch]

        if const_expr(variant.qv):
            v_src, rope_src = view(loads.v), view(loads.k)
            boxes = tuple((atoms.v, v_src, c) for c in range(TILES - 1))
            boxes = boxes + ((atoms.k, rope_src, 0),)
        else:
            k_src = view(loads.k)
            boxes = tuple((atoms.k, k_src, c) for c in range(TILES))
        page_table_row, page_size = None, Int32(0)
        if const_expr(paged):
            page_table_row = page_table[batch, None]
            page_size = loads.k.shape[0]
        return LatentBlockLoads(boxes, sK, rings, page_table_row, page_size, staged)

    @cute.jit
    def load_half(self, n_block: Int32, buffer: int, half: int, state: pipeline.PipelineState):
        """Wait for the half to be free, then issue its boxes of key block n_block; they
        complete on the half's full barrier."""
        first, end = HALVES[half]

        def dst(c):
            if const_expr(self.staged is not None):
                return staged_box(self.staged, buffer, half, c - first)
            return hopper_mma.column_slice(self.sK, c * BOX, BOX)[None, None, buffer]

        self.issue_boxes(n_block, self.rings.ring(buffer, half), state, (first, end), dst)

    @cute.jit
    def issue_boxes(self, n_block: Int32, ring, state, boxes: cutlass.Constexpr, dst):
        """Wait for the ring's stage to be free, then issue column boxes boxes[0] ..
        boxes[1] - 1 of key block n_block into dst(box) (smem tensors); they complete on the
        stage's full barrier."""
        ring.producer_acquire(state)
        rows, page = n_block, None
        if const_expr(self.page_table_row is not None):
            key = n_block * BOX
            num_pages = cute.size(self.boxes[0][1], mode=[2])
            page = page_of_key(self.page_table_row, key, self.page_size, num_pages)
            rows = (key % self.page_size) // BOX
        for c in cutlass.range_constexpr(boxes[0], boxes[1]):
            atom, src, src_col = self.boxes[c]
            if const_expr(page is not None):
                src = src[None, None, page]
            g = cute.local_tile(src, (BOX, BOX), (rows, src_col))
            s = dst(c)
            dst_part, src_part = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )
            cute.copy(
                atom, src_part, dst_part, tma_bar_ptr=ring.producer_get_barrier(state),
                cache_policy=cutlass.Int64(EVICT_FIRST),
            )  # fmt: skip

    @cute.jit
    def load_blocks(self, n_block_min: Int32, n_block_max: Int32, states):
        """The tile's key blocks' halves in walk_halves' order. states: the producer states of
        (left0, right0, left1, right1)."""
        walk_halves(self._issue, n_block_min, n_block_max, states)

    def _issue(self, n_block, buffer: int, half: int, state: pipeline.PipelineState):
        """load_half, then the state past it (rebound by the caller: the DSL carries it
        through the loop that way)."""
        self.load_half(n_block, buffer, half, state)
        state.advance()
        return state


@cute.jit
def walk_halves(step, n_block_min: Int32, n_block_max: Int32, states):
    """The tile's key blocks, last first, as the seesaw takes them: an odd count's last block
    alone into buffer 0, then pairs (n, n - 1) into buffers 0 and 1, the halves in the order
    their readers free them: buffer 0's left, buffer 0's right, buffer 1's right, buffer 1's
    left (one warp issues them in turn, so a half freed early must not queue behind one freed
    late: on H100 this order took 64 x 8k at 128 heads from 325 us to 285). step(n_block,
    buffer, half, state) -> the half's state after it; states: (left0, right0, left1, right1)."""
    left0, right0, left1, right1 = states
    count = n_block_max - n_block_min
    odd = count % 2
    if odd == 1:
        left0 = step(n_block_max - 1, 0, LEFT, left0)
        right0 = step(n_block_max - 1, 0, RIGHT, right0)
    for p in cutlass.range(count // 2, unroll=1):
        hi = n_block_max - 1 - odd - 2 * p
        left0 = step(hi, 0, LEFT, left0)
        right0 = step(hi, 0, RIGHT, right0)
        right1 = step(hi - 1, 1, RIGHT, right1)
        left1 = step(hi - 1, 1, LEFT, left1)
