"""Which work tiles a CTA runs, and in which order: the forward kernel's tile schedulers.

A work tile is one (query tile, head, batch[, split]): tile_m rows of O and their LSE. Every
scheduler offers the same loop, so the producer warp and the MMA warps each run one loop over
their tiles whatever the scheduler:

    tile_idx, handoff = scheduler.first_tile(), scheduler.producer_handoff()
    while scheduler.is_valid(tile_idx):
        tile = scheduler.work_tile(tile_idx)
        ...
        tile_idx, handoff = scheduler.fetch_next(tile_idx, handoff)  # MMA warps: receive_next
    scheduler.finish()  # producer warp

- SingleTileScheduler: one CTA per tile, the launch's grid is the tile space's block grid and
  the tile comes from the block index; the loop runs once.
- PersistentTileScheduler: at most max_ctas CTAs, each starting on tile blockIdx.x and looping
  until its tile index passes the tile count, so one tile's epilogue overlaps the next tile's
  loads. Static: the next tile is one grid further. Dynamic: the producer warp draws the next
  index from a global counter (atomic add) and hands it to the MMA warps through a two-slot
  smem pipeline, so CTAs that drew short causal tiles take more of them. The counter must be
  zero at launch; the last CTA to finish resets it, so launches that run one after another
  (and CUDA-graph replays) share it.

The tile space (TileSpace) says what the tiles are and their order: a flat index for the
persistent schedulers, a block index for one CTA per tile. Causal fixed-length tiles run
longest first within sections of heads whose K/V fit in L2 (lpt_tile); varlen tiles are every
sequence's query tiles, flattened (varlen_tiles.py).
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from .varlen_tiles import varlen_tile

# Causal tile order (lpt_tile): the last head section aims at this many tiles per CTA, and
# holds at most one (batch, head) pair per this many CTAs.
LPT_TAIL_TILES_PER_CTA = 3
LPT_TAIL_CTAS_PER_PAIR = 4


@dataclass(frozen=True)
class WorkTile:
    """A tile's coordinates: query tile, q head (a kv head with packed GQA, whose rows hold
    its q heads), the kv head it reads, batch, and split (0 unless split)."""

    m_block: Int32
    head_idx: Int32
    head_kv_idx: Int32
    batch_idx: Int32
    split_idx: Int32


@dataclass(frozen=True)
class TileSpace:
    """The work tiles of a launch and their order, from the variant's static facts and the
    call's run-time sizes (q in kernel mode order: rows, head_dim, heads[, batch]).

    With packed GQA (rows_per_token > 1) a tile's rows fold a group of rows_per_token
    consecutive q heads of one kv head (all of them, or a divisor of their count), so the grid
    runs over those groups. Split launches multiply the heads by num_splits (head-major).
    """

    tile_m: cutlass.Constexpr[int]
    rows_per_token: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    varlen: cutlass.Constexpr[bool]
    split: cutlass.Constexpr[bool]
    kv_bytes_per_key: cutlass.Constexpr[int]  # K and V bytes of one key of one head
    l2_section_mb: cutlass.Constexpr[int]
    seqlen_q: Int32  # q rows per sequence (padded), or the total (varlen)
    nheads: Int32
    nheads_kv: Int32
    batch: Int32  # padded q's batch (varlen: the sequences of cu_seqlens_q)
    num_splits: Int32
    kv_capacity: Int32  # keys a sequence can hold (sizes the causal order's sections)
    max_ctas: Int32
    cu_seqlens_q: Optional[cute.Tensor]

    @property
    def lpt(self) -> bool:
        """Causal fixed-length unsplit tiles have unequal work: longest first (lpt_tile)."""
        return self.causal and not self.varlen and not self.split

    def num_m_blocks(self):
        """Query tiles per (head, batch) of a padded q; of the whole packed q when varlen."""
        return cute.ceil_div(self.seqlen_q * self.rows_per_token, self.tile_m)

    def grid_heads(self):
        return self.nheads // self.rows_per_token

    def tiles_per_head(self):
        """Tile indices per head: a padded q's query tiles, or a varlen grid's: every
        sequence's query tiles, flattened. sum ceil(len * ratio / tile_m) is at most
        ceil(total * ratio / tile_m) + batch; the indices past the real tiles are empty
        (varlen_tile)."""
        if const_expr(self.varlen):
            return self.num_m_blocks() + self.batch
        return self.num_m_blocks()

    def num_tiles(self):
        """Tiles of an unsplit launch: every (query tile, head, batch)."""
        tiles = self.tiles_per_head() * self.grid_heads()
        if const_expr(not self.varlen):
            tiles = tiles * self.batch
        return tiles

    def block_grid(self):
        """The grid of one CTA per tile: (tile index, head x split, batch); the causal order
        is one flat index."""
        if const_expr(self.lpt):
            return (self.num_tiles(), 1, 1)
        heads = self.grid_heads()
        if const_expr(self.split):
            heads = heads * self.num_splits
        if const_expr(self.varlen):
            return (self.tiles_per_head(), heads, 1)
        return (self.num_m_blocks(), heads, self.batch)

    @cute.jit
    def tile_of_block(self, bidx: Int32, bidy: Int32, bidz: Int32) -> WorkTile:
        """The tile of block (bidx, bidy, bidz) of block_grid."""
        m_block, batch_idx = bidx, bidz
        if const_expr(self.lpt):
            m_block, bidy, batch_idx = self.lpt_tile(bidx)
        elif const_expr(self.varlen):
            m_block, batch_idx = self._varlen_tile(bidx)
        return self._work_tile(m_block, bidy, batch_idx)

    @cute.jit
    def tile_of_index(self, tile_idx: Int32) -> WorkTile:
        """The tile of flat index tile_idx < num_tiles (persistent schedulers, unsplit)."""
        if const_expr(self.lpt):
            m_block, head, batch_idx = self.lpt_tile(tile_idx)
        elif const_expr(self.varlen):
            if const_expr(self.causal):
                # Heads innermost: a sequence's longest tiles, for every head, come before its
                # shorter ones, so the grid ends on short tiles (head-major order left the last
                # head's longest tiles to the end: 5% idle at hdim 256).
                heads = self.grid_heads()
                index = tile_idx // heads
                head = tile_idx - index * heads
            else:  # head-major: CTAs running together share K/V
                per_head = self.tiles_per_head()
                head = tile_idx // per_head
                index = tile_idx - head * per_head
            m_block, batch_idx = self._varlen_tile(index)
        else:
            # m_block fastest, then head, then batch: CTAs running together share K/V.
            num_m = self.num_m_blocks()
            rest = tile_idx // num_m
            m_block = tile_idx - rest * num_m
            batch_idx = rest // self.grid_heads()
            head = rest - batch_idx * self.grid_heads()
        return self._work_tile(m_block, head, batch_idx)

    @cute.jit
    def _varlen_tile(self, index: Int32):
        """(m_block, batch) of a varlen tile index within a head; causal tiles of a sequence
        run longest first."""
        batch_idx, m_block, num_tiles = varlen_tile(
            index, self.cu_seqlens_q, self.seqlen_q, self.rows_per_token, self.tile_m
        )
        if const_expr(self.causal):
            if m_block < num_tiles:  # (not a spare index)
                m_block = num_tiles - 1 - m_block
        return m_block, batch_idx

    def _work_tile(self, m_block: Int32, head_split: Int32, batch_idx: Int32) -> WorkTile:
        head_idx = head_split
        split_idx = Int32(0)
        if const_expr(self.split):
            head_idx = head_split // self.num_splits
            split_idx = head_split - head_idx * self.num_splits
        # The grid runs over groups of rows_per_token consecutive q heads (1: every q head;
        # packed GQA: all q heads of a kv head, or a group of them).
        head_kv_idx = head_idx
        if const_expr(self.rows_per_token == 1):
            head_kv_idx = head_idx // (self.nheads // self.nheads_kv)
        else:
            head_kv_idx = head_idx * self.rows_per_token // (self.nheads // self.nheads_kv)
        return WorkTile(m_block, head_idx, head_kv_idx, batch_idx, split_idx)

    @cute.jit
    def lpt_tile(self, tile_idx: Int32):
        """(m_block, head, batch) of flat causal tile tile_idx.

        The (batch, head) pairs, batch-major, are cut into sections; a section's tiles run
        from the last m_block (the longest causal tile) to the first, then head within the
        section. A section holds the heads whose K and V fit in l2_section_mb, so CTAs
        running together share K/V in L2. The sections share the pairs evenly, except the
        last: it gets LPT_TAIL_TILES_PER_CTA x max_ctas tiles where that takes more pairs,
        so its longest tiles start while enough shorter work remains to keep every CTA busy
        until they finish (with a last section of one L2 budget, SMs sat idle 13% of the
        time behind a few long tiles at hdim 256, 4k, per ncu). It grows past one section
        to at most one pair per LPT_TAIL_CTAS_PER_PAIR CTAs, so that with short sequences
        (few tiles per pair) CTAs running together still share K/V (a 96-pair last section
        cost 13% at 512). Sections are sized by the K/V capacity per pair.
        """
        num_m, heads, max_ctas = self.num_m_blocks(), self.grid_heads(), self.max_ctas
        pairs = heads * self.batch
        keys_per_section = (self.l2_section_mb << 20) // self.kv_bytes_per_key
        section = cutlass.max(
            cutlass.min(keys_per_section // cutlass.max(self.kv_capacity, 1), pairs), 1
        )
        wanted = cutlass.min(
            cute.ceil_div(LPT_TAIL_TILES_PER_CTA * max_ctas, num_m),
            max_ctas // LPT_TAIL_CTAS_PER_PAIR,
        )
        tail = cutlass.min(cutlass.max(section, wanted), pairs)
        head_pairs = pairs - tail
        # The head pairs as n sections of q or q + 1 pairs (the first r get q + 1).
        n = cute.ceil_div(head_pairs, section)
        q = head_pairs // cutlass.max(n, 1)
        r = head_pairs - q * n
        big_tiles = (q + 1) * num_m
        offset = tile_idx - head_pairs * num_m
        size = tail
        first_pair = head_pairs
        if tile_idx < r * big_tiles:
            s = tile_idx // big_tiles
            offset = tile_idx - s * big_tiles
            size = q + 1
            first_pair = s * (q + 1)
        elif tile_idx < head_pairs * num_m:
            j = tile_idx - r * big_tiles
            s = j // (q * num_m)
            offset = j - s * (q * num_m)
            size = q
            first_pair = r * (q + 1) + s * q
        m_from_last = offset // size
        pair = first_pair + offset - m_from_last * size
        batch = pair // heads
        return num_m - 1 - m_from_last, pair - batch * heads, batch


@dataclass(frozen=True)
class SingleTileScheduler:
    """One CTA per work tile (split launches always; others when the config says so)."""

    space: TileSpace

    @staticmethod
    def grid(space: TileSpace):
        return space.block_grid()

    @staticmethod
    def create(space: TileSpace, *_) -> "SingleTileScheduler":
        return SingleTileScheduler(space)

    def first_tile(self) -> Int32:
        return Int32(0)

    def is_valid(self, tile_idx: Int32):
        return tile_idx == 0

    def work_tile(self, tile_idx: Int32) -> WorkTile:
        bidx, bidy, bidz = cute.arch.block_idx()
        return self.space.tile_of_block(bidx, bidy, bidz)

    def producer_handoff(self):
        return None

    def consumer_handoff(self):
        return None

    def fetch_next(self, tile_idx: Int32, handoff):
        return tile_idx + 1, handoff

    def receive_next(self, tile_idx: Int32, handoff):
        return tile_idx + 1, handoff

    def finish(self):
        pass


@dataclass(frozen=True)
class PersistentTileScheduler:
    """At most max_ctas CTAs loop over the flat tile order (unsplit launches)."""

    space: TileSpace
    num_tiles: Int32
    grid_size: Int32
    dynamic: cutlass.Constexpr[bool]
    counter: Optional[cute.Tensor]  # (2,) int32 in gmem: next draw, CTAs done
    handoff: Optional[pipeline.PipelineAsync]  # producer warp -> MMA warps
    next_tile: Optional[cute.Tensor]  # (2,) int32 in smem, one per handoff slot

    @staticmethod
    def grid(space: TileSpace):
        return (cutlass.min(space.num_tiles(), space.max_ctas), 1, 1)

    @staticmethod
    def create(
        space: TileSpace,
        dynamic: bool,
        counter: Optional[cute.Tensor],
        handoff_barriers,
        next_tile_smem: cute.Tensor,
        num_consumer_threads: int,
    ) -> "PersistentTileScheduler":
        """handoff_barriers: smem for 4 mbarriers; next_tile_smem: smem for 2 int32."""
        handoff, next_tile = None, None
        if const_expr(dynamic):
            handoff = pipeline.PipelineAsync.create(
                barrier_storage=handoff_barriers,
                num_stages=2,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, num_consumer_threads
                ),
                defer_sync=True,
            )
            next_tile = next_tile_smem
        return PersistentTileScheduler(
            space,
            space.num_tiles(),
            cute.arch.grid_dim()[0],
            dynamic,
            counter,
            handoff,
            next_tile,
        )

    def first_tile(self) -> Int32:
        return cute.arch.block_idx()[0]

    def is_valid(self, tile_idx: Int32):
        return tile_idx < self.num_tiles

    def work_tile(self, tile_idx: Int32) -> WorkTile:
        return self.space.tile_of_index(tile_idx)

    def producer_handoff(self):
        if const_expr(self.dynamic):
            return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        return None

    def consumer_handoff(self):
        if const_expr(self.dynamic):
            return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        return None

    @cute.jit
    def fetch_next(self, tile_idx: Int32, handoff):
        """Producer warp (all 32 lanes): the tile after tile_idx; publishes it when dynamic."""
        next_idx = tile_idx + self.grid_size
        if const_expr(self.dynamic):
            drawn = Int32(0)
            if cute.arch.lane_idx() == 0:
                drawn = cute.arch.atomic_add(
                    self.counter.iterator.llvm_ptr, Int32(1), sem="relaxed", scope="gpu"
                )
            next_idx = cute.arch.shuffle_sync(drawn, 0) + self.grid_size
            self.handoff.producer_acquire(handoff)
            if cute.arch.lane_idx() == 0:
                self.next_tile[handoff.index] = next_idx
            self.handoff.producer_commit(handoff)  # mbarrier arrive: releases the smem write
            handoff.advance()
        return next_idx, handoff

    @cute.jit
    def receive_next(self, tile_idx: Int32, handoff):
        """MMA warps: the tile after tile_idx, as the producer warp drew it."""
        next_idx = tile_idx + self.grid_size
        if const_expr(self.dynamic):
            self.handoff.consumer_wait(handoff)
            next_idx = self.next_tile[handoff.index]
            self.handoff.consumer_release(handoff)
            handoff.advance()
        return next_idx, handoff

    @cute.jit
    def finish(self):
        """Producer warp, after its last draw: count this CTA done; the last CTA resets the
        counter (no CTA of this launch draws again)."""
        if const_expr(self.dynamic):
            if cute.arch.lane_idx() == 0:
                done = cute.arch.atomic_add(
                    (self.counter.iterator + 1).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu"
                )
                if done == self.grid_size - 1:
                    self.counter[0] = Int32(0)
                    self.counter[1] = Int32(0)
