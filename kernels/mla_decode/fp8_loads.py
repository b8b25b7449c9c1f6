"""The latent decode kernel's key loads from an FP8 (float8_e4m3fn) latent cache: each half of
a K buffer filled in two steps, in the buffer itself (the kernel's shared memory has no room
for FP8 stages beside Q and the two 16-bit buffers).

1. The TMA warp, once the half's MMA readers have freed it, loads the half's 64 x 64 boxes of
   e4m3 (4 KB each, unswizzled rows of 64 bytes) into the upper half of the half's bytes, on
   the half's "staged" ring (PipelineTmaAsync).
2. The converting warps (the producer warpgroup's other three) turn them into the fp16 boxes
   the WGMMAs read (SW128, as the 16-bit loads leave them), and commit the half on its MMA
   ring (PipelineAsync, one arrive per converting thread after a proxy fence). Rows past the
   sequence's last key are converted as they are: the seesaw masks their scores and zeroes
   their V rows, as with a 16-bit cache.

In place: box j's fp16 lands at 8 KB * j, its FP8 bytes sit at 4 KB * (n + j) (n boxes in the
half), so box j's fp16 covers the staged bytes of boxes 2j - n and 2j - n + 1: the boxes are
converted in order, and from the middle on the converting warps sync between reading a box
and writing it. e4m3 -> fp16 is exact and one instruction per two values, so the GEMMs run in
fp16 (kernels/kv_dequant.py says why; the kernel converts a bf16 Q tile once); the cache's
descales fold into the softmax scale (K) and the final row normalization (V).

The converting warps never wait on the MMA warps (only on staged bytes), and the TMA warp
waits only for free halves: neither can hold up the other's work on an earlier half.
"""

import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from ..kv_dequant import PIECE  # e4m3 values per converting step: one 16-byte load, two stores
from ..named_barriers import NamedBarrier
from .loads import (
    BOX,
    HalfRings,
    StagedHalves,
    half_boxes,
    half_start,
    staged_offset,
    walk_halves,
)

PIECES_PER_BOX = BOX * BOX // PIECE
CONVERT_WARPS = 3  # the producer warpgroup's warps 1-3 (warp 0 issues the TMA)
CONVERT_THREADS = 32 * CONVERT_WARPS
STEPS = (PIECES_PER_BOX + CONVERT_THREADS - 1) // CONVERT_THREADS  # a thread's pieces of a box


@dataclass(frozen=True)
class LatentConverter:
    """The converting warps' side: each staged half of the tile's key blocks, in the loads'
    order (walk_halves), into the fp16 half the seesaw reads."""

    k_buffers: cute.Pointer  # the K buffers' first element, fp16, as raw (unswizzled) smem
    rings: HalfRings  # the MMA warps' (PipelineAsync; this side produces)
    staged: StagedHalves  # TMA's rings (this side consumes) and the staged bytes
    thread: Int32  # 0 .. CONVERT_THREADS - 1

    @cute.jit
    def convert_blocks(self, n_block_min: Int32, n_block_max: Int32, states):
        """states: the MMA rings' producer states (left0, right0, left1, right1)."""
        offsets = self._piece_offsets()
        step = functools.partial(self._convert_half, offsets=offsets)
        walk_halves(step, n_block_min, n_block_max, states)

    @cute.jit
    def _piece_offsets(self) -> cute.Tensor:
        """(STEPS, 3) bytes within a box of this thread's pieces (piece i: thread + step *
        CONVERT_THREADS, row i // 4, 16 values from column 16 (i % 4)), the same in every box:
        its staged e4m3 (rows of 64 bytes), and its two 16-byte fp16 chunks in the SW128 box
        (rows of 128 bytes, chunk c of row r at (c ^ (r % 8)) * 16)."""
        offsets = cute.make_rmem_tensor((STEPS, 3), Int32)
        for s in cutlass.range_constexpr(STEPS):
            i = self.thread + s * CONVERT_THREADS
            row = i // 4
            chunk = 2 * (i - 4 * row)
            offsets[s, 0] = i * PIECE
            offsets[s, 1] = row * 128 + ((chunk ^ (row % 8)) * 16)
            offsets[s, 2] = row * 128 + (((chunk + 1) ^ (row % 8)) * 16)
        return offsets

    def _convert_half(self, n_block, buffer: int, half: int, state, offsets):
        # The staged ring is consumed in step with the MMA ring's production: its consumer
        # phase is the complement of the producer state's.
        state8 = pipeline.PipelineState(1, state.count, state.index, state.phase ^ 1)
        staged = self.staged.rings.ring(buffer, half)
        staged.consumer_wait(state8)
        self._convert(buffer, half, offsets)
        staged.consumer_release(state8)
        self.rings.ring(buffer, half).producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def _convert(self, buffer: int, half: int, offsets: cute.Tensor):
        """The half's boxes in order, one at a time: box j's fp16 covers the staged bytes of
        boxes 2j - n and 2j - n + 1 (n boxes in the half), so from j >= (n - 1) / 2 on the
        converting warps sync between reading box j and writing it (the boxes it covers,
        itself among them for the last, have then been read by every thread)."""
        n = half_boxes(half)
        start = half_start(buffer, half)
        staged = start + staged_offset(half, 0)
        # (a dynamic loop: unrolled, every box's addresses were hoisted and spilled)
        for j in cutlass.range(n, unroll=1):
            raw = []
            for s in cutlass.range_constexpr(STEPS):
                raw.append(cute.make_rmem_tensor((8, 2), cutlass.Float8E4M3FN))
                if self._holds(s):
                    at = cute.assume(staged + j * BOX * BOX + offsets[s, 0], divby=PIECE)
                    src = cute.make_tensor(self.staged.base + at, cute.make_layout((8, 2)))
                    cute.autovec_copy(src, raw[s])
            if 2 * j >= n - 1:
                cute.arch.barrier(
                    barrier_id=int(NamedBarrier.LATENT_CONVERT),
                    number_of_threads=CONVERT_THREADS,
                )
            for s in cutlass.range_constexpr(STEPS):
                if self._holds(s):
                    wide = cute.make_rmem_tensor((8, 2), self.k_buffers.dtype)
                    wide.store(raw[s].load().to(self.k_buffers.dtype))
                    for c in cutlass.range_constexpr(2):  # (bytes -> fp16 elements: / 2)
                        at = cute.assume(
                            (start + j * 2 * BOX * BOX + offsets[s, 1 + c]) // 2, divby=8
                        )
                        dst = cute.make_tensor(self.k_buffers + at, cute.make_layout(8))
                        cute.autovec_copy(wide[None, c], dst)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMAs' reads

    def _holds(self, step: int):
        """Whether this thread has a piece at `step` (the last step's: the first threads)."""
        if const_expr(PIECES_PER_BOX % CONVERT_THREADS == 0 or step < STEPS - 1):
            return True
        return self.thread + step * CONVERT_THREADS < PIECES_PER_BOX
