"""FP8 (float8_e4m3fn) K/V caches: the blocks the loads bring in, turned into the fp16 blocks the
WGMMAs read.

The TMA warp (or, for pages no TMA box follows, FP8_GATHER_WARPS warps with cp.async) loads FP8
key blocks into FP8 rings; the producer warpgroup's other warps convert each block into the
matching stage of fp16 rings, which the MMA warpgroups consume exactly as they consume a 16-bit
cache's rings. So the conversion runs beside the MMA warps' GEMMs and softmax rather than in
their path. Every e4m3 value is exact in fp16, and one instruction converts two of them (bf16
would take four: e4m3 -> f16 -> f32 -> bf16), so with an FP8 cache the GEMMs run in fp16; a bf16
Q tile is converted to fp16 in place once it lands (saturating at +-65504, fp16's largest
value). The per-(batch, kv head) descales are folded into the softmax scale (K) and the
output's row normalization (V), not applied per element.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr

PIECE = 16  # elements per thread and step: one 16-byte FP8 load, or two 16-byte 16-bit loads
FP16_MAX = 65504.0
BATCH = 4  # pieces loaded ahead of their stores (11: 4% slower, 1: 22% slower)
# Producer warps that gather an FP8 cache's rows with cp.async (pages no TMA box follows);
# the warpgroup's other two convert. (H200, batch 8 x 32k keys, page 1: one gathering warp
# 304 us, two 217, three 436.)
FP8_GATHER_WARPS = 2


def fold_descales(shapes, tile, scale_log2):
    """(the softmax scale in log2 units with a tile's score descales folded in: q's with FP8
    math, K's with an FP8 cache; V's descale, or None) of the tile's batch and kv head (shapes:
    the launch's ProblemShapes, whose descales are (batch, nheads_kv) fp32)."""
    if const_expr(shapes.q_descale is not None):
        scale_log2 = scale_log2 * shapes.q_descale[tile.batch_idx, tile.head_kv_idx]
    if const_expr(shapes.k_descale is not None):
        scale_log2 = scale_log2 * shapes.k_descale[tile.batch_idx, tile.head_kv_idx]
    v_descale = None
    if const_expr(shapes.v_descale is not None):
        v_descale = shapes.v_descale[tile.batch_idx, tile.head_kv_idx]
    return scale_log2, v_descale


def apply_v_descale(inv_row_sum: cute.Tensor, v_descale) -> None:
    """V's descale folded into the rows' final 1 / row sum (None: nothing)."""
    if const_expr(v_descale is not None):
        for r in range(cute.size(inv_row_sum)):  # (a plain Python loop: not a jit function)
            inv_row_sum[r] = inv_row_sum[r] * v_descale


@cute.jit
def convert_block(
    src: cute.Tensor,
    dst: cute.Tensor,
    thread: Int32,
    num_threads: cutlass.Constexpr[int],
    valid_rows: Int32,
    saturate: cutlass.Constexpr[bool] = False,
    permutation: cutlass.Constexpr[Optional[tuple]] = None,
):
    """dst (rows, width) = src (rows, width) in dst's dtype, by num_threads threads (this one:
    `thread`); rows from valid_rows on written as zeros (a cache's slots past the sequence may
    hold anything, NaN included, and P is 0 there: 0 * NaN must not reach O). src and dst may
    be the same smem (each piece is read, then written, by one thread). saturate: clamp to
    dst's finite range (bf16 -> fp16). permutation: each 16 columns' order in dst (dst column
    16 i + e holds src column 16 i + permutation[e]). Each thread then makes its stores visible
    to the async proxy (the WGMMAs); the caller orders them before the readers (a barrier or an
    arrive)."""
    assert permutation is None or sorted(permutation) == list(range(PIECE)), permutation
    rows, width = cute.size(src, mode=[0]), cute.size(src, mode=[1])
    per_row = width // PIECE
    count = rows * per_row
    steps = (count + num_threads - 1) // num_threads
    exact = count % num_threads == 0
    src_pieces = cute.zipped_divide(src, (1, PIECE))  # ((1, 16), (rows, width / 16))
    dst_pieces = cute.zipped_divide(dst, (1, PIECE))
    # Loads in batches ahead of their stores: the compiler cannot move a load above a store
    # to smem it may alias, so one piece at a time would wait out each load's latency.
    partial = valid_rows < rows  # (the tile's last block only)
    for first in cutlass.range_constexpr(0, steps, BATCH):
        batch = min(BATCH, steps - first)
        raw = [cute.make_rmem_tensor((1, PIECE), src.element_type) for _ in range(batch)]
        for b in cutlass.range_constexpr(batch):
            j = thread + (first + b) * num_threads
            if j < count or cutlass.const_expr(exact):
                row = j // per_row
                cute.autovec_copy(src_pieces[None, (row, j - row * per_row)], raw[b])
        for b in cutlass.range_constexpr(batch):
            j = thread + (first + b) * num_threads
            if j < count or cutlass.const_expr(exact):
                row = j // per_row
                wide = cute.make_rmem_tensor((1, PIECE), dst.element_type)
                if cutlass.const_expr(saturate):
                    f32 = cute.make_rmem_tensor((1, PIECE), Float32)
                    f32.store(raw[b].load().to(Float32))
                    for e in cutlass.range_constexpr(PIECE):
                        f32[e] = cutlass.max(cutlass.min(f32[e], FP16_MAX), -FP16_MAX)
                    wide.store(f32.load().to(dst.element_type))
                else:
                    wide.store(raw[b].load().to(dst.element_type))
                if cutlass.const_expr(permutation is not None):
                    # (within a piece: a thread reads and writes only its own pieces in place)
                    ordered = cute.make_rmem_tensor((1, PIECE), dst.element_type)
                    for e in cutlass.range_constexpr(PIECE):
                        ordered[e] = wide[permutation[e]]
                    wide = ordered
                if partial:
                    if row >= valid_rows:
                        wide.fill(0.0)
                cute.autovec_copy(wide, dst_pieces[None, (row, j - row * per_row)])
    cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMAs' reads


@dataclass(frozen=True)
class ConvertingBlockLoader:
    """A block "loader" for the converting warps, run in the loading warps' order (so it
    takes the same PipelineState walk): block n waits in the FP8 ring, is converted into the
    same stage of the fp16 ring, committed there, and its FP8 stage freed. Both rings have the
    same stages; `state` is the fp16 ring's producer state (the FP8 ring's consumer phase is
    its complement). seqlen_k: V's loader zeroes rows past it (None: K's, whose rows past the
    sequence are masked out of the scores). `fill` is the work on each block (here the
    conversion; kernels/v_transpose.py's loader transposes instead)."""

    src: cute.Tensor  # (tile_n, width, stages) FP8
    dst: cute.Tensor  # (tile_n, width, stages) fp16
    ring8: pipeline.PipelineAsync
    ring16: pipeline.PipelineAsync
    thread: Int32  # 0 .. num_threads - 1
    num_threads: int
    tile_n: int
    seqlen_k: Optional[Int32] = None

    @cute.jit
    def load(self, n_block: Int32, state: pipeline.PipelineState):
        state8 = pipeline.PipelineState(state.stages, state.count, state.index, state.phase ^ 1)
        self.ring8.consumer_wait(state8)
        self.ring16.producer_acquire(state)
        valid = Int32(self.tile_n)
        if cutlass.const_expr(self.seqlen_k is not None):
            valid = self.seqlen_k - n_block * self.tile_n
        self.fill(state.index, valid)
        self.ring16.producer_commit(state)
        cute.arch.sync_warp()  # every lane's reads of the FP8 stage are done
        self.ring8.consumer_release(state8)

    @cute.jit
    def fill(self, stage: Int32, valid: Int32):
        """The work on one block: stage `stage` of dst from src's, rows from valid on zero."""
        convert_block(
            self.src[None, None, stage],
            self.dst[None, None, stage],
            self.thread,
            self.num_threads,
            valid,
        )
