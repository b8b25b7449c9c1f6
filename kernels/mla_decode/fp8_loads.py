"""The latent decode kernel's key loads from an FP8 (float8_e4m3fn) latent cache: each half of
a K buffer filled in two steps, in the buffer itself (the kernel's shared memory has no room
for FP8 stages beside Q and the two 16-bit buffers).

1. The TMA warp, once the half's readers have freed it, loads the half's 64 x 64 boxes of e4m3
   (4 KB each, unswizzled rows of 64 bytes) into the upper half of the half's bytes, on the
   half's ring (its transaction count: the e4m3 bytes; kernels/mla_decode/loads.py).
2. The MMA warpgroup that reads the half first (its scores: warpgroup 0 buffer 0's halves,
   warpgroup 1 buffer 1's) converts them into the fp16 boxes the WGMMAs read (SW128, as the
   16-bit loads leave them) right before issuing the half's k-blocks: each thread makes its
   stores visible to the async proxy, then the warpgroup's four warps meet on a named barrier
   (LATENT_CONVERT_0 + buffer). The other warpgroup reads the half after one of the seesaw's
   barriers, which follow the conversion. Rows past the sequence's last key are converted as
   they are: the seesaw masks their scores and zeroes their V rows, as with a 16-bit cache.

Why the MMA warpgroups: the producer warpgroup's spare warps converted first, and the hand-off
(TMA, then the converting warps, then the MMA warps, each waking on an mbarrier, one half at a
time in the loads' order) sat on the path of every half a warpgroup waits for: H200, 1.2-1.45x
the time at 16-128 heads (PERF_NOTES "Wide heads and MLA"). A warpgroup that converts what it
is about to read waits for nothing but the bytes, and converts while the other's GEMMs run.

In place: box j's fp16 lands at 8 KB * j, its FP8 bytes sit at 4 KB * (n + j) (n boxes in the
half), so box j's fp16 covers the staged bytes of boxes 2j - n and 2j - n + 1: the boxes are
converted in order, and from the middle on the warpgroup syncs between reading a box and
writing it. e4m3 -> fp16 is exact and one instruction per two values, so the GEMMs run in fp16
(kernels/kv_dequant.py says why; the kernel converts a bf16 Q tile once); the cache's descales
fold into the softmax scale (K) and the final row normalization (V).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..forward.facts import THREADS_PER_WARPGROUP
from ..kv_dequant import PIECE  # e4m3 values per converting step: one 16-byte load, two stores
from ..named_barriers import NamedBarrier
from .loads import BOX, half_boxes, half_start, staged_offset

PIECES_PER_BOX = BOX * BOX // PIECE
STEPS = PIECES_PER_BOX // THREADS_PER_WARPGROUP  # a thread's pieces of a box
assert STEPS * THREADS_PER_WARPGROUP == PIECES_PER_BOX


@dataclass(frozen=True)
class HalfConverter:
    """One MMA thread's part in converting a staged half in place (the warpgroup's 128
    threads together)."""

    k_buffers: cute.Pointer  # the K buffers' first element, fp16, as raw (unswizzled) smem
    thread: Int32  # the thread's index in its warpgroup

    @property
    def staged(self) -> cute.Pointer:
        """The K buffers' first byte as e4m3 (where TMA stages the bytes)."""
        return cute.recast_ptr(self.k_buffers, dtype=cutlass.Float8E4M3FN)

    @cute.jit
    def piece_offsets(self) -> cute.Tensor:
        """(STEPS, 3) bytes within a box of this thread's pieces (piece i: thread + step * 128,
        row i // 4, 16 values from column 16 (i % 4)), the same in every box: its staged e4m3
        (rows of 64 bytes), and its two 16-byte fp16 chunks in the SW128 box (rows of 128
        bytes, chunk c of row r at (c ^ (r % 8)) * 16)."""
        offsets = cute.make_rmem_tensor((STEPS, 3), Int32)
        for s in cutlass.range_constexpr(STEPS):
            i = self.thread + s * THREADS_PER_WARPGROUP
            row = i // 4
            chunk = 2 * (i - 4 * row)
            offsets[s, 0] = i * PIECE
            offsets[s, 1] = row * 128 + ((chunk ^ (row % 8)) * 16)
            offsets[s, 2] = row * 128 + (((chunk + 1) ^ (row % 8)) * 16)
        return offsets

    @cute.jit
    def convert(self, buffer: int, half: int):
        """The half's boxes in order, one at a time: box j's fp16 covers the staged bytes of
        boxes 2j - n and 2j - n + 1 (n boxes in the half), so from j >= (n - 1) / 2 on the
        warpgroup syncs between reading box j and writing it (the boxes it covers, itself
        among them for the last, have then been read by every thread). Ends with the
        thread's stores fenced for the async proxy and the warpgroup met: the half is ready
        for its WGMMAs."""
        barrier = int(NamedBarrier.LATENT_CONVERT_0) + buffer
        # (recomputed each half: a few integer ops, where holding them across the tile would
        # take six of the MMA warps' registers)
        offsets = self.piece_offsets()
        n = half_boxes(half)
        start = half_start(buffer, half)
        staged = start + staged_offset(half, 0)
        # (a dynamic loop: unrolled, every box's addresses were hoisted and spilled)
        for j in cutlass.range(n, unroll=1):
            raw = []
            for s in cutlass.range_constexpr(STEPS):
                raw.append(cute.make_rmem_tensor((8, 2), cutlass.Float8E4M3FN))
                at = cute.assume(staged + j * BOX * BOX + offsets[s, 0], divby=PIECE)
                src = cute.make_tensor(self.staged + at, cute.make_layout((8, 2)))
                cute.autovec_copy(src, raw[s])
            if 2 * j >= n - 1:
                cute.arch.barrier(barrier_id=barrier, number_of_threads=THREADS_PER_WARPGROUP)
            for s in cutlass.range_constexpr(STEPS):
                wide = cute.make_rmem_tensor((8, 2), self.k_buffers.dtype)
                wide.store(raw[s].load().to(self.k_buffers.dtype))
                for c in cutlass.range_constexpr(2):  # (bytes -> fp16 elements: / 2)
                    at = cute.assume((start + j * 2 * BOX * BOX + offsets[s, 1 + c]) // 2, divby=8)
                    dst = cute.make_tensor(self.k_buffers + at, cute.make_layout(8))
                    cute.autovec_copy(wide[None, c], dst)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMAs' reads
        cute.arch.barrier(barrier_id=barrier, number_of_threads=THREADS_PER_WARPGROUP)
