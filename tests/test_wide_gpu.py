"""GPU checks of the wide-head variants, kernel-level and through the API: O split across two
warpgroups along V's head dim (o_split, V head dims above 256: 512) and V read from K's columns
(v_in_k: absorbed MLA's latent cache, q and cache 576 wide, V its first 512 dims). Each case
plans its variant with an explicit config and launches it through a launch plan, bypassing the
API's head-dim checks, against the float32 reference on poisoned outputs."""

import math

import pytest
import torch
from kv_cases import (
    assert_close_to_reference,
    cache_reference,
    cu_seqlens,
    make_cache,
    per_batch,
    reference_per_sequence,
)

from flash_cute.call import Call
from flash_cute.config import AttentionConfig
from flash_cute.forward import kernel_call_args
from flash_cute.plan import Problem, plan_forward
from flash_cute.reference import stable_seed
from flash_cute.runtime import LaunchPlan, num_sms

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
O_SPLIT = dict(pingpong=False, o_split=2, store_o_from_registers=True)
# Each warpgroup the scores of half of every key block (P through smem), or all of them.
SCORES = {
    "split_scores": dict(O_SPLIT, pv_from_registers=False, split_scores=True),
    "repeat_scores": O_SPLIT,
    # Without the intra-warpgroup overlap: Q K^T, softmax and P V of one block in turn.
    "split_scores_no_overlap": dict(
        O_SPLIT, pv_from_registers=False, split_scores=True, intra_wg_overlap=False
    ),
    "repeat_scores_no_overlap": dict(O_SPLIT, intra_wg_overlap=False),
}


def launch(problem, config, q, k, v, num_splits=1, pack_gqa=False, **tensors):
    """out (poisoned, then written) and lse of the variant plan_forward picks for `problem`."""
    plan = plan_forward(problem, num_sms(q.device.index or 0), config, num_splits, pack_gqa)
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
    lse_shape = (problem.batch, problem.nheads, problem.max_seqlen_q)
    # (qv: head_dim counts qv's columns and q's, the default scale 1 / sqrt(d + dv).)
    scale_log2 = math.log2(math.e) / math.sqrt(problem.head_dim)
    runner = LaunchPlan.build(plan, q, k, v, out, lse_shape, scale_log2)
    result = runner.launch(q, k, v, out, kernel_call_args(Call(q, k, v, **tensors)))
    return plan.variant, result


@pytest.mark.parametrize("scores", list(SCORES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "head_dims, tile_n", [((64, 512), 64), ((512, 512), 32), ((128, 256), 128)], ids=str
)
@pytest.mark.parametrize("seqlens", [(113, 1000), (1000, 113), (1, 17)])
def test_o_split_prefill(head_dims, tile_n, causal, seqlens, scores):
    (d, dv), (sq, sk) = head_dims, seqlens
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("osplit", head_dims, seqlens))
    batch, h = 2, 4
    q, k = (torch.randn(batch, s, h, d, device="cuda", dtype=BF16, generator=gen) for s in (sq, sk))
    v = torch.randn(batch, sk, h, dv, device="cuda", dtype=BF16, generator=gen)
    problem = Problem(
        batch=batch, nheads=h, nheads_kv=h, head_dim=d, head_dim_v=dv, dtype="bfloat16",
        max_seqlen_q=sq, max_seqlen_k=sk, kv_capacity=sk, causal=causal, writes_lse=True,
    )  # fmt: skip
    variant, (out, lse) = launch(problem, AttentionConfig(64, tile_n, **SCORES[scores]), q, k, v)
    assert variant.config.o_split == 2
    refs, lowps, lse_refs = reference_per_sequence(*per_batch(q, k, v), causal)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("scores", list(SCORES))
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("seqlen_q, nheads", [(1, 128), (2, 64), (1, 16)])
def test_absorbed_mla_decode(seqlen_q, nheads, page_size, num_splits, scores):
    """q (batch, seqlen_q, nheads, 576) against one latent head of 576 whose first 512 dims are
    V (v = k_cache[..., :512], a view): FlashMLA's form of DeepSeek's decode. num_splits 0: the
    heuristic's 9 splits (its cap for wide partials, 2 sqrt(24 key blocks)); a split launch's
    partials (16-64 rows of V 512 wide: plan.WIDE_PARTIAL_BYTES) go to the combine kernel."""
    d, dv, batch, capacity = 576, 512, 3, 1500
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla", seqlen_q, page_size))
    k_cache, _, page_table, k_pad, _ = make_cache(batch, capacity, 1, d, BF16, page_size, gen)
    v_cache, v_pad = k_cache[..., :dv], k_pad[..., :dv]
    q = torch.randn(batch, seqlen_q, nheads, d, device="cuda", dtype=BF16, generator=gen)
    lens = torch.tensor([1500, 1, 333], device="cuda", dtype=torch.int32)
    problem = Problem(
        batch=batch, nheads=nheads, nheads_kv=1, head_dim=d, head_dim_v=dv, dtype="bfloat16",
        max_seqlen_q=seqlen_q, max_seqlen_k=capacity, kv_capacity=capacity, causal=True,
        writes_lse=True, kv_layout="paged", page_size=page_size, seqused_k=True, v_in_k=True,
    )  # fmt: skip
    variant, (out, lse) = launch(
        problem, AttentionConfig(64, 64, **SCORES[scores]), q, k_cache, v_cache, num_splits,
        True, seqused_k=lens, page_table=page_table,
    )  # fmt: skip
    assert variant.v_in_k and variant.pack_gqa_ratio == min(nheads, 64)
    assert variant.combine_launch == variant.split
    refs, lowps, lse_refs = cache_reference(q, k_pad, v_pad, lens.tolist(), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


def test_v_in_k_at_a_served_pair():
    """V = k[..., :128] of a 256-wide K, read from K's stages (prefill)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("v_in_k", 256))
    q, k = (torch.randn(2, 300, 4, 256, device="cuda", dtype=BF16, generator=gen) for _ in "qk")
    v = k[..., :128]
    problem = Problem(
        batch=2, nheads=4, nheads_kv=4, head_dim=256, head_dim_v=128, dtype="bfloat16",
        max_seqlen_q=300, max_seqlen_k=300, kv_capacity=300, causal=True, writes_lse=True,
        v_in_k=True,
    )  # fmt: skip
    config = AttentionConfig(128, 64, pingpong=False, rescale_o_before_pv=True)
    variant, (out, lse) = launch(problem, config, q, k, v)
    assert variant.v_in_k
    refs, lowps, lse_refs = reference_per_sequence(*per_batch(q, k, v), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("scores", list(SCORES))
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize("seqlen_q, nheads", [(1, 128), (2, 32)])
def test_absorbed_mla_qv_form(seqlen_q, nheads, page_size, num_splits, scores):
    """FlashAttention-3's form: q (.., 64) against k_cache (.., 1, 64) plus qv (.., 512)
    against v_cache (.., 1, 512); scores q k^T + qv v^T, out P v, scale 1 / sqrt(576)."""
    d_rope, dv, batch, capacity = 64, 512, 3, 1500
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("qv", seqlen_q, page_size))
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch, capacity, 1, d_rope, BF16, page_size, gen, head_dim_v=dv
    )
    q = torch.randn(batch, seqlen_q, nheads, d_rope, device="cuda", dtype=BF16, generator=gen)
    qv = torch.randn(batch, seqlen_q, nheads, dv, device="cuda", dtype=BF16, generator=gen)
    lens = torch.tensor([1500, 1, 333], device="cuda", dtype=torch.int32)
    problem = Problem(
        batch=batch, nheads=nheads, nheads_kv=1, head_dim=d_rope + dv, head_dim_v=dv,
        dtype="bfloat16", max_seqlen_q=seqlen_q, max_seqlen_k=capacity, kv_capacity=capacity,
        causal=True, writes_lse=True, kv_layout="paged", page_size=page_size, seqused_k=True,
        qv=True,
    )  # fmt: skip
    variant, (out, lse) = launch(
        problem, AttentionConfig(64, 64, **SCORES[scores]), q, k_cache, v_cache, num_splits,
        True, seqused_k=lens, page_table=page_table, qv=qv,
    )  # fmt: skip
    assert variant.qv and variant.v_in_k and variant.combine_launch == variant.split
    # The same attention with q' = [qv, q] against k' = [v, k].
    q_all, k_all = torch.cat([qv, q], -1), torch.cat([v_pad, k_pad], -1)
    refs, lowps, lse_refs = cache_reference(q_all, k_all, v_pad, lens.tolist(), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("page_size", [None, 64])
def test_api_serves_the_latent_cache(page_size):
    """Through flash_attn_with_kvcache: v_cache a view of
    the latent cache's first 512 dims plans V read from K's columns; a separate v does not."""
    import flash_cute
    from flash_cute.runtime import KVCACHE_PLANS

    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-api", page_size))
    k_cache, _, page_table, k_pad, _ = make_cache(2, 300, 1, 576, BF16, page_size, gen)
    q = torch.randn(2, 1, 64, 576, device="cuda", dtype=BF16, generator=gen)
    lens = torch.tensor([300, 17], device="cuda", dtype=torch.int32)
    call = dict(cache_seqlens=lens, page_table=page_table, return_softmax_lse=True)
    KVCACHE_PLANS.clear()
    out, lse = flash_cute.flash_attn_with_kvcache(q, k_cache, k_cache[..., :512], **call)
    assert [p.v_in_k for p in KVCACHE_PLANS.values()] == [True]
    refs, lowps, lse_refs = cache_reference(q, k_pad, k_pad[..., :512], lens.tolist(), False)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
    # A v of its own with the same shapes: the v_in_k plan refuses it and the call is planned
    # anew (V loaded).
    v_own = k_cache[..., :512].clone()
    again, lse = flash_cute.flash_attn_with_kvcache(q, k_cache, v_own, **call)
    assert sorted(p.v_in_k for p in KVCACHE_PLANS.values()) == [False]
    assert_close_to_reference(*per_batch(again, lse), refs, lowps, lse_refs)


def test_api_serves_qv():
    """FlashAttention-3's qv through flash_attn_with_kvcache, native and FA3 module: default
    scale 1 / sqrt(64 + 512)."""
    import flash_cute
    from flash_cute import flash_attn_interface as fa3

    gen = torch.Generator(device="cuda").manual_seed(stable_seed("qv-api"))
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(2, 300, 1, 64, BF16, 64, gen, 512)
    q = torch.randn(2, 1, 64, 64, device="cuda", dtype=BF16, generator=gen)
    qv = torch.randn(2, 1, 64, 512, device="cuda", dtype=BF16, generator=gen)
    lens = torch.tensor([300, 17], device="cuda", dtype=torch.int32)
    call = dict(cache_seqlens=lens, page_table=page_table, qv=qv, return_softmax_lse=True)
    out, lse = flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    q_all, k_all = torch.cat([qv, q], -1), torch.cat([v_pad, k_pad], -1)
    refs, lowps, lse_refs = cache_reference(q_all, k_all, v_pad, lens.tolist(), False)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
    fa3_out, fa3_lse, *_ = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    assert torch.equal(fa3_out, out) and torch.equal(fa3_lse, lse)


@pytest.mark.parametrize("form", ["latent", "qv"])
def test_api_mla_decode_merged_by_the_combine_kernel_and_replayed(form):
    """DeepSeek decode at batch 1 through flash_attn_with_kvcache: 128 heads against a paged
    latent cache of 3000 keys split so many ways that the combine kernel merges the partials
    (launched after the forward kernel, both captured in the graph); replayed with other
    lengths."""
    import flash_cute
    from flash_cute.runtime import KVCACHE_PLANS

    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-combine", form))
    k_cache, _, page_table, k_pad, _ = make_cache(2, 3000, 1, 576, BF16, 64, gen)
    q = torch.randn(2, 1, 128, 576, device="cuda", dtype=BF16, generator=gen)
    lens = torch.tensor([3000, 1], device="cuda", dtype=torch.int32)
    call = dict(cache_seqlens=lens, page_table=page_table, return_softmax_lse=True)
    if form == "latent":
        args = (q, k_cache, k_cache[..., :512])
    else:  # the same numbers as FlashAttention-3's q / qv and k_cache / v_cache
        k_rope, v_cache = k_cache[..., 512:].contiguous(), k_cache[..., :512].contiguous()
        args = (q[..., 512:].contiguous(), k_rope, v_cache)
        call["qv"] = q[..., :512].contiguous()
        call["softmax_scale"] = 576**-0.5
    KVCACHE_PLANS.clear()
    out, lse = flash_cute.flash_attn_with_kvcache(*args, **call)
    assert [p.merge is not None for p in KVCACHE_PLANS.values()] == [True]
    refs, lowps, lse_refs = cache_reference(q, k_pad, k_pad[..., :512], lens.tolist(), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = flash_cute.flash_attn_with_kvcache(*args, **call)
    g_out.fill_(float("nan"))
    lens.copy_(torch.tensor([17, 2999], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    refs, lowps, lse_refs = cache_reference(q, k_pad, k_pad[..., :512], lens.tolist(), True)
    assert_close_to_reference(*per_batch(g_out, g_lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("form", ["latent", "qv"])
def test_api_mla_varlen_speculative_decoding(form, num_splits):
    """Speculative decoding's call: 1-4 query tokens per sequence packed (varlen), 128 heads
    against a paged latent cache (page 64) of lengths 0, 1 and more, causal, through
    flash_attn_varlen_func; the split heuristic caps a varlen launch's splits (merged in the
    kernel)."""
    import flash_cute

    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-spec", form, num_splits))
    q_lens, k_lens = [1, 4, 2, 3, 1], [3000, 1, 0, 333, 64]
    k_cache, _, page_table, k_pad, _ = make_cache(len(q_lens), 3000, 1, 576, BF16, 64, gen)
    cu_q = cu_seqlens(q_lens)
    lens = torch.tensor(k_lens, device="cuda", dtype=torch.int32)
    q = torch.randn(sum(q_lens), 128, 576, device="cuda", dtype=BF16, generator=gen)
    out = torch.full((sum(q_lens), 128, 512), float("nan"), device="cuda", dtype=BF16)
    call = dict(seqused_k=lens, page_table=page_table, causal=True, num_splits=num_splits)
    if form == "latent":
        flash_cute.flash_attn_varlen_func(
            q, k_cache, k_cache[..., :512], cu_q, max(q_lens), out=out, **call
        )
    else:
        k_rope, v_cache = k_cache[..., 512:].contiguous(), k_cache[..., :512].contiguous()
        flash_cute.flash_attn_varlen_func(
            q[..., 512:].contiguous(), k_rope, v_cache, cu_q, max(q_lens), out=out,
            qv=q[..., :512].contiguous(), softmax_scale=576**-0.5, **call,
        )  # fmt: skip
    starts = cu_q[:-1].tolist()
    refs, lowps, _ = cache_reference(
        torch.stack([torch.nn.functional.pad(q[s : s + n], (0, 0, 0, 0, 4 - n, 0))
                     for s, n in zip(starts, q_lens)]),
        k_pad, k_pad[..., :512], k_lens, True,
    )  # fmt: skip
    for b, (s, n) in enumerate(zip(starts, q_lens)):
        # (queries left-padded to 4 rows: the last n rows are the sequence's, bottom-right
        # aligned like its keys)
        assert_close_to_reference(
            [out[s : s + n].unsqueeze(0)], None, [refs[b][:, 4 - n :]], [lowps[b][:, 4 - n :]],
            None,
        )  # fmt: skip


@pytest.mark.parametrize("d_rope, dv", [(64, 256), (64, 384), (64, 512)])
@pytest.mark.parametrize("causal", [False, True])
def test_api_serves_qv_at_every_pair(d_rope, dv, causal):
    """qv at the pairs FlashAttention-3 takes that flash_cute serves (q's head dim 64, v's
    256 / 384 / 512): prefill through flash_attn_func (GQA, seqlen_q != seqlen_k) and a split
    decode over a paged cache, against q' = [qv, q] and k' = [v, k] in float32 (default scale
    1 / sqrt(d + dv))."""
    import flash_cute
    from flash_cute.reference import attention_ref, error_bound

    gen = torch.Generator(device="cuda").manual_seed(stable_seed("qv-pairs", d_rope, dv, causal))

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=BF16, generator=gen)

    q, k, qv, v = (
        rand(2, 113, 8, d_rope),
        rand(2, 1000, 2, d_rope),
        rand(2, 113, 8, dv),
        rand(2, 1000, 2, dv),
    )
    out = torch.full((2, 113, 8, dv), float("nan"), device="cuda", dtype=BF16)
    got, lse = flash_cute.flash_attn_func(q, k, v, causal=causal, qv=qv, out=out, return_lse=True)
    q_all, k_all = torch.cat([qv, q], -1), torch.cat([v, k], -1)
    scale = (d_rope + dv) ** -0.5
    ref, lse_ref = attention_ref(q_all, k_all, v, scale, causal)
    lowp, _ = attention_ref(q_all, k_all, v, scale, causal, upcast=False)
    assert got is out
    assert (got.float() - ref).abs().max().item() <= error_bound(lowp, ref)
    assert torch.allclose(lse, lse_ref, atol=1e-3, rtol=1e-3)

    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(3, 700, 1, d_rope, BF16, 64, gen, dv)
    q, qv = rand(3, 1, 32, d_rope), rand(3, 1, 32, dv)
    lens = torch.tensor([700, 1, 333], device="cuda", dtype=torch.int32)
    for num_splits in (1, 0):
        out, lse = flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, page_table=page_table, qv=qv,
            causal=causal, num_splits=num_splits, return_softmax_lse=True,
        )  # fmt: skip
        q_all, k_all = torch.cat([qv, q], -1), torch.cat([v_pad, k_pad], -1)
        refs, lowps, lse_refs = cache_reference(q_all, k_all, v_pad, lens.tolist(), causal)
        assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
