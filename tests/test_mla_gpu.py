"""V head dims other than q's (MLA prefill: DeepSeek V3 / Kimi K2's 192 / 128) on the GPU:
every entry point, against the float32 reference, with poisoned outputs."""

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
    seqs,
)

import flash_cute
from flash_cute import flash_attn_interface as fa3
from flash_cute.reference import stable_seed

pytestmark = pytest.mark.gpu


BF16, FP16 = torch.bfloat16, torch.float16
PAIRS = [(192, 128), (64, 256), (128, 64), (256, 128), (96, 192)]


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dims", PAIRS, ids=lambda p: f"d{p[0]}v{p[1]}")
@pytest.mark.parametrize("seqlens", [(113, 1000), (1000, 113), (1, 17), (4097, 4097)])
def test_func(head_dims, causal, dtype, seqlens):
    (d, dv), (sq, sk) = head_dims, seqlens
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla", head_dims, seqlens))
    batch, h, hk = (2, 6, 2) if sq < 4096 else (1, 4, 4)
    q, k = rand(batch, sq, h, d, dtype=dtype, gen=gen), rand(batch, sk, hk, d, dtype=dtype, gen=gen)
    v = rand(batch, sk, hk, dv, dtype=dtype, gen=gen)
    out = torch.full((batch, sq, h, dv), float("nan"), device="cuda", dtype=dtype)
    _, lse = flash_cute.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=out)
    refs, lowps, lse_refs = reference_per_sequence(*per_batch(q, k, v), causal)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
    # Allocated output: v's head dim.
    assert flash_cute.flash_attn_func(q, k, v, causal=causal).shape == (batch, sq, h, dv)


@pytest.mark.parametrize("num_splits", [1, 0, 3])
@pytest.mark.parametrize("page_size", [None, 1, 64])
@pytest.mark.parametrize("head_dims", [(192, 128), (64, 256)], ids=lambda p: f"d{p[0]}v{p[1]}")
def test_kvcache_decode_and_graph_replay(head_dims, page_size, num_splits):
    d, dv = head_dims
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-kv", head_dims, page_size))
    batch, capacity, h, hk = 3, 1500, 16, 1
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch, capacity, hk, d, BF16, page_size, gen, head_dim_v=dv
    )
    q = rand(batch, 2, h, d, gen=gen)
    lens = torch.tensor([1500, 1, 777], device="cuda", dtype=torch.int32)
    call = dict(
        cache_seqlens=lens, page_table=page_table, causal=True, num_splits=num_splits,
        return_softmax_lse=True,
    )  # fmt: skip
    out, lse = flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    refs, lowps, lse_refs = cache_reference(q, k_pad, v_pad, lens.tolist(), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
    # Captured, then replayed with other lengths.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    lens.copy_(torch.tensor([5, 1499, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    refs, lowps, lse_refs = cache_reference(q, k_pad, v_pad, lens.tolist(), True)
    assert_close_to_reference(*per_batch(g_out, g_lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("kv_layout", ["packed", "paged"])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_varlen(kv_layout, num_splits):
    d, dv, h, hk = 192, 128, 8, 8
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-varlen", kv_layout))
    q_lens, k_lens = [1, 300, 0, 77], [900, 300, 50, 1]
    cu_q = cu_seqlens(q_lens)
    q = rand(sum(q_lens), h, d, gen=gen)
    kwargs = {}
    if kv_layout == "packed":
        cu_k = cu_seqlens(k_lens)
        k, v = rand(sum(k_lens), hk, d, gen=gen), rand(sum(k_lens), hk, dv, gen=gen)
        k_seqs, v_seqs = seqs(k, k_lens), seqs(v, k_lens)
        kwargs["cu_seqlens_k"] = cu_k
    else:
        k, v, table, k_pad, v_pad = make_cache(len(q_lens), 960, hk, d, BF16, 64, gen, dv)
        k_seqs = [k_pad[b : b + 1, :n] for b, n in enumerate(k_lens)]
        v_seqs = [v_pad[b : b + 1, :n] for b, n in enumerate(k_lens)]
        kwargs.update(page_table=table, seqused_k=torch.tensor(k_lens, device="cuda").int())
    out = torch.full((sum(q_lens), h, dv), float("nan"), device="cuda", dtype=BF16)
    _, lse = flash_cute.flash_attn_varlen_func(
        q, k, v, cu_q, max(q_lens), causal=True, num_splits=num_splits, return_softmax_lse=True,
        out=out, **kwargs,
    )  # fmt: skip
    refs, lowps, lse_refs = reference_per_sequence(seqs(q, q_lens), k_seqs, v_seqs, True)
    assert_close_to_reference(seqs(out, q_lens), seqs(lse, q_lens, dim=1), refs, lowps, lse_refs)


def test_fa3_module_and_wrong_out():
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-fa3"))
    q, k, v = (
        rand(2, 64, 4, 192, gen=gen),
        rand(2, 64, 4, 192, gen=gen),
        rand(2, 64, 4, 128, gen=gen),
    )
    out = fa3.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, flash_cute.flash_attn_func(q, k, v, causal=True))
    meta = fa3.get_scheduler_metadata(
        2, 64, 64, 4, 4, 192, torch.full((2,), 64, device="cuda", dtype=torch.int32), headdim_v=128
    )
    assert meta.shape == (1,)
    with pytest.raises(ValueError, match="out"):
        flash_cute.flash_attn_func(q, k, v, out=torch.empty_like(q))
