"""Online softmax over the rows of a WGMMA score accumulator (fp32, base-2 exponentials).

softmax_scale * log2(e) is folded into one multiply-add per score: p = exp2(s * c - m * c).
O is rescaled only by the change of the row max, exp2((m_old - m_new) * c). Each thread keeps
a partial row sum over its own columns; the quad (4 threads sharing a row) reduces it once,
in finalize.

Some exponentials may go to the FMA pipe (fma_exp2_per_16): at head dim 64 a key block's 64 x N
exponentials keep the MUFU (16 per clock per SM) as busy as its two GEMMs keep the tensor
cores, so moving a few of them to a polynomial on the FMA pipe (128 per clock) was meant to
relieve the MUFU queue at the cost of ~9 issue slots each. Measured on H100 it is slower at
every head dim (PERF_NOTES.md); the table leaves it off, the knob stays for study.
"""

import math
import struct
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .hopper_mma import acc_as_rows_cols

LN2 = math.log(2.0)


def _ptx_f32(value: float) -> str:
    """A PTX fp32 literal (exact bit pattern)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


# 2^f ~ 1 + f (c1 + f (c2 + f (c3 + f c4))) on [-0.5, 0.5]: relative error 2.9e-6 in fp32
# (minimax with the constant fixed at 1, so integers x give exactly 2^x), below the rounding
# of P to fp16 (2.4e-4) or bf16 (2e-3).
_EXP2_POLY = (0.6931241750717163, 0.24024099111557007, 0.05590637028217316, 0.009582818485796452)
# x + 1.5 * 2^23 rounds x to an integer held in the low mantissa bits; shifted left by 23
# they add that integer to a float's exponent (the 1.5 * 2^23 part shifts out).
_ROUNDING_MAGIC = 12582912.0
_EXP2_ON_FMA_PTX = f"""{{
.reg .f32 x, t, r, f, p;
.reg .b32 ti, pi;
max.f32 x, $1, {_ptx_f32(-127.0)};
add.rn.f32 t, x, {_ptx_f32(_ROUNDING_MAGIC)};
sub.rn.f32 r, t, {_ptx_f32(_ROUNDING_MAGIC)};
sub.rn.f32 f, x, r;
fma.rn.f32 p, f, {_ptx_f32(_EXP2_POLY[3])}, {_ptx_f32(_EXP2_POLY[2])};
fma.rn.f32 p, p, f, {_ptx_f32(_EXP2_POLY[1])};
fma.rn.f32 p, p, f, {_ptx_f32(_EXP2_POLY[0])};
fma.rn.f32 p, p, f, {_ptx_f32(1.0)};
mov.b32 ti, t;
mov.b32 pi, p;
shl.b32 ti, ti, 23;
add.s32 pi, pi, ti;
mov.b32 $0, pi;
}}"""


@dsl_user_op
def exp2_on_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 15 (a row max lagging by rescale_threshold) without the MUFU:
    FADD/FFMA/integer ops only.

    x is clamped to -127 first: -127 gives exactly 0 (the integer -127 cancels the exponent
    of the polynomial's exact 1.0), anything in (-127, -126) a value below 2^-126, so masked
    scores (-inf) give 0 as ex2.approx.ftz does and a fully masked row keeps a zero sum."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _EXP2_ON_FMA_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def fma_exp2_columns(ncols: int, per_16: int) -> frozenset:
    """Which of a thread's ncols row columns use exp2_on_fma: per_16 of every 16, spread
    evenly (Bresenham), so the polynomial work interleaves with the MUFU's."""
    return frozenset(
        c for c in range(ncols) if ((c % 16) + 1) * per_16 // 16 > (c % 16) * per_16 // 16
    )


@cute.jit
def _quad_allreduce_max(x: Float32) -> Float32:
    # The 4 lanes holding one accumulator row are lane%4 = 0..3 of the same quad.
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def _quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


@cute.jit
def _row_max(row: cute.Tensor, ncols: cutlass.Constexpr[int]) -> Float32:
    # Four independent chains keep the FMNMX latency off the critical path.
    m = [row[0], row[1], row[2], row[3]]
    for c in cutlass.range_constexpr(4, ncols, 4):
        for j in cutlass.range_constexpr(4):
            m[j] = cute.arch.fmax(m[j], row[c + j])
    return cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))


@cute.jit
def _row_sum(row: cute.Tensor, ncols: cutlass.Constexpr[int]) -> Float32:
    s = [row[0], row[1], row[2], row[3]]
    for c in cutlass.range_constexpr(4, ncols, 4):
        for j in cutlass.range_constexpr(4):
            s[j] = s[j] + row[c + j]
    return (s[0] + s[1]) + (s[2] + s[3])


@cute.jit
def max_or_zero(row_max: Float32) -> Float32:
    """The max probabilities are taken against: a row with no key yet (max -inf) uses 0, so
    exp2 gives 0 rather than NaN."""
    return Float32(0.0) if row_max == -Float32.inf else row_max


@cute.jit
def max_rescale(row_max_prev: Float32, row_max_safe: Float32, scale_log2: Float32) -> Float32:
    """What a row's O and sum are multiplied by when its max moves from row_max_prev to
    row_max_safe (max_or_zero of the new one): 0 from a previous max of -inf (nothing to keep;
    2^(0 - max) could overflow to inf, and 0 * inf is NaN)."""
    return cute.math.exp2((row_max_prev - row_max_safe) * scale_log2, fastmath=True)


@dataclass(frozen=True)
class OnlineSoftmax:
    """Running row max and (per-thread partial) row sum for the rows a thread owns.

    Frozen: the DSL then treats it as read-only across dynamic control flow; the state lives in
    the register tensors it points to."""

    scale_log2: Float32
    num_rows: cutlass.Constexpr[int]
    row_max: cute.Tensor
    row_sum: cute.Tensor
    # rescale_threshold in units of raw scores (divided by scale_log2 once, in create).
    max_lag: Float32
    fma_exp2_per_16: cutlass.Constexpr[int] = 0  # of every 16 columns, how many use exp2_on_fma
    # A row keeps its max while a new one exceeds it by at most this (log2 units; 0: any
    # growth moves it), so P reaches 2^threshold and O is rescaled less often.
    rescale_threshold: cutlass.Constexpr[int] = 0
    # Probabilities are computed as 2^max_offset times their value (an FP8 P's range): the row
    # sums carry the same factor, so O / row sum does not change, and the LSE drops it.
    max_offset: cutlass.Constexpr[int] = 0

    @staticmethod
    def create(
        scale_log2: Float32,
        num_rows: int,
        fma_exp2_per_16: int = 0,
        rescale_threshold: int = 0,
        max_offset: int = 0,
    ) -> "OnlineSoftmax":
        max_lag = (
            Float32(rescale_threshold) / scale_log2
            if const_expr(rescale_threshold > 0)
            else Float32(0.0)
        )
        return OnlineSoftmax(
            scale_log2,
            num_rows,
            cute.make_rmem_tensor(num_rows, Float32),
            cute.make_rmem_tensor(num_rows, Float32),
            max_lag,
            fma_exp2_per_16,
            rescale_threshold,
            max_offset,
        )

    @cute.jit
    def step(
        self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool], halves=None
    ) -> cute.Tensor:
        """Turn scores into unnormalized probabilities in place; return the O rescale per row.
        halves (ScoreHalves): the scores are this warpgroup's half of the key block, and the
        row maxima are taken over both halves."""
        scores = acc_as_rows_cols(acc_S)
        ncols = cute.size(scores, mode=[1])
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        if const_expr(halves is None):
            for r in cutlass.range_constexpr(self.num_rows):
                row = cute.make_rmem_tensor(ncols, Float32)
                row.store(scores[r, None].load())
                row_max = _row_max(row, ncols)
                if const_expr(not is_first):
                    row_max = cute.arch.fmax(row_max, self.row_max[r])
                row_max = _quad_allreduce_max(row_max)
                row_max_prev = self.row_max[r]
                if const_expr(self.rescale_threshold > 0 and not is_first):
                    # The bound depends on the old max only, so it is ready before the new max
                    # is reduced: one compare and select after it. An old max of -inf (no keys
                    # so far) gives a bound of -inf, which any new max but -inf passes.
                    if row_max <= row_max_prev + self.max_lag:
                        row_max = row_max_prev
                self._exponentiate(scores, row, r, row_max, row_max_prev, is_first, row_scale)
        else:
            # Every row's max first, then one exchange for all of them.
            maxes = cute.make_rmem_tensor(self.num_rows, Float32)
            for r in cutlass.range_constexpr(self.num_rows):
                row_max = _row_max(scores[r, None], ncols)
                if const_expr(not is_first):
                    row_max = cute.arch.fmax(row_max, self.row_max[r])
                maxes[r] = _quad_allreduce_max(row_max)
            halves.combine(maxes, is_max=True)
            for r in cutlass.range_constexpr(self.num_rows):
                row = cute.make_rmem_tensor(ncols, Float32)
                row.store(scores[r, None].load())
                self._exponentiate(scores, row, r, maxes[r], self.row_max[r], is_first, row_scale)
        return row_scale

    @cute.jit
    def _exponentiate(
        self,
        scores: cute.Tensor,
        row: cute.Tensor,
        r: cutlass.Constexpr[int],
        row_max: Float32,
        row_max_prev: Float32,
        is_first: cutlass.Constexpr[bool],
        row_scale: cute.Tensor,
    ):
        """Row r's new max in place, its scores (a register copy in `row`) to probabilities,
        its running sum and O rescale."""
        ncols = cute.size(row)
        self.row_max[r] = row_max
        # A row masked out so far has max -inf: use 0 so exp2 gives 0, not NaN.
        row_max_safe = max_or_zero(row_max)
        max_scaled = row_max_safe * self.scale_log2
        if const_expr(self.max_offset):
            max_scaled = max_scaled - Float32(self.max_offset)
        on_fma = fma_exp2_columns(ncols, self.fma_exp2_per_16)
        for c in cutlass.range_constexpr(ncols):
            if const_expr(c in on_fma):
                row[c] = exp2_on_fma(row[c] * self.scale_log2 - max_scaled)
            else:
                row[c] = cute.math.exp2(row[c] * self.scale_log2 - max_scaled, fastmath=True)
        row_sum = _row_sum(row, ncols)
        if const_expr(is_first):
            row_scale[r] = Float32(1.0)
            self.row_sum[r] = row_sum
        else:
            scale = max_rescale(row_max_prev, row_max_safe, self.scale_log2)
            row_scale[r] = scale
            self.row_sum[r] = self.row_sum[r] * scale + row_sum
        scores[r, None].store(row.load())

    @cute.jit
    def combine_halves(self, halves):
        """After the last key block of a split_scores tile: the row sums over both halves of
        the key blocks (this thread's partial sums reduced over its quad, exchanged, and left
        on the quad's first lane, so that finalize's quad sum gives the total)."""
        sums = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            sums[r] = _quad_allreduce_sum(self.row_sum[r])
        halves.combine(sums, is_max=False)
        for r in cutlass.range_constexpr(self.num_rows):
            self.row_sum[r] = sums[r] if halves.writer else Float32(0.0)

    @cute.jit
    def finalize(self, sink_log2: cute.Tensor = None) -> tuple:
        """Return (1/row_sum, natural-log LSE) per row; an empty row gives (1, -inf).

        sink_log2: per row, a learnable sink logit times log2(e) (-inf where a row has none),
        one more term of the softmax's denominator with no value row: the rows' output is
        divided by it too and their LSE includes it. A row that saw no key then gets out = 0
        and lse = the sink. The sum is taken against max(row max, sink), so a sink far above
        the scores cannot overflow it."""
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row_sum = _quad_allreduce_sum(self.row_sum[r])
            empty = row_sum == 0.0 or row_sum != row_sum
            if const_expr(sink_log2 is None):
                inv_sum[r] = cute.arch.rcp_approx(Float32(1.0) if empty else row_sum)
                lse[r] = (
                    -Float32.inf
                    if empty
                    else (self._sum_reference(r) + cute.math.log2(row_sum, fastmath=True)) * LN2
                )
            else:
                row_max = -Float32.inf if empty else self._sum_reference(r)
                sink = sink_log2[r]
                top = cute.arch.fmax(row_max, sink)
                if top == -Float32.inf:  # no key and no sink
                    inv_sum[r] = Float32(1.0)
                    lse[r] = -Float32.inf
                else:
                    # O holds sum exp2(s - row_max) v: divide by the sum over the scores and
                    # the sink, both taken against top.
                    scores_weight = cute.math.exp2(row_max - top, fastmath=True)
                    denom = (Float32(0.0) if empty else row_sum) * scores_weight
                    denom = denom + cute.math.exp2(sink - top, fastmath=True)
                    inv_sum[r] = scores_weight * cute.arch.rcp_approx(denom)
                    lse[r] = (top + cute.math.log2(denom, fastmath=True)) * LN2
        return inv_sum, lse

    def _sum_reference(self, r: int) -> Float32:
        """Row r's sum is of exp2 against this (log2 units): its max, less max_offset."""
        ref = self.row_max[r] * self.scale_log2
        if const_expr(self.max_offset):
            ref = ref - Float32(self.max_offset)
        return ref


@dataclass(frozen=True)
class ScoreHalves:
    """Two warpgroups sharing a tile's rows, each with the scores of half of every key block
    (AttentionConfig.split_scores): their row maxima, and at the end their row sums, meet in
    shared memory.

    smem: (2, 2, tile_m) fp32: (max or sum, warpgroup, tile row). rows: (num_rows,) Int32, the
    tile rows of the thread's accumulator rows. writer: the thread is the first lane of its
    quad (the four lanes holding a row, which agree after their reduction)."""

    smem: cute.Tensor
    rows: cute.Tensor
    warpgroup: Int32
    writer: cutlass.Boolean
    barrier_id: cutlass.Constexpr[int]
    num_threads: cutlass.Constexpr[int]

    @cute.jit
    def combine(self, values: cute.Tensor, is_max: cutlass.Constexpr[bool]):
        """values[r] (this warpgroup's, per accumulator row) becomes the max or sum of both
        warpgroups'. The barrier also orders this exchange after the other warpgroup's reads
        of the previous one (each passes at least one more barrier per key block, after P is
        written, before writing again: kernels/forward/mainloop.py, _scores_to_p)."""
        which = 0 if const_expr(is_max) else 1
        if self.writer:
            for r in cutlass.range_constexpr(cute.size(values)):
                self.smem[which, self.warpgroup, self.rows[r]] = values[r]
        cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.num_threads)
        for r in cutlass.range_constexpr(cute.size(values)):
            other = self.smem[which, 1 - self.warpgroup, self.rows[r]]
            if const_expr(is_max):
                values[r] = cute.arch.fmax(values[r], other)
            else:
                values[r] = values[r] + other


@cute.jit
def apply_softcap(acc_S: cute.Tensor, prescale: Float32):
    """Scores in place to tanh(s * prescale), prescale = softmax_scale / softcap: the softmax
    then takes softcap * log2(e) as its scale, so s' = softcap * tanh(s * scale / softcap)."""
    for i in cutlass.range_constexpr(cute.size(acc_S)):
        acc_S[i] = cute.math.tanh(acc_S[i] * prescale, fastmath=True)


@cute.jit
def rescale_rows(acc_O: cute.Tensor, row_scale: cute.Tensor):
    """Multiply each row of a WGMMA accumulator by its scale."""
    out = acc_as_rows_cols(acc_O)
    for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
            out[r, c] = out[r, c] * row_scale[r]


@cute.jit
def rescale_rows_if_any_changed(acc_O: cute.Tensor, row_scale: cute.Tensor):
    """rescale_rows, skipped when no row of the warp has a scale other than 1 (no row max
    moved): once the maxima settle, most key blocks leave every row's max where it was."""
    changed = row_scale[0] != Float32(1.0)
    for r in cutlass.range_constexpr(1, cute.size(row_scale)):
        changed = changed | (row_scale[r] != Float32(1.0))
    if cute.arch.vote_any_sync(changed):
        rescale_rows(acc_O, row_scale)
