"""Map a flat tile index to (sequence, query tile) for variable-length batches.

A varlen grid has one tile index per query tile of every sequence (plus a few spare), not
max_seqlen_q / tile_m per sequence, so a batch mixing long prefills with single-token decodes
has no swarm of empty tiles (one CTA per index, or persistent CTAs looping over them).
Sequence b owns ceil(len_b * rows_per_token / tile_m) tiles;
each warp finds which sequence a tile belongs to by scanning the batch 32 sequences at a time
with a shuffle prefix sum over cu_seqlens_q (no host preprocessing, so graphs stay valid when
the lengths change).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .seqlen_info import cu_span


@cute.jit
def _warp_inclusive_sum(value: Int32, lane: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        offset = 1 << i
        below = cute.arch.shuffle_sync_up(value, offset=offset, mask_and_clamp=0)
        value = value + (below if lane >= offset else Int32(0))
    return value


@cute.jit
def varlen_tile(
    tile_idx: Int32,
    mCuSeqlensQ: cute.Tensor,
    total_q: Int32,
    rows_per_token: cutlass.Constexpr[int],
    tile_m: cutlass.Constexpr[int],
):
    """(batch, m_block, tiles of that batch) of flat tile tile_idx. A spare index (past every
    sequence's tiles) maps to batch 0 at m_block = its tile count: the tile just past its end,
    which is empty. Sequences' rows are cu_span's (clamped to q's total_q rows), as the tiles'
    SeqlenInfo reads them."""
    lane = cute.arch.lane_idx()
    num_batch = mCuSeqlensQ.shape[0] - 1
    tiles_before = Int32(0)  # tiles of the sequences in earlier chunks
    batch = num_batch  # not found yet
    m_block = Int32(0)
    num_tiles = Int32(0)
    for chunk in cutlass.range(0, num_batch, 32, unroll=1):
        b = chunk + lane
        count = Int32(0)
        if b < num_batch:
            start, end = cu_span(mCuSeqlensQ, b, total_q)
            count = cute.ceil_div((end - start) * rows_per_token, tile_m)
        inclusive = _warp_inclusive_sum(count, lane)
        # Prefix sums are non-decreasing over lanes, so the sequences ending at or before the
        # tile are lanes 0 .. done-1 and the tile belongs to lane `done` (if it is a sequence).
        done = cute.arch.popc(cute.arch.vote_ballot_sync(tiles_before + inclusive <= tile_idx))
        src = cutlass.min(done, 31)
        start = cute.arch.shuffle_sync(inclusive - count, src)
        tiles = cute.arch.shuffle_sync(count, src)
        if batch == num_batch and done < 32 and chunk + done < num_batch:
            batch = chunk + done
            m_block = tile_idx - tiles_before - start
            num_tiles = tiles
        tiles_before = tiles_before + cute.arch.shuffle_sync(inclusive, 31)
    if batch == num_batch:
        batch = Int32(0)
        start, end = cu_span(mCuSeqlensQ, Int32(0), total_q)
        m_block = cute.ceil_div((end - start) * rows_per_token, tile_m)
        num_tiles = m_block
    return batch, m_block, num_tiles
