"""FP8 K/V blocks turned into the fp16 tiles the WGMMAs read (variants with an FP8 cache).

The producer loads float8_e4m3fn key blocks into their own ring; the MMA warpgroup converts
each block into a single fp16 tile (same swizzled layout as a 16-bit ring's stage) just before
its GEMM and frees the FP8 stage at once. Every e4m3 value is exact in fp16, and one
instruction converts two of them (bf16 would take four: e4m3 -> f16 -> f32 -> bf16), so with
an FP8 cache the GEMMs run in fp16; a bf16 Q tile is converted to fp16 in place once it lands
(saturating at +-65504, fp16's largest value). The per-(batch, kv head) descales are folded
into the softmax scale (K) and the output's row normalization (V), not applied per element.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS_PER_WARPGROUP = 128
PIECE = 16  # elements per thread and step: one 16-byte FP8 load, or two 16-byte 16-bit loads
FP16_MAX = 65504.0


@cute.jit
def convert_block(
    src: cute.Tensor,
    dst: cute.Tensor,
    wg_thread: Int32,
    barrier_id: int,
    valid_rows: Int32,
    saturate: cutlass.Constexpr[bool] = False,
):
    """dst (rows, width) = src (rows, width) in dst's dtype, by one warpgroup (its thread
    wg_thread); rows from valid_rows on written as zeros (a cache's slots past the sequence
    may hold anything, NaN included, and P is 0 there: 0 * NaN must not reach O). src and dst
    may be the same smem (each thread reads its pieces before writing them). saturate: clamp
    to dst's finite range (bf16 -> fp16). Then the stores are made visible to the
    warpgroup's WGMMAs and the warpgroup syncs."""
    rows, width = cute.size(src, mode=[0]), cute.size(src, mode=[1])
    per_row = width // PIECE
    count = rows * per_row
    assert count % THREADS_PER_WARPGROUP == 0, (rows, width)
    src_pieces = cute.zipped_divide(src, (1, PIECE))  # ((1, 16), (rows, width / 16))
    dst_pieces = cute.zipped_divide(dst, (1, PIECE))
    for i in cutlass.range_constexpr(count // THREADS_PER_WARPGROUP):
        j = wg_thread + i * THREADS_PER_WARPGROUP
        row = j // per_row
        col = j - row * per_row
        raw = cute.make_rmem_tensor((1, PIECE), src.element_type)
        cute.autovec_copy(src_pieces[None, (row, col)], raw)
        wide = cute.make_rmem_tensor((1, PIECE), dst.element_type)
        if cutlass.const_expr(saturate):
            f32 = cute.make_rmem_tensor((1, PIECE), Float32)
            f32.store(raw.load().to(Float32))
            for e in cutlass.range_constexpr(PIECE):
                f32[e] = cutlass.max(cutlass.min(f32[e], FP16_MAX), -FP16_MAX)
            wide.store(f32.load().to(dst.element_type))
        else:
            wide.store(raw.load().to(dst.element_type))
        if row >= valid_rows:
            wide.fill(0.0)
        cute.autovec_copy(wide, dst_pieces[None, (row, col)])
    cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMA's reads
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=THREADS_PER_WARPGROUP)
