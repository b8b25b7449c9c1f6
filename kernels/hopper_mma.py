"""WGMMA plumbing for Hopper attention kernels.

Shared-memory layouts for row-major tiles, tiled-MMA construction, issuing a warpgroup GEMM,
and the register-layout views of a WGMMA accumulator (as rows x columns, and as the A operand
of a following register-sourced WGMMA).

Accumulator layout of one m64nNk16 WGMMA, per thread: ((2, 2, N/8), MMA_M, MMA_N) where the
first mode is (column pair, row half, column group of 8). A thread owns rows lane/4 and
lane/4 + 8 of its warp's 16 rows, and columns 2*(lane%4) + {0, 1} + 8*j.
"""

from typing import Optional, Type

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum


def make_row_major_smem_layout(
    dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: Optional[int] = None
):
    """Swizzled smem layout of a (rows, cols) tile whose cols are contiguous, optionally staged.

    The swizzle width is the widest (128/64/32 bytes) that divides one row, so the same layout
    serves TMA, the K-major WGMMA operand and (through a transposed view) the MN-major one.
    """
    atom_kind = hopper_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def column_block_layout(
    dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int, stage_stride: int
):
    """The layout of `cols` columns of a staged (rows, wider, stages) tile laid out by
    make_row_major_smem_layout, from one of its 64-column blocks on: a (rows, cols, stages)
    layout with the wider tile's stage stride (both widths multiples of 64 elements, so one
    swizzle atom and the same column-block stride; column c starts rows * c elements in)."""
    narrow = make_row_major_smem_layout(dtype, rows, cols, stages)
    outer = cute.make_layout(narrow.outer.shape, stride=(*narrow.outer.stride[:2], stage_stride))
    return cute.make_composed_layout(narrow.inner, 0, outer)


def column_slice(t: cute.Tensor, first: int, cols: int) -> cute.Tensor:
    """Columns first .. first + cols of a (rows, wider[, stages]) smem tile laid out by
    make_row_major_smem_layout (first and cols multiples of 64: whole swizzle columns, which
    start rows * 64 elements apart), as a tile of that layout (the swizzle rides on t's
    iterator)."""
    rows = cute.size(t, mode=[0])
    if const_expr(cute.rank(t) == 2):
        layout = make_row_major_smem_layout(t.element_type, rows, cols)
    else:
        stages = cute.size(t, mode=[2])
        layout = column_block_layout(t.element_type, rows, cols, stages, t.layout.stride[2])
    return cute.make_tensor(t.iterator + first * rows, layout.outer)


def transpose_smem_view(t: cute.Tensor) -> cute.Tensor:
    """View a (rows, cols, ...) smem tensor as (cols, rows, ...) without moving data."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def permute_modes(t: cute.Tensor, modes) -> cute.Tensor:
    """Reorder the modes of a tensor (a view)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=list(modes)))


def make_tiled_mma(
    dtype: Type[cutlass.Numeric],
    num_warpgroups: int,
    tile_n: int,
    b_mn_major: bool,
    a_from_registers: bool,
    split_n: int = 1,
) -> cute.TiledMma:
    """A WGMMA of `dtype` (16-bit, or e4m3 with both operands K-major) with fp32 accumulation,
    warpgroups stacked along M (64 rows each); with split_n, that many warpgroups share each
    64 rows and take tile_n / split_n columns each (warpgroup w: columns of part w, when
    num_warpgroups is 1)."""
    return hopper_helpers.make_trivial_tiled_mma(
        dtype,
        dtype,
        OperandMajorMode.K,
        OperandMajorMode.MN if b_mn_major else OperandMajorMode.K,
        Float32,
        atom_layout_mnk=(num_warpgroups, split_n, 1),
        tiler_mn=(64, tile_n // split_n),
        a_source=warpgroup.OperandSource.RMEM if a_from_registers else warpgroup.OperandSource.SMEM,
    )


@cute.jit
def warpgroup_gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    frag_a: cute.Tensor,
    frag_b: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wait_groups: cutlass.Constexpr[int],
):
    """acc (+)= A @ B over all k-blocks as one WGMMA commit group.

    wait_groups >= 0 waits until at most that many groups are in flight; -1 returns at once.
    """
    warpgroup.fence()
    # A fresh atom: its ACCUMULATE field is mutated per k-block.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(frag_a.shape[2])):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait_groups >= 0):
        warpgroup.wait_group(wait_groups)


@cute.jit
def issue_k_blocks(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    frag_a: cute.Tensor,
    frag_b: cute.Tensor,
    k_blocks: cutlass.Constexpr,
    accumulate: cutlass.Constexpr[bool],
):
    """Issue acc (+)= A @ B over the fragments' k-blocks first .. end - 1 (k_blocks: (first,
    end)), within a commit group the caller opens (warpgroup.fence) and closes
    (warpgroup.commit_group); accumulate False zeroes acc at the first k-block."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(k_blocks[0], k_blocks[1]):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)


def _acc_rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    # ((2, 2, N/8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N/8, MMA_N)): rows first, then columns.
    flat = cute.make_layout(acc_layout.shape)
    shape = (
        (flat.shape[0][1], flat.shape[1]),
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
    )
    stride = (
        (flat.stride[0][1], flat.stride[1]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a WGMMA accumulator (or its partition of an identity tensor) as (rows, cols)."""
    return cute.make_tensor(acc.iterator, _acc_rows_cols_layout(acc.layout))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator ((2, 2, N/8), MMA_M, MMA_N) as a register A operand
    ((2, 2, 2), MMA_M, (N/16, MMA_N)) of a following k16 WGMMA (N a multiple of 16)."""
    layout = acc.layout
    split = cute.logical_divide(layout, ((None, None, 2), None, None))
    shape = (
        (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
        split.shape[1],
        (split.shape[0][2][1], split.shape[2]),
    )
    stride = (
        (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
        split.stride[1],
        (split.stride[0][2][1], split.stride[2]),
    )
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


def _inline_asm(result_type, asm: str, constraints: str, operands, side_effects, loc, ip):
    return llvm.inline_asm(
        result_type,
        [x.ir_value(loc=loc, ip=ip) for x in operands],
        asm,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def asm_to_int32(
    asm: str, constraints: str, operands, side_effects=False, *, loc=None, ip=None
) -> Int32:
    """The 32-bit result ($0) of an inline PTX snippet over DSL operands (side_effects: kept
    in place, as barriers must be)."""
    return Int32(_inline_asm(T.i32(), asm, constraints, operands, side_effects, loc, ip))


def asm_to_int32s(
    asm: str, constraints: str, operands, count: int, side_effects=False, *, loc=None, ip=None
) -> list:
    """The count 32-bit results ($0 .. $count-1) of an inline PTX snippet over DSL operands
    (side_effects: kept in place, as loads from shared memory must be)."""
    i32 = T.i32()
    struct = llvm.StructType.get_literal([i32] * count)
    result = _inline_asm(struct, asm, constraints, operands, side_effects, loc, ip)
    return [Int32(llvm.extractvalue(i32, result, [i], loc=loc, ip=ip)) for i in range(count)]


def barrier_any(barrier_id, threads: int, pred) -> cutlass.Boolean:
    """Named barrier barrier_id over `threads` threads (barrier.red.or, the id in a register):
    whether pred held in any of them. Its phases must not mix with bar.sync / arrive phases
    of the same barrier that are still open (every thread of it reaches the same one)."""
    result = asm_to_int32(
        "{ .reg .pred p_in, p_out; setp.ne.s32 p_in, $1, 0; "
        f"barrier.red.or.pred p_out, $2, {threads}, p_in; selp.s32 $0, 1, 0, p_out; }}",
        "=r,r,r",
        [Int32(pred), Int32(barrier_id)],
        side_effects=True,
    )
    return result != 0


@dsl_user_op
def pack_f32x2_to_16bit(a: Float32, b: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """Round two fp32 values to one packed bf16x2/f16x2 register (a in the low half)."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return asm_to_int32(
        f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", [Float32(a), Float32(b)], loc=loc, ip=ip
    )


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """dst = src rounded to dst's 16-bit type, two elements per cvt instruction.

    Written out because TensorSSA.to() does not always pair the conversions.
    """
    dst_pairs = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_pairs)):
        dst_pairs[i] = pack_f32x2_to_16bit(src[2 * i], src[2 * i + 1], dst.element_type)


@dsl_user_op
def pack_f32x4_to_e4m3(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None):
    """Round four fp32 values to e4m3 (saturating to +-448) in one register, a in the lowest
    byte."""
    return asm_to_int32(
        "{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};\n}",
        "=r,f,f,f,f",
        [Float32(x) for x in (a, b, c, d)],
        loc=loc,
        ip=ip,
    )


@cute.jit
def pack_p_e4m3(acc: cute.Tensor, frag: cute.Tensor):
    """A score accumulator ((2, 2, N/8), 1, 1) fp32 as the e4m3 A operand ((4, 2, 2), 1, N/32)
    of an FP8 P V WGMMA, keys permuted within each 32 as kernels/v_transpose.py lays out V^T:
    register (row half rh, half h, k-block kb) holds column groups 4 kb + 2h and 4 kb + 2h + 1,
    two columns each, in that order."""
    regs = cute.recast_tensor(frag, Int32)  # ((1, 2, 2), 1, N/32): rh + 2h + 4 kb
    for kb in cutlass.range_constexpr(cute.size(regs) // 4):
        for h in cutlass.range_constexpr(2):
            group = 4 * kb + 2 * h
            for rh in cutlass.range_constexpr(2):
                regs[rh + 2 * h + 4 * kb] = pack_f32x4_to_e4m3(
                    acc[2 * rh + 4 * group],
                    acc[1 + 2 * rh + 4 * group],
                    acc[2 * rh + 4 * (group + 1)],
                    acc[1 + 2 * rh + 4 * (group + 1)],
                )
