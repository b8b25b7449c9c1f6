"""Merging split-KV partial results of one row (the LSE combine's math), shared by the combine
kernel and the split forward kernel's in-kernel merge.

For a row with splits k: lse = log(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) * out_k,
where out_k is split k's output normalized over its own keys. Splits with lse_k = -inf (empty)
add nothing: their out_k is loaded with the others (the loads run ahead of the check) but never
used, so it may hold anything, NaN included; a row whose splits are all empty gets out = 0
and lse = -inf.

A row is handled by a group of lanes of one warp (`lanes_per_row`, a power of two), each lane
owning `head_dim // group` consecutive floats of the head dim: the fp32 partials stream in with
16-byte loads.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


# Floats a lane may hold in a chunk's partials: the combine kernel has registers to spare, a
# forward kernel's epilogue (its in-kernel merge) less.
COMBINE_CHUNK_FLOATS = 128
EPILOGUE_CHUNK_FLOATS = 64


def splits_per_chunk(floats_per_lane: int, register_budget: int) -> int:
    """Splits whose partials merge_row loads at once (1-8): as many as register_budget floats
    a lane holds (COMBINE_CHUNK_FLOATS or EPILOGUE_CHUNK_FLOATS)."""
    return max(1, min(8, register_budget // floats_per_lane))


def lanes_per_row(head_dim: int) -> int:
    """The largest power of two <= 32 dividing head_dim / 4 (whole 16-byte pieces per lane; a
    power of two, so that a CTA's threads hold whole rows)."""
    assert head_dim % 8 == 0
    lanes = 32
    while (head_dim // 4) % lanes:
        lanes //= 2
    return lanes


@cute.jit
def merge_row(
    lse_splits: cute.Tensor,
    o_splits: cute.Tensor,
    sub: Int32,
    acc: cute.Tensor,
    chunk: cutlass.Constexpr[int],
) -> Float32:
    """Merge one row's splits (this lane's piece of it). An empty split's out_k is loaded but
    not used.

    lse_splits: (K,) fp32 natural-log LSEs; o_splits: (K, head_dim) fp32, last mode contiguous.
    sub: this lane's index in the row's group; acc: (the floats a lane owns,) fp32 registers,
    gets the lane's piece of the merged row; chunk: splits loaded at once (splits_per_chunk).
    Returns the merged lse (the same on every lane of the row's group).

    One pass over chunks of splits with a running max (each lane reads every split's
    LSE: one broadcast load a split), a chunk's LSEs and partials loaded together: the merge
    is latency-bound, so one round trip a chunk, not the LSEs' own round trip before the
    partials'.
    """
    num_splits = lse_splits.shape[0]
    floats = cute.size(acc)
    run_max = -Float32.inf
    run_sum = Float32(0.0)
    acc.fill(0.0)
    for c in cutlass.range(cute.ceil_div(num_splits, chunk), unroll=1):
        # The chunk's LSEs and partials loaded before any is used (all in flight at once);
        # past the last split nothing is loaded (redundant loads cost as much as the merge at
        # 2 splits) and the LSE is taken as -inf.
        lses, parts = [], []
        for i in cutlass.range_constexpr(chunk):
            k = c * chunk + i
            lse_k = -Float32.inf
            part = cute.make_rmem_tensor(floats, Float32)
            if k < num_splits:
                lse_k = lse_splits[k]
                part.store(cute.local_tile(o_splits[k, None], (floats,), (sub,)).load())
            lses.append(lse_k)
            parts.append(part)
        new_max = run_max
        for i in cutlass.range_constexpr(chunk):
            new_max = cute.arch.fmax(new_max, lses[i])
        # (2^-inf = 0 where nothing was merged yet: acc and the sum are 0 then)
        new_safe = Float32(0.0) if new_max == -Float32.inf else new_max
        scale = cute.math.exp2((run_max - new_safe) * LOG2_E, fastmath=True)
        acc.store(acc.load() * scale)
        run_sum = run_sum * scale
        for i in cutlass.range_constexpr(chunk):
            # (an empty split's partial may hold NaN; a slot past the last split has an LSE of
            # -inf and no partial loaded)
            if lses[i] != -Float32.inf:
                weight = cute.math.exp2((lses[i] - new_safe) * LOG2_E, fastmath=True)
                acc.store(acc.load() + weight * parts[i].load())
                run_sum = run_sum + weight
        run_max = new_max
    lse = -Float32.inf
    if run_sum > 0.0:
        lse = run_max + cute.math.log2(run_sum, fastmath=True) * LN2
        acc.store(acc.load() * cute.arch.rcp_approx(run_sum))
    return lse
