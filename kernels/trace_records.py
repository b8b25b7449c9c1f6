"""Per-tile trace records written by traced kernels (AttentionConfig.trace): which SM ran a work
tile, its coordinates, and global-timer stamps of its phases.

A record is RECORD_WORDS int64 words in a (slots, RECORD_WORDS) tensor, one slot per work tile
(the persistent schedulers' flat tile index, or the CTA's linear block index). One thread of
each side writes its words: the MMA warps' first thread the coordinates and the consumer
stamps, the producer warp's elected lane the load stamps. Words a kernel does not write stay
as the host zeroed them; a slot whose KIND is 0 held no tile. flash_cute/trace.py decodes
them.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

RECORD_WORDS = 16

# Word indices. Stamps are %globaltimer nanoseconds.
KIND = 0  # 0: no tile; FORWARD_TILE or COMBINE_BLOCK
SM = 1
CTA = 2  # linear block index
M_BLOCK = 3
HEAD = 4  # q head; with packed GQA, the group of q heads the tile holds (kv head x groups)
BATCH = 5
SPLIT = 6
START = 7  # MMA warps: the tile begins
KV_READY = 8  # MMA warps: the first K block has landed
MAINLOOP_END = 9  # MMA warps: O and the LSE are final in registers
END = 10  # MMA warps: the epilogue (and an in-kernel split merge) is done
LOAD_START = 11  # producer: the tile begins
LOAD_END = 12  # producer: the tile's last load is issued

FORWARD_TILE = 1
COMBINE_BLOCK = 2


@dataclass(frozen=True)
class TileTrace:
    """The record of one work tile: records (slots, RECORD_WORDS) Int64, the tile's slot, and
    whether this thread writes (one per side). Slots past the tensor are dropped (the host sizes
    it to the tile count)."""

    records: cute.Tensor
    slot: Int32
    writer: cutlass.Boolean

    @cute.jit
    def stamp(self, word: cutlass.Constexpr[int]):
        if self.writer and self.slot < self.records.shape[0]:
            self.records[self.slot, word] = cute.arch.globaltimer()

    @cute.jit
    def begin(self, kind: cutlass.Constexpr[int], cta: Int32, coords):
        """KIND, SM, CTA, the coordinates (m_block, head, batch, split) and START."""
        if self.writer and self.slot < self.records.shape[0]:
            self.records[self.slot, KIND] = Int64(kind)
            self.records[self.slot, SM] = Int64(cute.arch.smid())
            self.records[self.slot, CTA] = Int64(cta)
            for i, word in enumerate((M_BLOCK, HEAD, BATCH, SPLIT)):
                self.records[self.slot, word] = Int64(coords[i])
            self.records[self.slot, START] = cute.arch.globaltimer()


@cute.jit
def linear_block_idx() -> Int32:
    """blockIdx flattened x-fastest: a one-CTA-per-tile launch's slot."""
    bidx, bidy, bidz = cute.arch.block_idx()
    gdx, gdy, _ = cute.arch.grid_dim()
    return bidx + gdx * (bidy + gdy * bidz)
