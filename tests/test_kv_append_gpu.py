"""Appending to the KV cache on a Hopper GPU (marker: gpu): FlashAttention-3's
flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=...) against the row-by-row
reference of tests/test_kv_append.py for the cache and the rotated queries, and float32
attention over the updated cache for the output; CUDA-graph replays with new lengths."""

import math

import pytest
import torch
from kv_cases import assert_close_to_reference, cache_reference, captured, make_cache
from test_kv_append import reference

from flash_cute import flash_attn_interface as fa3
from flash_cute import kv_append
from flash_cute.kv_append import KVAppend
from flash_cute.reference import gather_paged, stable_seed

pytestmark = pytest.mark.gpu

# (page size, seqlen_q = new rows, rotary: None / "interleaved" / "half", rotary_dim,
#  cache_batch_idx, cache_leftpad, num_splits, causal)
CASES = [
    (None, 1, "half", 128, False, True, 0, True),
    (16, 3, "interleaved", 64, True, False, 3, True),
    (64, 2, None, 0, False, False, 1, True),
    (1, 1, "half", 128, False, False, 0, True),
    (None, 17, "interleaved", 128, True, True, 1, True),
    # Split launches behind the append (dependent launches): left padding, new rows across
    # a key block's edge, gathered pages.
    (None, 17, "interleaved", 128, True, True, 3, True),
    (8, 5, "half", 64, False, True, 4, True),
    # The fused append (each sequence's own cache row, no left padding, at most
    # FUSED_MAX_NEW_ROWS rows): the attention kernel writes the rows. Splits, no mask (q at
    # one position), no rotation; pages of TMA boxes and gathered pages. More rows take the
    # kernel (17, 40: their rows cross key blocks' edges).
    (None, 1, "half", 128, False, False, 0, True),
    (16, 40, "interleaved", 128, False, False, 3, True),
    (8, 17, "half", 64, False, False, 2, True),
    (None, 3, "interleaved", 64, False, False, 3, True),
    (None, 40, None, 0, False, False, 4, True),
    (None, 17, "half", 32, False, False, 1, True),
    (None, 2, "interleaved", 128, False, False, 0, False),
    (None, 1, None, 0, False, False, 1, False),
]


def fused(case) -> bool:
    _, seqlen_new, _, _, has_batch_idx, has_leftpad, _, _ = case
    return not has_batch_idx and not has_leftpad and seqlen_new <= kv_append.FUSED_MAX_NEW_ROWS


@pytest.mark.parametrize("case", CASES, ids=str)
def test_append_then_attend(case, monkeypatch):
    page_size, seqlen_new, rotary, rotary_dim, has_batch_idx, has_leftpad, num_splits = case[:7]
    causal = case[7]
    # Which path ran: the fused one launches no append kernel.
    launches = []
    launch = kv_append._launch
    monkeypatch.setattr(kv_append, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("kv append", case))
    batch, capacity, h, hkv, d = 4, 256, 32, 8, 128
    rows = 2 * batch if has_batch_idx else batch
    k_cache, v_cache, table, _, _ = make_cache(rows, capacity, hkv, d, torch.bfloat16, page_size,
                                               gen)  # fmt: skip
    lengths = torch.randint(0, capacity - seqlen_new, (batch,), device="cuda", generator=gen)
    lengths = lengths.to(torch.int32)
    k, v = (torch.randn(batch, seqlen_new, hkv, d, device="cuda", generator=gen).bfloat16()
            for _ in range(2))  # fmt: skip
    q = torch.randn(batch, seqlen_new, h, d, device="cuda", generator=gen).bfloat16()
    cos = sin = None
    if rotary:
        angle = torch.rand(capacity, rotary_dim // 2, device="cuda", generator=gen) * 2 * math.pi
        cos, sin = torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()
    batch_idx = None
    if has_batch_idx:
        batch_idx = torch.randperm(rows, device="cuda", generator=gen)[:batch].to(torch.int32)
    leftpad = None
    if has_leftpad:
        leftpad = (lengths // 3).to(torch.int32)
    append = KVAppend(k.cpu(), v.cpu(), *(t.cpu() if t is not None else None for t in (cos, sin)),
                      rotary_interleaved=rotary == "interleaved")  # fmt: skip
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    q_rot, k_want, v_want, new_lengths = reference(
        q.cpu(), k_cache.cpu(), v_cache.cpu(), append, lengths.cpu(), cpu(table), cpu(batch_idx),
        per_row=causal,
    )  # fmt: skip
    out = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
        cache_batch_idx=batch_idx, cache_leftpad=leftpad, page_table=table, causal=causal,
        rotary_interleaved=rotary == "interleaved", num_splits=num_splits,
    )  # fmt: skip
    assert bool(launches) != fused(case)
    # The cache: the rotated new keys within one bf16 rounding of float64's, the values and
    # every other row bit-identical.
    got_k, got_v = k_cache.cpu(), v_cache.cpu()
    assert torch.equal(got_v, v_want)
    close = (got_k.float() - k_want.float()).abs() <= 2.0**-7 * k_want.float().abs() + 1e-6
    assert close.all()
    # The output: float32 attention of the rotated queries over the updated cache.
    k_pad, v_pad = k_want.cuda(), v_want.cuda()
    if table is not None:
        k_pad = gather_paged(k_pad, table, table.shape[1] * page_size)
        v_pad = gather_paged(v_pad, table, table.shape[1] * page_size)
    first = leftpad.tolist() if leftpad is not None else None
    refs, lowps, _ = cache_reference(
        q_rot.cuda(), k_pad, v_pad, new_lengths, causal,
        rows=batch_idx.tolist() if batch_idx is not None else None, first=first,
    )  # fmt: skip
    assert_close_to_reference([out[b : b + 1] for b in range(batch)], None, refs, lowps, None)


@pytest.mark.parametrize("page_size, fuse", [(16, True), (None, True), (16, False)])
def test_append_replays_in_a_cuda_graph(page_size, fuse, monkeypatch):
    """One decode step with append and rotary captured once, replayed with new lengths and new
    rows: each replay equals the same step run eagerly on a copy of the cache (fuse False:
    through the append kernel)."""
    if not fuse:
        monkeypatch.setattr(kv_append, "fuses", lambda *args: False)
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("kv append graph", page_size))
    batch, capacity, h, hkv, d = 3, 512, 16, 4, 128
    k_cache, v_cache, table, _, _ = make_cache(
        batch, capacity, hkv, d, torch.bfloat16, page_size, gen
    )
    angle = torch.rand(capacity, d // 2, device="cuda", generator=gen) * 2 * math.pi
    cos, sin = torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()
    lengths = torch.tensor([5, 100, 300], device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 1, h, d, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(batch, 1, hkv, d, device="cuda", generator=gen).bfloat16()
            for _ in range(2))  # fmt: skip

    def step(kc, vc):
        return fa3.flash_attn_with_kvcache(
            q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
            page_table=table, causal=True,
        )  # fmt: skip

    graph, out = captured(lambda: step(k_cache, v_cache))
    for new_lengths in ([6, 101, 301], [0, 511, 7]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        k.copy_(torch.randn(k.shape, device="cuda", generator=gen))
        kc, vc = k_cache.clone(), v_cache.clone()
        eager = step(kc, vc)
        graph.replay()
        assert torch.equal(out, eager)
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
