"""Head dims without a table row of their own (multiples of 16 up to 256 other than 64, 96,
128, 192, 256) on the GPU, on the rows of the next larger ones: prefill, paged decode (TMA
boxes and gathered rows, split), varlen, and pairs with V's own head dim, against the float32
reference with poisoned outputs."""

import pytest
import torch
from kv_cases import (
    assert_close_to_reference,
    cache_reference,
    cu_seqlens,
    make_cache,
    per_batch,
    rand,
    reference_per_sequence,
)

import flash_cute
from flash_cute.reference import stable_seed

pytestmark = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16
PAIRS = [(16, 16), (48, 48), (80, 80), (112, 112), (144, 144), (208, 208), (240, 240)]
PAIRS += [(80, 48), (256, 80), (48, 240), (208, 128)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dims", PAIRS, ids=lambda p: f"d{p[0]}v{p[1]}")
@pytest.mark.parametrize("seqlens", [(113, 1000), (1000, 113), (1, 17), (4097, 4097)])
def test_func(head_dims, causal, seqlens):
    (d, dv), (sq, sk) = head_dims, seqlens
    dtype = FP16 if d % 32 else BF16
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("dims", head_dims, seqlens))
    batch, h, hk = (2, 6, 2) if sq < 4096 else (1, 4, 4)
    q, k = rand(batch, sq, h, d, dtype=dtype, gen=gen), rand(batch, sk, hk, d, dtype=dtype, gen=gen)
    v = rand(batch, sk, hk, dv, dtype=dtype, gen=gen)
    out = torch.full((batch, sq, h, dv), float("nan"), device="cuda", dtype=dtype)
    _, lse = flash_cute.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=out)
    refs, lowps, lse_refs = reference_per_sequence(*per_batch(q, k, v), causal)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("head_dims", [(80, 80), (112, 112), (48, 144)], ids=str)
def test_kvcache_decode(head_dims, page_size, num_splits):
    d, dv = head_dims
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("dims-kv", head_dims, page_size))
    batch, capacity, h, hk = 3, 1500, 16, 4
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch, capacity, hk, d, BF16, page_size, gen, head_dim_v=dv
    )
    q = rand(batch, 2, h, d, gen=gen)
    lens = torch.tensor([1500, 1, 777], device="cuda", dtype=torch.int32)
    out = torch.full((batch, 2, h, dv), float("nan"), device="cuda", dtype=BF16)
    _, lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, page_table=page_table, causal=True,
        num_splits=num_splits, return_softmax_lse=True, out=out,
    )  # fmt: skip
    refs, lowps, lse_refs = cache_reference(q, k_pad, v_pad, lens.tolist(), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("head_dim", [48, 80])
def test_varlen(head_dim):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("dims-varlen", head_dim))
    q_lens, k_lens, h, hk = [1, 300, 0, 77], [900, 300, 50, 1], 8, 4
    cu_q = cu_seqlens(q_lens)
    cu_k = cu_seqlens(k_lens)
    q = rand(sum(q_lens), h, head_dim, gen=gen)
    k, v = (rand(sum(k_lens), hk, head_dim, gen=gen) for _ in "kv")
    out = torch.full_like(q, float("nan"))
    flash_cute.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        max(q_lens),
        cu_seqlens_k=cu_k,
        max_seqlen_k=max(k_lens),
        causal=True,
        out=out,
    )
    for b, (sq, sk) in enumerate(zip(q_lens, k_lens)):
        if sq == 0:
            continue
        qs, ks = cu_q[b].item(), cu_k[b].item()
        seq = [t.unsqueeze(0) for t in (q[qs : qs + sq], k[ks : ks + sk], v[ks : ks + sk])]
        refs, lowps, _ = reference_per_sequence([seq[0]], [seq[1]], [seq[2]], True)
        assert_close_to_reference([out[qs : qs + sq].unsqueeze(0)], None, refs, lowps, None)
