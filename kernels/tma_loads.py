"""TMA tile loads into a multi-stage smem ring guarded by a PipelineTmaAsync."""

from dataclasses import dataclass

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
            atom, 0, cute.make_layout(1),
            cute.group_modes(smem_stages, 0, 2), cute.group_modes(gmem_blocks, 0, 2),
        )
        return TmaBlockLoader(atom, src, dst, ring)

    def load(self, n_block: Int32, state: pipeline.PipelineState):
        """Wait for the stage to be free, then issue the copy; it completes on the stage's
        full barrier (the pipeline's tx_count is the bytes of one block)."""
        self.ring.producer_acquire(state)
        cute.copy(
            self.atom, self.src_blocks[None, n_block], self.dst_stages[None, state.index],
            tma_bar_ptr=self.ring.producer_get_barrier(state),
        )
