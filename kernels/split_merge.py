"""Merging split-KV partial results of one row (the LSE combine's math), shared by the combine
kernel and the split forward kernel's in-kernel merge.

For a row with splits k: lse = log(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) * out_k,
where out_k is split k's output normalized over its own keys. Splits with lse_k = -inf (empty)
add nothing: their out_k is loaded with the others (the loads run ahead of the check) but never
used, so it may hold anything, NaN included; a row whose splits are all empty gets out = 0
and lse = -inf.

A row is handled by a group of lanes of one warp (`lanes_per_row`, a power of two), each lane
owning `head_dim // group` consecutive floats of the head dim: the fp32 partials stream in with
16-byte loads and the LSE reductions are butterflies inside the group.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


def lanes_per_row(head_dim: int) -> int:
    """The largest power of two <= 32 dividing head_dim / 4 (whole 16-byte chunks per lane;
    a power of two keeps the butterfly reductions inside the row's group)."""
    assert head_dim % 8 == 0
    lanes = 32
    while (head_dim // 4) % lanes:
        lanes //= 2
    return lanes


@cute.jit
def group_allreduce(
    x: Float32, group: cutlass.Constexpr[int], is_max: cutlass.Constexpr[bool]
) -> Float32:
    """Max or sum of x over the `group` consecutive lanes sharing a row (all 32 lanes of the
    warp must call it)."""
    offset = group // 2
    while const_expr(offset > 0):
        other = cute.arch.shuffle_sync_bfly(x, offset=offset)
        x = cute.arch.fmax(x, other) if const_expr(is_max) else x + other
        offset //= 2
    return x


@cute.jit
def merge_row(
    lse_splits: cute.Tensor,
    o_splits: cute.Tensor,
    sub: Int32,
    group: cutlass.Constexpr[int],
    acc: cute.Tensor,
) -> Float32:
    """Merge one row's splits; every lane of the warp must call it (rows of no interest merge
    some valid row and skip their stores). An empty split's out_k is loaded but not used.

    lse_splits: (K,) fp32 natural-log LSEs; o_splits: (K, head_dim) fp32, last mode contiguous.
    sub: this lane's index in the row's group; acc: (head_dim // group,) fp32 registers, gets
    the lane's chunk of the merged row. Returns the merged lse (on every lane of the group).
    """
    num_splits = lse_splits.shape[0]
    floats = cute.size(acc)
    lse_max = -Float32.inf
    for k in cutlass.range(sub, num_splits, group, unroll=1):
        lse_max = cute.arch.fmax(lse_max, lse_splits[k])
    lse_max = group_allreduce(lse_max, group, is_max=True)
    max_safe = Float32(0.0) if lse_max == -Float32.inf else lse_max
    sum_exp = Float32(0.0)
    for k in cutlass.range(sub, num_splits, group, unroll=1):
        sum_exp += cute.math.exp2((lse_splits[k] - max_safe) * LOG2_E, fastmath=True)
    sum_exp = group_allreduce(sum_exp, group, is_max=False)
    empty = sum_exp == 0.0
    lse = -Float32.inf if empty else max_safe + cute.math.log2(sum_exp, fastmath=True) * LN2

    acc.fill(0.0)
    if not empty:
        # Unrolled with the loads ahead of the (per-split) skip, so several splits' partials
        # are in flight at once: the merge is latency-bound.
        for k in cutlass.range(num_splits, unroll=4):
            lse_k = lse_splits[k]
            part = cute.local_tile(o_splits[k, None], (floats,), (sub,)).load()
            if lse_k != -Float32.inf:
                weight = cute.math.exp2((lse_k - lse) * LOG2_E, fastmath=True)
                acc.store(acc.load() + weight * part)
    return lse
