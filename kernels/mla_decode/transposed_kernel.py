"""The transposed latent decode kernel for Hopper (sm_90a): an FP8 (e4m3) latent cache against
tiles of at most 32 query rows (heads x tokens of a sequence, packed over the one latent head),
the latent decode kernel's launch (kernel.py) with the transposed mainloop (transposed.py).

Warp roles (384 threads): warpgroup 0's warp 0 loads Q, then the tile's key blocks, last first,
alternately into warpgroup 1's and warpgroup 2's rings (the mainloop's warpgroups 0 and 1);
the MMA warpgroups run the mainloop, then the forward epilogue.

Shared memory: Q (64 x 576 as loaded, 72 KB; rows 32-63 hold the warpgroups' P^T once it has
landed), four stages of a key block's e4m3 (36 KB each: two a warpgroup), the exchanges and
the barriers: ~225 KB of the 232,448 bytes a CTA may have.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from .. import hopper_mma
from ..forward.facts import THREADS_PER_WARPGROUP
from .fp8_fragments import STAGE_BYTES, stage_box_layout
from .kernel import MlaDecodeSm90
from .loads import BOX, TILES, LatentBlockLoads
from .seesaw import D_LATENT
from .transposed import (
    MAX_ROWS,
    MERGE_STRIDE,
    STAGES,
    Transposed,
    TransposedBuffers,
    TransposedMmas,
)


class MlaDecodeTransposedSm90(MlaDecodeSm90):
    """One compiled variant (config.seesaw_rows 16 or 32, an FP8 latent cache) of the transposed
    latent decode kernel. Its entry points and arguments are the forward kernel's."""

    mainloop_cls = Transposed

    def _tiled_mmas(self) -> TransposedMmas:
        return TransposedMmas(
            qk=hopper_mma.make_tiled_mma(
                self.mma_dtype, 1, self.config.seesaw_rows, False, a_from_registers=True
            ),
            pv=hopper_mma.make_tiled_mma(
                self.mma_dtype, 1, D_LATENT, True, a_from_registers=True, split_n=2
            ),
        )

    def _box_layout(self):
        return stage_box_layout()

    def _shared_storage(self, layouts):
        """Q as loaded, the stages (e4m3), the exchanges, a ring per warpgroup."""
        sQ_size = cute.cosize(layouts.q)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_stages: cute.struct.MemRange[cutlass.Int64, 2 * 2 * STAGES]
            split_last: cute.struct.MemRange[Int32, 1]
            exchange: cute.struct.MemRange[Float32, 2 * 4 * MAX_ROWS]
            sums: cute.struct.MemRange[Float32, 2 * 4 * MAX_ROWS]
            final: cute.struct.MemRange[Float32, 2 * 2 * MAX_ROWS]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, sQ_size], 1024]
            stages: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, 2 * STAGES * STAGE_BYTES], 1024
            ]

        return SharedStorage

    def _rings(self, storage, tma_thread) -> tuple:
        """A ring per MMA warpgroup (STAGES stages of a key block's e4m3), freed by its four
        warps."""
        warpgroup_warps = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, THREADS_PER_WARPGROUP // 32
        )
        return tuple(
            pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_stages.data_ptr() + 2 * STAGES * w,
                num_stages=STAGES,
                producer_group=tma_thread,
                consumer_group=warpgroup_warps,
                tx_count=STAGE_BYTES,
                defer_sync=True,
            )
            for w in range(2)
        )

    def _buffers(self, storage, layouts, sQ, sQ_mma, pipeline_q, rings) -> TransposedBuffers:
        stages = storage.stages.data_ptr()
        return TransposedBuffers(
            sQ=sQ_mma,
            sQ_loaded=sQ,
            sPt=self._pt_view(storage.sQ.data_ptr()),
            stages=Int32(stages.toint()),
            merge=cute.make_tensor(
                cute.recast_ptr(stages, dtype=Float32),
                _row_major((2, MAX_ROWS, MERGE_STRIDE)),
            ),
            exchange=storage.exchange.get_tensor(_row_major((2, 4, MAX_ROWS))),
            sums=storage.sums.get_tensor(_row_major((2, 4, MAX_ROWS))),
            final=storage.final.get_tensor(_row_major((2, 2, MAX_ROWS))),
            pipeline_q=pipeline_q,
            rings=rings,
        )

    def _load_keys(self, atoms, loads, storage, buf, tile, shapes, n_block_min, n_block_max):
        """The loading warp's key blocks after Q: last first, alternately into the two
        warpgroups' rings (_load_blocks)."""
        block_loads = LatentBlockLoads.create(
            atoms, loads, None, None, self.variant, tile.head_kv_idx, tile.batch_idx,
            shapes.page_table,
        )  # fmt: skip
        stages = storage.stages.data_ptr()
        self._load_blocks(block_loads, buf.rings, stages, n_block_min, n_block_max)

    def _pt_view(self, q_ptr) -> cute.Tensor:
        """(rows, 64, 2) fp16: warpgroup w's P^T from row 32 of Q's column block w (Q's tile
        is 64-row blocks of 64 columns, 8 KB each under the 128-byte swizzle; S^T reads rows
        0-31 at most)."""
        layout = hopper_mma.make_row_major_smem_layout(self.mma_dtype, self.config.seesaw_rows, BOX)
        block = 64 * BOX  # elements of one 64-column block of Q's tile
        ptr = cute.recast_ptr(q_ptr, layout.inner, dtype=self.mma_dtype)
        pt = cute.make_layout(
            (layout.outer.shape[0], layout.outer.shape[1], 2),
            stride=(layout.outer.stride[0], layout.outer.stride[1], block),
        )
        return cute.make_tensor(ptr + 32 * BOX, pt)

    @cute.jit
    def _load_blocks(self, block_loads, rings, stages, n_block_min: Int32, n_block_max: Int32):
        """The tile's key blocks, last first: block n_block_max - 1 - i into warpgroup i % 2's
        ring."""
        base = cute.recast_ptr(stages, dtype=cutlass.Float8E4M3FN)
        count = n_block_max - n_block_min
        s0 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        s1 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        for p in cutlass.range(count // 2, unroll=1):
            s0 = self._load_block(block_loads, rings, base, n_block_max - 1 - 2 * p, 0, s0)
            s1 = self._load_block(block_loads, rings, base, n_block_max - 2 - 2 * p, 1, s1)
        if count % 2 == 1:
            self._load_block(block_loads, rings, base, n_block_min, 0, s0)

    def _load_block(self, block_loads, rings, base, n_block, w: int, state):
        """Key block n_block into warpgroup w's ring's next stage; returns the state past it
        (rebound by the caller: the DSL carries it through the loop that way)."""
        layout = stage_box_layout()
        first = (STAGES * w + state.index) * STAGE_BYTES

        def dst(c):
            at = cute.recast_ptr(base + first + c * BOX * BOX, layout.inner)
            return cute.make_tensor(at, layout.outer)

        block_loads.issue_boxes(n_block, rings[w], state, (0, TILES), dst)
        state.advance()
        return state


def _row_major(shape: tuple) -> cute.Layout:
    """A compact layout whose last mode is contiguous."""
    return cute.make_ordered_layout(shape, order=tuple(reversed(range(len(shape)))))
