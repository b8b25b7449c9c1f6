"""Persistent tile schedulers of the forward kernel: which tile a CTA takes next.

A persistent CTA starts on tile blockIdx.x and loops until its tile index passes num_tiles.
- static: the next tile is one grid further (round-robin).
- dynamic: the producer warp draws the next index from a global counter (atomic add) and
  hands it to the MMA warps through a two-slot smem pipeline, so CTAs that drew short tiles
  (causal) take more of them. The counter must be zero at launch; the last CTA to finish
  resets it, so back-to-back launches on one stream (and CUDA-graph replays) reuse it.
The tile order itself (index -> m_block, head, batch) belongs to the kernel.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class PersistentTileScheduler:
    num_tiles: Int32
    grid_size: Int32
    dynamic: cutlass.Constexpr[bool]
    counter: Optional[cute.Tensor]  # (2,) int32 in gmem: next draw, CTAs done
    handoff: Optional[pipeline.PipelineAsync]  # producer warp -> MMA warps
    next_tile: Optional[cute.Tensor]  # (2,) int32 in smem, one per handoff slot

    @staticmethod
    def create(
        num_tiles: Int32,
        dynamic: bool,
        counter,
        handoff_barriers,
        next_tile_smem,
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
            num_tiles, cute.arch.grid_dim()[0], dynamic, counter, handoff, next_tile
        )

    def first_tile(self) -> Int32:
        return cute.arch.block_idx()[0]

    def producer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)

    def consumer_state(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)

    @cute.jit
    def fetch_next(self, tile_idx: Int32, state: pipeline.PipelineState) -> Int32:
        """Producer warp (all 32 lanes): the tile after tile_idx; publishes it when dynamic."""
        next_idx = tile_idx + self.grid_size
        if const_expr(self.dynamic):
            drawn = Int32(0)
            if cute.arch.lane_idx() == 0:
                drawn = cute.arch.atomic_add(
                    self.counter.iterator.llvm_ptr, Int32(1), sem="relaxed", scope="gpu"
                )
            next_idx = cute.arch.shuffle_sync(drawn, 0) + self.grid_size
            self.handoff.producer_acquire(state)
            if cute.arch.lane_idx() == 0:
                self.next_tile[state.index] = next_idx
            self.handoff.producer_commit(state)  # mbarrier arrive: releases the smem write
        return next_idx

    @cute.jit
    def receive_next(self, tile_idx: Int32, state: pipeline.PipelineState) -> Int32:
        """MMA warps: the tile after tile_idx, as the producer warp drew it."""
        next_idx = tile_idx + self.grid_size
        if const_expr(self.dynamic):
            self.handoff.consumer_wait(state)
            next_idx = self.next_tile[state.index]
            self.handoff.consumer_release(state)
        return next_idx

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
