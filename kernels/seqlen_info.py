"""Per-batch sequence lengths and offsets, read once per tile.

Queries are either padded (batch, seqlen_q, ...) or packed (total_q, ...) with cu_seqlens_q.
Keys are padded (batch, seqlen_k, ...), packed (total_k, ...) with cu_seqlens_k, or paged;
with seqused_k the number of valid keys of each batch comes from that tensor instead, or with
kv_length from one scalar for all of them (either clamped to the sequence's keys, so a bad
value cannot read past them); with appended_k (a kv_append just before the launch) each
seqused_k count is the cache's before the append and the sequence holds appended_k rows more.
seqused_q likewise shortens a packed query span. With leftpad_k
a padded cache row's keys start at leftpad_k[b] (offset_k) and end at the valid count.

Every value read from a tensor is clamped to the rows the tensors have: cu_seqlens spans to
0 .. total rows (`cu_span`), so metadata past them (or decreasing) can neither read nor write
outside q, k, v, out and the LSE; such a sequence gets fewer rows, not a stray store.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def cu_span(mCuSeqlens: cute.Tensor, batch_idx: Int32, total: Int32):
    """(start, end) of sequence batch_idx's rows, cu_seqlens[b] .. cu_seqlens[b + 1], clamped
    to 0 .. total (the rows the packed tensor has), with end >= start."""
    start = cutlass.min(cutlass.max(mCuSeqlens[batch_idx], 0), total)
    end = cutlass.min(cutlass.max(mCuSeqlens[batch_idx + 1], start), total)
    return start, end


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32  # first row of this batch in a packed q (0 when padded)
    seqlen_q: Int32
    offset_k: Int32  # first row of this batch in packed k/v (0 when padded or paged)
    seqlen_k: Int32

    @staticmethod
    def create(
        batch_idx: Int32,
        seqlen_q_padded: Int32,
        seqlen_k_capacity: Int32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        kv_length: Optional[Int32] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,
        mLeftPadK: Optional[cute.Tensor] = None,
        appended_k: Optional[Int32] = None,
    ) -> "SeqlenInfo":
        offset_q = Int32(0)
        seqlen_q = seqlen_q_padded
        if const_expr(mCuSeqlensQ is not None):  # seqlen_q_padded: the packed total
            offset_q, end_q = cu_span(mCuSeqlensQ, batch_idx, seqlen_q_padded)
            seqlen_q = end_q - offset_q
        if const_expr(mSeqUsedQ is not None):  # the first rows of the sequence's span
            seqlen_q = cutlass.max(cutlass.min(mSeqUsedQ[batch_idx], seqlen_q), 0)
        offset_k = Int32(0)
        seqlen_k = seqlen_k_capacity
        if const_expr(mCuSeqlensK is not None):  # seqlen_k_capacity: the packed total
            offset_k, end_k = cu_span(mCuSeqlensK, batch_idx, seqlen_k_capacity)
            seqlen_k = end_k - offset_k
        if const_expr(mSeqUsedK is not None):
            used = mSeqUsedK[batch_idx]
            if const_expr(appended_k is not None):
                used = used + appended_k
            seqlen_k = cutlass.max(cutlass.min(used, seqlen_k), 0)
        if const_expr(kv_length is not None):  # the same count for every batch
            seqlen_k = cutlass.max(cutlass.min(kv_length, seqlen_k_capacity), 0)
        if const_expr(mLeftPadK is not None):  # keys leftpad .. seqlen_k - 1 of the cache row
            offset_k = cutlass.min(cutlass.max(mLeftPadK[batch_idx], 0), seqlen_k)
            seqlen_k = seqlen_k - offset_k
        return SeqlenInfo(offset_q, seqlen_q, offset_k, seqlen_k)
