"""FP8 latent bytes straight into WGMMA A-operand registers, for the transposed kernel
(transposed.py): no fp16 copy of a key block is ever written to shared memory.

A key block lands as nine TMA boxes of 64 keys x 64 e4m3 (4 KB each, rows of 64 bytes under
the 64-byte swizzle: 16-byte chunk c of row r at (c ^ ((r // 2) % 4)) * 16), so the eight rows
an ldmatrix phase reads fall in eight distinct bank groups. Two fragments come from it:

- K for S^T = K Q^T (A: 64 keys x 576 dims). ldmatrix (8 x 8 16-bit matrices, rows = keys, a
  row 16 e4m3 dims) gives lane l of its warp dims 4 (l % 4) .. 4 (l % 4) + 3 of key l // 4; the
  fragment wants dims 2q, 2q + 1 and 2q + 8, 2q + 9 (q = l % 4). Rather than move bytes between
  lanes, the contraction's order is permuted within each 16 dims (Q_PERMUTATION, logical dim L
  holds physical dim Q_PERMUTATION[L]) and Q's columns are stored in that order once per tile,
  so each 32-bit ldmatrix register converts to the fragment's two pairs as it is.
- V^T for O^T += V^T P^T (A: 512 dims x 64 keys). ldmatrix.trans gives lane l keys 2q, 2q + 1
  of dims 2 (l // 4), 2 (l // 4) + 1; one byte permute groups them by dim, and the two dims
  are taken as fragment rows g and g + 8 (g = l // 4): O^T's row g + 8 i of warp w's 16 in
  m-atom a holds dim 64 a + 16 w + 2 g + i (o_dim), which the merge at the end undoes.

e4m3 -> fp16 is exact and one cvt per two values (kernels/kv_dequant.py).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import dsl_user_op

from ..hopper_mma import asm_to_int32s
from ..v_transpose import byte_perm, ldmatrix_x4, ldmatrix_x4_trans
from .loads import BOX, TILES

STAGE_BYTES = TILES * BOX * BOX  # one key block's e4m3: nine 4 KB boxes
# Logical dim L of each 16 (a k-block of S^T) holds physical dim Q_PERMUTATION[L].
Q_PERMUTATION = tuple(4 * ((L % 8) // 2) + 2 * (L // 8) + L % 2 for L in range(16))
BY_DIM = 0x3120  # prmt: bytes (0, 2, 1, 3): two keys of dim 2g, then of dim 2g + 1


def stage_box_layout() -> cute.ComposedLayout:
    """One TMA box of a stage: 64 keys x 64 e4m3 under the 64-byte swizzle."""
    return cute.make_composed_layout(
        cute.make_swizzle(2, 4, 3), 0, cute.make_layout((BOX, BOX), stride=(BOX, 1))
    )


def box_offset(key: Int32, dim: int, dim_chunk: Int32 = 0) -> Int32:
    """Bytes from a stage's start to (key, dim + 16 dim_chunk) (dim a multiple of 16, within
    one box together with dim_chunk's chunks)."""
    chunk = (dim % BOX) // 16 + dim_chunk
    return (dim // BOX) * BOX * BOX + key * BOX + ((chunk ^ ((key // 2) % 4)) << 4)


@dsl_user_op
def e4m3x4_to_f16x2x2(packed: Int32, *, loc=None, ip=None):
    """Four e4m3 (one register) -> two f16x2 registers: bytes 0-1, then bytes 2-3."""
    return asm_to_int32s(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; "
        "cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r",
        [Int32(packed)],
        2,
        loc=loc,
        ip=ip,
    )


def o_dim(atom: int, warp: Int32, g: Int32, i: int) -> Int32:
    """The latent dim O^T's fragment row g + 8 i of warp `warp` holds in m-atom `atom`."""
    return atom * 64 + 16 * warp + 2 * g + i


class FragmentLoads:
    """One MMA thread's ldmatrix addresses into a stage and its fills of a 64 x 64 A fragment
    (four k-blocks, as Int32 pairs: pair p of k-block k at p + 4 k, p 0-3 the fragment's
    (row g, k 2q), (g + 8, 2q), (g, 2q + 8), (g + 8, 2q + 8))."""

    def __init__(self, lane: Int32, warp: Int32):
        self.warp = warp
        matrix, row = lane // 8, lane % 8
        # K: matrix j holds keys 16 w + 8 (j % 2) + row, dims 16 (j // 2) of each 32.
        self.k_key = 16 * warp + 8 * (matrix % 2) + row
        self.k_chunk = matrix // 2
        # V^T: matrix j holds keys 8 j + row of each 32, the warp's 16 dims of an m-atom.
        self.v_key = 8 * matrix + row

    @cute.jit
    def load_k(self, stage: Int32, box: int) -> list:
        """K's dims 64 box .. 64 box + 63 (four k-blocks of S^T) as e4m3, from the stage at smem
        address `stage`: two ldmatrix x4 (convert_k makes the fragment of them)."""
        raw = []
        for h2 in cutlass.range_constexpr(2):  # 32 dims: two k-blocks
            at = stage + box_offset(self.k_key, 64 * box + 32 * h2, self.k_chunk)
            raw.extend(ldmatrix_x4(at))
        return raw

    @cute.jit
    def convert_k(self, raw: list, pairs: cute.Tensor):
        """load_k's bytes into a 64 x 64 A fragment (pairs)."""
        for h2 in cutlass.range_constexpr(2):
            regs = raw[4 * h2 : 4 * h2 + 4]
            for h in cutlass.range_constexpr(2):
                g_rows = e4m3x4_to_f16x2x2(regs[2 * h])  # key g
                g8_rows = e4m3x4_to_f16x2x2(regs[2 * h + 1])  # key g + 8
                base = 4 * (2 * h2 + h)
                pairs[base + 0] = g_rows[0]
                pairs[base + 1] = g8_rows[0]
                pairs[base + 2] = g_rows[1]
                pairs[base + 3] = g8_rows[1]

    @cute.jit
    def load_v(self, stage: Int32, atom: int) -> list:
        """V^T's m-atom `atom` (dims 64 atom .., permuted as o_dim says) over the block's 64
        keys as e4m3, from the stage at smem address `stage`: two ldmatrix x4 transposed."""
        raw = []
        for half in cutlass.range_constexpr(2):  # keys 32 half ..
            key = 32 * half + self.v_key
            raw.extend(ldmatrix_x4_trans(stage + box_offset(key, 64 * atom, self.warp)))
        return raw

    @cute.jit
    def convert_v(self, raw: list, pairs: cute.Tensor):
        """load_v's bytes into a 64 x 64 A fragment (pairs): four k-blocks of 16 keys."""
        for half in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(4):
                r = raw[4 * half + j]
                dims = e4m3x4_to_f16x2x2(byte_perm(r, r, BY_DIM))
                base = 4 * (2 * half + j // 2) + 2 * (j % 2)
                pairs[base + 0] = dims[0]  # row g: dim 2g
                pairs[base + 1] = dims[1]  # row g + 8: dim 2g + 1
