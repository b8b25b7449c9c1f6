"""flash_cute.flash_attn_interface on the GPU, after FlashAttention-3's own forward tests
(hopper/test_flash_attn.py: output, varlen with seqused, kvcache with cache_batch_idx and
cache_leftpad, combine), and the flash_cute:: custom ops run for real (opcheck, torch.compile).
"""

import pytest
import torch
from kv_cases import (
    assert_close_to_reference,
    cache_reference,
    cu_seqlens,
    make_cache,
    rand,
    reference_per_sequence,
    seqs,
)

import flash_cute
from flash_cute import flash_attn_interface as fa3
from flash_cute import ops
from flash_cute.call import Call
from flash_cute.reference import combine_ref, stable_seed

pytestmark = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16


FUNC_CASES = [
    # (seqlen_q, seqlen_k, head_dim, nheads, nheads_kv, causal, window, softcap, num_splits)
    (1, 17, 64, 8, 2, False, (-1, -1), 0.0, 1),
    (113, 1000, 128, 8, 8, True, (-1, -1), 0.0, 1),
    (1000, 113, 128, 4, 1, True, (37, 5), 0.0, 1),
    (17, 4097, 96, 6, 3, False, (-1, -1), 30.0, 0),
    (128, 800, 256, 4, 2, True, (-1, -1), 0.0, 3),
    (64, 333, 192, 4, 4, False, (100, 100), 0.0, 1),
]


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", FUNC_CASES)
def test_func(case, dtype):
    sq, sk, d, h, hk, causal, window, softcap, num_splits = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(case, dtype))
    q, k, v = (
        rand(2, sq, h, d, dtype=dtype, gen=gen),
        *(rand(2, sk, hk, d, dtype=dtype, gen=gen) for _ in range(2)),
    )
    out, lse = fa3.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, num_splits=num_splits,
        return_attn_probs=True,
    )  # fmt: skip
    mask = dict(window_size=window, softcap=softcap)
    refs, lowps, lse_refs = reference_per_sequence(
        [q[b : b + 1] for b in range(2)],
        [k[b : b + 1] for b in range(2)],
        [v[b : b + 1] for b in range(2)],
        causal,
        mask,
    )
    outs, lses = [out[b : b + 1] for b in range(2)], [lse[b : b + 1] for b in range(2)]
    assert_close_to_reference(outs, lses, refs, lowps, lse_refs)
    again = fa3.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, num_splits=num_splits
    )
    assert torch.equal(out, again)


@pytest.mark.parametrize("nheads, nheads_kv", [(6, 1), (6, 2), (12, 2), (40, 8)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pack_gqa_groups(nheads, nheads_kv, num_splits):
    """pack_gqa=True where the q heads of a kv head (6, 3, 5) do not divide the tile rows:
    tiles fold the largest group of them that does (FlashAttention-3's tests ask for it)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("pack", nheads, nheads_kv))
    q = rand(2, 77, nheads, 128, gen=gen)
    k, v = rand(2, 300, nheads_kv, 128, gen=gen), rand(2, 300, nheads_kv, 128, gen=gen)
    out, lse = fa3.flash_attn_func(
        q, k, v, causal=True, pack_gqa=True, num_splits=num_splits, return_attn_probs=True
    )
    refs, lowps, lse_refs = reference_per_sequence(
        [q[b : b + 1] for b in range(2)],
        [k[b : b + 1] for b in range(2)],
        [v[b : b + 1] for b in range(2)],
        True,
    )
    outs, lses = [out[b : b + 1] for b in range(2)], [lse[b : b + 1] for b in range(2)]
    assert_close_to_reference(outs, lses, refs, lowps, lse_refs)


@pytest.mark.parametrize("gqa", [False, True])
def test_qkvpacked(gqa):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("qkvpacked", gqa))
    if gqa:
        qkv = rand(2, 300, 8 + 2 * 2, 128, gen=gen)
        q, k, v = qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]
        out = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=8)
    else:
        qkv = rand(2, 300, 3, 8, 128, gen=gen)
        q, k, v = qkv.unbind(2)
        out = fa3.flash_attn_qkvpacked_func(qkv, causal=True)
    assert torch.equal(out, flash_cute.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [1, 0, 3])
def test_varlen_seqused_q_and_k(causal, num_splits):
    """seqused_q / seqused_k shorter than the packed spans (FlashAttention-3's varlen case):
    a sequence's queries are its first seqused_q rows, its keys the first seqused_k rows of
    its cu_seqlens_k span; the other rows of out are not written."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("seqused", causal, num_splits))
    q_spans, k_spans = [1, 300, 77, 5, 513, 40], [900, 300, 200, 50, 513, 1]
    used_q, used_k = [1, 217, 0, 5, 100, 40], [899, 1, 200, 0, 513, 1]
    h, hk, d = 16, 4, 128
    cu_q = cu_seqlens(q_spans)
    cu_k = cu_seqlens(k_spans)
    q = rand(sum(q_spans), h, d, gen=gen)
    k, v = rand(sum(k_spans), hk, d, gen=gen), rand(sum(k_spans), hk, d, gen=gen)
    as_i32 = lambda xs: torch.tensor(xs, device="cuda", dtype=torch.int32)  # noqa: E731
    out, lse = fa3.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(q_spans), max(k_spans), as_i32(used_q), as_i32(used_k),
        causal=causal, num_splits=num_splits, return_attn_probs=True,
    )  # fmt: skip
    q_starts, k_starts = cu_q[:-1].tolist(), cu_k[:-1].tolist()
    refs, lowps, lse_refs = reference_per_sequence(
        seqs(q, used_q, q_starts), seqs(k, used_k, k_starts), seqs(v, used_k, k_starts), causal
    )
    lses = seqs(lse, used_q, q_starts, dim=1)
    assert_close_to_reference(seqs(out, used_q, q_starts), lses, refs, lowps, lse_refs)
    # Rows past seqused_q: untouched in a NaN-filled out (native API with out=).
    poisoned = torch.full_like(q, float("nan"))
    flash_cute.flash_attn_varlen_func(
        q, k, v, cu_q, max(q_spans), cu_seqlens_k=cu_k, seqused_k=as_i32(used_k),
        causal=causal, num_splits=num_splits, out=poisoned, seqused_q=as_i32(used_q),
    )  # fmt: skip
    for s, n, span in zip(q_starts, used_q, q_spans):
        assert not poisoned[s : s + n].isnan().any()
        assert poisoned[s + n : s + span].isnan().all(), "a row past seqused_q was written"


KVCACHE_CASES = [
    # (seqlen_q, capacity, page_size, batch_idx, leftpad, causal, window, num_splits, int_len)
    (1, 339, None, True, True, True, (-1, -1), 0, None),
    (1, 339, None, True, False, False, (-1, -1), 3, None),
    (3, 1024, None, False, True, True, (50, 0), 1, None),
    (64, 800, None, True, True, True, (-1, -1), 0, 700),
    (16, 2000, None, False, True, False, (-1, -1), 4, None),
    (1, 1024, 16, True, False, True, (-1, -1), 0, None),
    (64, 800, 64, True, False, True, (100, 0), 1, None),
    (3, 512, 128, True, False, False, (-1, -1), 2, 300),
    # FlashAttention-3's kvcache page sizes 1 and 4 (rows gathered), left padding on pages.
    (1, 339, 1, True, True, True, (-1, -1), 0, None),
    (3, 1024, 4, False, True, True, (50, 0), 1, None),
    (64, 800, 64, True, True, True, (-1, -1), 3, None),
    (16, 2000, 1, False, False, False, (-1, -1), 4, 1500),
]


@pytest.mark.parametrize("case", KVCACHE_CASES)
@pytest.mark.parametrize("nheads_kv", [1, 3])
def test_kvcache_batch_idx_and_leftpad(case, nheads_kv):
    sq, capacity, page_size, has_idx, has_pad, causal, window, num_splits, int_len = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(case, nheads_kv))
    batch, h, d = 5, 6, 128
    batch_cache = 2 * batch if has_idx else batch
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch_cache, capacity, nheads_kv, d, BF16, page_size, gen
    )
    q = rand(batch, sq, h, d, gen=gen)
    lens = torch.randint(1, capacity + 1, (batch,), device="cuda", generator=gen)
    if int_len is not None:
        lens.fill_(int_len)
    lens = lens.to(torch.int32)
    idx = torch.randperm(batch_cache, device="cuda", generator=gen)[:batch].to(torch.int32)
    pad = (torch.rand(batch, device="cuda", generator=gen) * lens).to(torch.int32)
    pad[0] = 0
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens if int_len is None else int_len,
        cache_batch_idx=idx if has_idx else None, cache_leftpad=pad if has_pad else None,
        page_table=page_table, causal=causal, window_size=window, num_splits=num_splits,
        return_softmax_lse=True,
    )  # fmt: skip
    refs, lowps, lse_refs = cache_reference(
        q, k_pad, v_pad, lens.tolist(), causal, idx.tolist() if has_idx else None,
        pad.tolist() if has_pad else None, dict(window_size=window),
    )  # fmt: skip
    assert_close_to_reference(
        [out[b : b + 1] for b in range(batch)],
        [lse[b : b + 1] for b in range(batch)],
        refs,
        lowps,
        lse_refs,
    )


@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("int_length", [False, True])
def test_kvcache_varlen_queries(page_size, num_splits, rows, int_length):
    """cu_seqlens_q over a cache (speculative decoding, chunked prefill): FlashAttention-3's
    kvcache with varlen_q, and with rows its cache_batch_idx and cache_leftpad as well; with
    int_length one int cache_seqlens for every sequence (the kernel's scalar key count)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("kv-varlen", page_size, rows))
    q_lens, h, hk, d = [1, 4, 2, 0, 3], 8, 2, 128
    batch, capacity = len(q_lens), 700
    batch_cache = 2 * batch if rows else batch
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch_cache, capacity, hk, d, BF16, page_size, gen
    )
    lens = torch.tensor([700, 5, 333, 10, 64], device="cuda", dtype=torch.int32)
    if int_length:
        lens.fill_(333)
    idx = torch.randperm(batch_cache, device="cuda", generator=gen)[:batch].to(torch.int32)
    pad = torch.tensor([0, 4, 300, 9, 1], device="cuda", dtype=torch.int32)
    cu_q = cu_seqlens(q_lens)
    q = rand(sum(q_lens), h, d, gen=gen)
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=333 if int_length else lens, page_table=page_table,
        cu_seqlens_q=cu_q, max_seqlen_q=max(q_lens), causal=True, num_splits=num_splits,
        return_softmax_lse=True,
        cache_batch_idx=idx if rows else None, cache_leftpad=pad if rows else None,
    )  # fmt: skip
    n = lens.tolist()
    cache_rows = idx.tolist() if rows else list(range(batch))
    first = pad.tolist() if rows else [0] * batch
    refs, lowps, lse_refs = reference_per_sequence(
        seqs(q, q_lens),
        [k_pad[r : r + 1, f:e] for r, f, e in zip(cache_rows, first, n)],
        [v_pad[r : r + 1, f:e] for r, f, e in zip(cache_rows, first, n)],
        True,
    )
    lses = seqs(lse, q_lens, cu_q[:-1].tolist(), dim=1)
    assert_close_to_reference(seqs(out, q_lens), lses, refs, lowps, lse_refs)


@pytest.mark.parametrize("num_splits, seqlen, d", [(1, 1, 64), (3, 113, 128), (11, 17, 256)])
def test_combine(num_splits, seqlen, d):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("combine", num_splits, seqlen))
    out_partial = rand(num_splits, 2, seqlen, 4, d, dtype=torch.float32, gen=gen)
    lse_partial = rand(num_splits, 2, seqlen, 4, dtype=torch.float32, gen=gen) * 3
    lse_partial[0, 0, 0] = float("-inf")
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=BF16)
    out_ref, lse_ref = combine_ref(out_partial, lse_partial)
    assert out.dtype == BF16 and lse.shape == lse_partial.shape[1:]
    assert (out.float() - out_ref).abs().max().item() <= 2e-2
    assert torch.allclose(lse, lse_ref, atol=1e-4)


def test_scheduler_metadata_graph_replay():
    """get_scheduler_metadata before capture, a captured decode step replayed with new cache
    lengths: the split count stays the one chosen before capture, results follow the lengths."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("sched-meta"))
    batch, h, hk, d, capacity = 2, 32, 8, 128, 16384
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(batch, capacity, hk, d, BF16, 64, gen)
    q = rand(batch, 1, h, d, gen=gen)
    lens = torch.full((batch,), capacity, device="cuda", dtype=torch.int32)
    meta = fa3.get_scheduler_metadata(batch, 1, capacity, h, hk, d, lens, page_size=64, causal=True)
    assert meta.flash_cute_num_splits > 1

    def step():
        return fa3.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, page_table=page_table, causal=True,
            scheduler_metadata=meta,
        )  # fmt: skip

    step()  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([capacity, 1], [5000, 12000], [0, 777]):
        lens.copy_(torch.tensor(new))
        graph.replay()
        refs, lowps, lse_refs = reference_per_sequence(
            [q[b : b + 1] for b in range(batch)],
            [k_pad[b : b + 1, : new[b]] for b in range(batch)],
            [v_pad[b : b + 1, : new[b]] for b in range(batch)],
            True,
        )
        assert_close_to_reference(
            [out[b : b + 1] for b in range(batch)], None, refs, lowps, lse_refs
        )


def test_custom_ops_run_for_real():
    """opcheck on CUDA tensors (the real kernels against the fake implementations), and
    torch.compile(fullgraph=True) giving the eager call's exact result."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("ops"))
    q, k = rand(2, 77, 8, 128, gen=gen), rand(2, 300, 2, 128, gen=gen)
    sink = torch.randn(8, device="cuda", generator=gen)

    def opcheck(call, **options):
        torch.library.opcheck(ops.forward_op, ops.op_arguments(call), **options)

    opcheck(
        Call(q, k, k, torch.empty_like(q), causal=True, return_lse=True, window_size=(64, 0),
             learnable_sink=sink, decode_rows=False, pack_gqa=False)
    )  # fmt: skip
    lens = torch.tensor([300, 17], device="cuda", dtype=torch.int32)
    q1 = q[:, :1]
    opcheck(Call(q1, k, k, torch.empty_like(q1), seqused_k=lens, causal=True, num_splits=0,
                 return_lse=True))  # fmt: skip
    k8, scale = k.to(torch.float8_e4m3fn), torch.full((2, 2), 0.5, device="cuda")
    opcheck(  # an FP8 cache with its descales (test_schema multiplies the inputs, which torch
        # has no float8 kernel for)
        Call(q1, k8, k8, torch.empty_like(q1), seqused_k=lens, causal=True, num_splits=0,
             return_lse=True, k_descale=scale, v_descale=scale),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )  # fmt: skip
    opcheck(Call(q1, k, k, torch.empty_like(q1), kv_length=200, causal=True, num_splits=3))
    cu = torch.tensor([0, 77, 154], device="cuda", dtype=torch.int32)
    qv, kv = q.flatten(0, 1), k.flatten(0, 1)
    cu_k = torch.tensor([0, 300, 600], device="cuda", dtype=torch.int32)
    opcheck(Call(qv, kv, kv, torch.empty_like(qv), cu_seqlens_q=cu, max_seqlen_q=77,
                 cu_seqlens_k=cu_k, max_seqlen_k=300, causal=True, return_lse=True))  # fmt: skip
    partial = rand(3, 2, 5, 8, 128, dtype=torch.float32, gen=gen)
    lse_partial = rand(3, 2, 5, 8, dtype=torch.float32, gen=gen)
    torch.library.opcheck(
        ops.flash_attn_combine_op,
        (partial, lse_partial, torch.empty(2, 5, 8, 128, device="cuda", dtype=BF16), True),
    )

    def model(q, k, lens):
        a = flash_cute.flash_attn_func(q, k, k, causal=True, learnable_sink=sink)
        b, lse, *_ = fa3.flash_attn_with_kvcache(
            q[:, :1], k, k, cache_seqlens=lens, causal=True, return_softmax_lse=True
        )
        c = fa3.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), cu,
                                       cu_k, 77, 300, causal=True)  # fmt: skip
        return a * 2, b, lse, c

    eager = model(q, k, lens)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        for x, y in zip(compiled(q, k, lens), eager):
            assert torch.equal(x, y), backend
