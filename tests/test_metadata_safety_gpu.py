"""Bad metadata on a Hopper GPU: cu_seqlens past the tensors or decreasing, and page-table
entries past the pages there are. The kernel clamps what it reads from them to the tensors it
was given (kernels/seqlen_info.py cu_span; the paged loaders' page clamp), so such a call writes
nothing outside out and reads nothing outside q, k, v: a guard region around out stays
untouched, the call returns, and the next call is right."""

import pytest
import torch
from kv_cases import assert_close_to_reference, cu_seqlens, make_cache, rand, reference_per_sequence

import flash_cute
from flash_cute.reference import stable_seed

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
GUARD = 4096  # poisoned rows on each side of out


def guarded_out(rows, nheads, d):
    """(out, whole): out a (rows, nheads, d) view in the middle of a NaN-poisoned buffer."""
    whole = torch.full((rows + 2 * GUARD, nheads, d), float("nan"), device="cuda", dtype=BF16)
    return whole[GUARD : GUARD + rows], whole


@pytest.mark.parametrize(
    "bad",
    [
        [0, 30, 5000, 100],  # past total_q, then back
        [0, 90, 40, 100],  # decreasing
        [-50, 30, 60, 100],  # negative start
        [0, 30, 60, 1 << 30],  # far past the end
    ],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_cu_seqlens_past_the_tensors_write_nothing_outside_out(bad, num_splits):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("bad-cu", *bad[:3], num_splits))
    total, h, hk, d = 100, 8, 2, 128
    q = rand(total, h, d, gen=gen)
    k, v = rand(total, hk, d, gen=gen), rand(total, hk, d, gen=gen)
    out, whole = guarded_out(total, h, d)
    cu = torch.tensor(bad, device="cuda", dtype=torch.int32)
    flash_cute.flash_attn_varlen_func(
        q, k, v, cu, 60, cu_seqlens_k=cu, max_seqlen_k=60, causal=True, out=out,
        num_splits=num_splits, return_softmax_lse=True,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert whole[:GUARD].isnan().all() and whole[GUARD + total :].isnan().all()
    # The next call, with good metadata, is right.
    lengths = [30, 30, 40]
    good = cu_seqlens(lengths)
    out = flash_cute.flash_attn_varlen_func(q, k, v, good, 40, cu_seqlens_k=good, causal=True)
    pieces = [slice(a, b) for a, b in zip([0, 30, 60], [30, 60, 100])]
    refs, lowps, _ = reference_per_sequence(
        [q[None, p] for p in pieces], [k[None, p] for p in pieces], [v[None, p] for p in pieces],
        True,
    )  # fmt: skip
    assert_close_to_reference([out[None, p] for p in pieces], None, refs, lowps, None)


@pytest.mark.parametrize("page_size", [16, 64, 8])
def test_page_entries_past_the_pages_read_real_pages(page_size):
    """Entries past the last page (and negative ones) read a real page: the result is that of
    the table with those entries clamped to the pages there are."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("bad-pages", page_size))
    batch, h, hk, d, capacity = 2, 8, 2, 128, 512
    k_cache, v_cache, page_table, _, _ = make_cache(batch, capacity, hk, d, BF16, page_size, gen)
    num_pages = k_cache.shape[0]
    bad = page_table.clone()
    bad[0, 1] = num_pages + 7
    bad[1, 2] = -3
    bad[1, 0] = 1 << 30
    q = rand(batch, 1, h, d, gen=gen)
    lens = torch.full((batch,), capacity, device="cuda", dtype=torch.int32)
    got = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, page_table=bad, causal=True
    )
    clamped = bad.clamp(0, num_pages - 1)
    want = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, page_table=clamped, causal=True
    )
    torch.cuda.synchronize()
    assert torch.equal(got, want)
