"""FP8 V blocks transposed in shared memory, for the FP8 P V GEMM.

An e4m3 WGMMA reads both operands K-major from shared memory: for O = P V that is V^T, each
of V's head-dim columns with its keys contiguous, while V arrives as key rows. The producer
warpgroup's spare warps (the converting warps of a 16-bit-math FP8 cache) transpose each V
block the loading warps bring in (the TMA warp, or FP8_MATH_GATHER_WARPS gathering warps), from
the FP8 ring (tile_n, dv) into the MMA warps' ring (dv, tile_n).

P comes from registers: the fp32 score accumulator, cast to e4m3, is the A operand. Its 8-bit
fragment holds keys {4q .. 4q+3, 16+4q .. 16+4q+3} of each 32 in thread q of a quad, where the
accumulator holds {2q, 2q+1} + 8j. Rather than moving P between threads, the keys of V^T are
permuted within each 32 to match: position 16h + 4q + i of V^T holds key
16h + 8 (i // 2) + 2q + i % 2, and P's four accumulator values (column groups 2h, 2h+1 of the
32, their two columns each) pack into one 32-bit register in that order (hopper_mma.
pack_p_e4m3). Then P V needs no permutation of O either.

A warp moves 32 keys x 16 columns per step: ldmatrix.trans (8 x 8 16-bit matrices: each lane
gets two consecutive keys of two consecutive columns), two byte permutes per register pair
(keys 2q, 2q+1, 8+2q, 9+2q of one column), stmatrix into V^T rows. The 8 rows of each
stmatrix matrix are head-dim columns with distinct residues mod 8 (in matrices 0 and 2 the
even columns of the first four rows, the odd ones of the last four; 1 and 3 the others), so
neither instruction has bank conflicts under the 32-, 64- or 128-byte swizzles
(kernels/hopper_mma.make_row_major_smem_layout; tests/test_v_transpose.py checks every step).
"""

from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .hopper_mma import asm_to_int32, asm_to_int32s
from .kv_dequant import ConvertingBlockLoader

# Producer warps that gather an FP8 cache's rows (pages no TMA box follows) with FP8 math;
# the fourth transposes V. (H100, page 16, GQA 32 / 8, d128, batch 8 x 32k: two gathering
# and two transposing 258 us, three and one 223, one and three 352.)
FP8_MATH_GATHER_WARPS = 3
KEYS_PER_STEP = 32  # a warp's keys per step: one group of V^T's permutation
COLUMNS_PER_STEP = 16  # a warp's head-dim columns per step: one 16-byte ldmatrix row
# prmt selectors: bytes 0 and 2 of two registers (a column's keys), or bytes 1 and 3.
EVEN_COLUMN, ODD_COLUMN = 0x6420, 0x7531


@dsl_user_op
def ldmatrix_x4(address: Int32, trans: bool = False, *, loc=None, ip=None):
    """Four 8 x 8 16-bit matrices from shared memory (lanes 8j .. 8j+7 give the row addresses
    of matrix j); lane l gets, of each, the elements (l // 4, 2 (l % 4) + e), or with trans
    (2 (l % 4) + e, l // 4), e = 0, 1."""
    return asm_to_int32s(
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
        "{$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        [Int32(address)],
        4,
        side_effects=True,
        loc=loc,
        ip=ip,
    )


def ldmatrix_x4_trans(address: Int32):
    """ldmatrix_x4 transposed: lane l gets, of each matrix, the elements (2 (l % 4) + e,
    l // 4)."""
    return ldmatrix_x4(address, True)


@dsl_user_op
def stmatrix_x4(address: Int32, regs, *, loc=None, ip=None):
    """Four 8 x 8 16-bit matrices to shared memory (lanes 8j .. 8j+7 give the row addresses of
    matrix j); lane l gives, of each, row l // 4's elements 2 (l % 4) and 2 (l % 4) + 1."""
    llvm.inline_asm(
        None,
        [Int32(address).ir_value(loc=loc, ip=ip)]
        + [Int32(r).ir_value(loc=loc, ip=ip) for r in regs],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    """prmt.b32: four bytes picked from (b:a) by the selector's nibbles."""
    return asm_to_int32(
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [Int32(x) for x in (a, b, selector)], loc=loc, ip=ip
    )


def _atom_bytes(width: int) -> int:
    """The swizzle atom's width of an 8-bit row-major smem tile `width` bytes wide (the widest
    of 128, 64, 32 dividing it: hopper_mma.make_row_major_smem_layout's choice)."""
    return next(a for a in (128, 64, 32) if width % a == 0)


def _row_xor(row: Int32, width: int) -> Int32:
    """The swizzle's XOR of a row's byte offsets in such a tile (Swizzle<3|2|1, 4, 3>: the
    16-byte chunk index XOR the row's bits 0-2, 1-2 or 2; a function of row % 8 alone)."""
    atom = _atom_bytes(width)
    if cutlass.const_expr(atom == 128):
        return (row % 8) << 4
    if cutlass.const_expr(atom == 64):
        return ((row // 2) % 4) << 4
    return ((row // 4) % 2) << 4


def _offset(rows: int, width: int, row: Int32, col: Int32, row_xor: Int32) -> Int32:
    """The byte offset of (row, col) in a (rows, width) 8-bit tile laid out by
    make_row_major_smem_layout (atoms of 8 rows x atom bytes, a column of atoms after
    another): col a multiple of 16, row_xor the row's _row_xor."""
    atom = _atom_bytes(width)
    return (col // atom) * (rows * atom) + row * atom + ((col % atom) ^ row_xor)


def lane_selectors(lane):
    """(prmt selector of V^T's register pairs 0-1, of 2-3) of a lane: the lane's register of
    matrices 0 and 2 (positions 0..15, 16..31) is V^T row 2r + (r >= 4) of its 16, of 1 and 3
    row 2r + 1 - (r >= 4) (r = lane // 4: its row in the matrix)."""
    high = (lane // 4) // 4  # (0 or 1: r >= 4)
    return EVEN_COLUMN + high * (ODD_COLUMN - EVEN_COLUMN), ODD_COLUMN - high * (
        ODD_COLUMN - EVEN_COLUMN
    )


def _lane_bases(lane: Uint32, tile_n: int, width: int):
    """(load base, load XOR, store base, store XOR) of a lane: its part of every step's
    addresses (_step_offsets). Steps move keys by 32 and columns by 16, rows by multiples of
    8, so each lane's swizzle XORs are fixed: it loads row `lane` of the step's keys, and
    stores V^T row (store column) of matrix lane // 8's row lane % 8 at key position 0 or 16."""
    store_matrix, store_row = lane // 8, lane % 8
    # Matrices 0 and 2: column 2r + (r >= 4); 1 and 3: 2r + 1 - (r >= 4) (r: store_row).
    store_column = 2 * store_row + ((store_row // 4) ^ (store_matrix % 2))
    store_position = (store_matrix // 2) * 16
    return (
        lane * _atom_bytes(width),
        _row_xor(lane, width),
        store_column * _atom_bytes(tile_n),
        # (a step's keys start at a multiple of 32 and the position is 0 or 16: adding it sets
        # a free bit, so the store's XOR applies to position and key bits alike)
        store_position ^ _row_xor(store_column, tile_n),
    )


def _step_constants(step: int, tile_n: int, width: int):
    """(load constant, load chunk, store constant, store chunk) of a step (Python ints): a
    lane's load offset is load constant + load base + (load chunk ^ load XOR), its store
    offset the same of the store's parts (_lane_bases)."""
    key0, column = _step_place(step, width)
    atom, atom_t = _atom_bytes(width), _atom_bytes(tile_n)
    return (
        (column // atom) * (tile_n * atom) + key0 * atom,
        column % atom,
        (key0 // atom_t) * (width * atom_t) + column * atom_t,
        key0 % atom_t,
    )


def _step_place(step, width: int):
    """(first key, first column) of a step's 32 keys x 16 columns (steps go along a key
    group's columns, then the next group's); a Python int or a DSL value."""
    column_steps = width // COLUMNS_PER_STEP
    return step // column_steps * KEYS_PER_STEP, step % column_steps * COLUMNS_PER_STEP


def step_count(tile_n: int, width: int) -> int:
    """Steps of a (tile_n, width) block."""
    return tile_n // KEYS_PER_STEP * (width // COLUMNS_PER_STEP)


def _step_offsets(bases, constants):
    """(load, store) of a lane's step: byte offsets within a stage of the FP8 ring and of
    V^T's, or addresses where the bases include the stages' (bases: the lane's _lane_bases;
    constants: the step's _step_constants)."""
    load_base, load_xor, store_base, store_xor = bases
    load, load_chunk, store, store_chunk = constants
    return (
        load_base + (load_xor ^ load_chunk) + load,
        store_base + (store_xor ^ store_chunk) + store,
    )


def _zeroed_key(step, lane, width: int):
    """The key (FP8 ring row) a lane reads in a step: zeroed first past the sequence."""
    return _step_place(step, width)[0] + lane


def _zeroed_offset(step, key, load_xor, tile_n: int, width: int):
    """The byte offset of that row's 16 bytes in the step (load_xor: the lane's)."""
    return _offset(tile_n, width, key, _step_place(step, width)[1], load_xor)


def _batch_size(batch: int, num_warps: int) -> int:
    """Steps whose loads go before their stores (no load waits out a store): `batch`, but one
    for a lone transposing warp beside gathering warps, whose copies hold registers (two
    spilled 12 bytes there)."""
    return batch if num_warps > 1 else 1


def warp_steps(warp: int, num_warps: int, tile_n: int, width: int):
    """The steps warp `warp` of num_warps transposes, in order (every num_warps-th: the
    warps split each block evenly to within a step)."""
    return range(warp, step_count(tile_n, width), num_warps)


@dsl_user_op
def store_zeros_16(address: Int32, *, loc=None, ip=None):
    """16 zero bytes to shared memory at `address`."""
    zero = Int32(0).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [Int32(address).ir_value(loc=loc, ip=ip), zero],
        "st.shared.v4.b32 [$0], {$1, $1, $1, $1};",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def transpose_block(
    src: cute.Tensor,
    dst: cute.Tensor,
    stage: Int32,
    lane: Int32,
    warp: Int32,
    num_warps: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    width: cutlass.Constexpr[int],
    valid_rows: Int32,
    batch: cutlass.Constexpr[int],
):
    """dst (width, tile_n) = src (tile_n, width) transposed, keys permuted within each 32 as
    the module says, by num_warps warps (this one: `warp`, warp-uniform; lane `lane`); keys
    from valid_rows on written as zeros (a cache's slots past the sequence may hold anything,
    NaN included, and P is 0 there: 0 * NaN must not reach O). src, dst: the (rows, cols,
    stages) rings, compact. Each warp's steps are unrolled on its own branch, so a step's
    addresses are a lane's bases plus constants: an XOR and an add each, in few registers.
    Each thread then makes its stores visible to the async proxy (the WGMMAs)."""
    lane = Uint32(lane)  # (unsigned: divisions by powers of two are shifts)
    stage_bytes = tile_n * width
    src_address = src.iterator.toint() + stage * stage_bytes
    dst_address = dst.iterator.toint() + stage * stage_bytes
    load_base, load_xor, store_base, store_xor = _lane_bases(lane, tile_n, width)
    # (a step's addresses: these plus its constants)
    bases = (
        Int32(src_address + load_base),
        Int32(load_xor),
        Int32(dst_address + store_base),
        Int32(store_xor),
    )
    select_a, select_b = (Int32(x) for x in lane_selectors(lane))
    size = _batch_size(batch, num_warps)
    for w in cutlass.range_constexpr(num_warps):
        if warp == w:
            steps = list(warp_steps(w, num_warps, tile_n, width))
            places = [_step_constants(step, tile_n, width) for step in steps]
            if valid_rows < tile_n:
                # Rows past the sequence zeroed in the FP8 stage first (each lane its own
                # 16 bytes of each of its steps' loads), so the steps need no masks; a loop,
                # not unrolled (a tile's last block only), in few registers.
                for j in cutlass.range(len(steps), unroll=1):
                    step = Uint32(j) * num_warps + w
                    key = _zeroed_key(step, lane, width)
                    if Int32(key) >= valid_rows:
                        store_zeros_16(
                            src_address + _zeroed_offset(step, key, bases[1], tile_n, width)
                        )
                cute.arch.sync_warp()
            for first in cutlass.range_constexpr(0, len(steps), size):
                batch_places = places[first : first + size]
                regs = [ldmatrix_x4_trans(_step_offsets(bases, place)[0]) for place in batch_places]
                for place, r in zip(batch_places, regs):
                    stmatrix_x4(
                        _step_offsets(bases, place)[1],
                        [
                            byte_perm(r[0], r[1], select_a),
                            byte_perm(r[0], r[1], select_b),
                            byte_perm(r[2], r[3], select_a),
                            byte_perm(r[2], r[3], select_b),
                        ],
                    )
    cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMAs' reads


@dataclass(frozen=True)
class TransposingBlockLoader(ConvertingBlockLoader):
    """ConvertingBlockLoader's handoff (FP8 ring -> the MMA warps' ring, in the loading
    warps' order) with V's transpose as the work: src (tile_n, dv, stages) FP8, dst (dv, tile_n,
    stages) FP8; batch: AttentionConfig.transpose_batch."""

    batch: int = field(kw_only=True)  # (no default: the config's is the one)

    @cute.jit
    def fill(self, stage: Int32, valid: Int32):
        transpose_block(
            self.src,
            self.dst,
            stage,
            self.thread % 32,
            cute.arch.make_warp_uniform(self.thread // 32),
            self.num_threads // 32,
            self.tile_n,
            cute.size(self.src, mode=[1]),
            valid,
            self.batch,
        )


@dataclass(frozen=True)
class SkippedBlockLoader:
    """A loader that loads nothing: the transposing warps walk the loading warps' order of K and
    V loads, but only V's blocks are theirs."""

    def load(self, n_block: Int32, state):
        pass
