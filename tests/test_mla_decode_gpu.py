"""GPU checks of the absorbed-MLA decode kernel (kernels/mla_decode/, config.seesaw): both call
forms (FlashMLA's 576-wide latent with v its first 512 dims, FlashAttention-3's qv), padded and
paged caches, 1-4 query tokens (padded, or packed through flash_attn_varlen_func), 8-128
heads, splits, graph replay, bf16 and fp16, against the float32 reference on poisoned
outputs. Each case plans its variant with the seesaw config and launches it through a launch
plan (the varlen case through the API)."""

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
    seqs,
)

from flash_cute.call import Call
from flash_cute.config import seesaw_config
from flash_cute.forward import kernel_call_args
from flash_cute.plan import Problem, plan_forward
from flash_cute.reference import stable_seed
from flash_cute.runtime import LaunchPlan, num_sms

pytestmark = pytest.mark.gpu
D, DV = 576, 512
# Key counts: one key, a partial block alone, even and odd block counts, partial last blocks.
LENS = [1500, 1, 333, 17, 1000, 4097]
CAPACITY = 4160


def _problem(batch, seqlen_q, nheads, dtype, page_size, causal, qv):
    return Problem(
        batch=batch, nheads=nheads, nheads_kv=1, head_dim=D, head_dim_v=DV, dtype=dtype,
        max_seqlen_q=seqlen_q, max_seqlen_k=CAPACITY, kv_capacity=CAPACITY, causal=causal,
        writes_lse=True, kv_layout="paged" if page_size else "padded", page_size=page_size,
        seqused_k=True, v_in_k=not qv, qv=qv,
    )  # fmt: skip


def _case(seqlen_q, nheads, page_size, dtype, qv, gen):
    """(q, k, v, qv or None, page_table, q and k as the reference takes them, v padded)."""
    batch = len(LENS)
    if qv:
        k_cache, v_cache, table, k_pad, v_pad = make_cache(
            batch, CAPACITY, 1, D - DV, dtype, page_size, gen, head_dim_v=DV
        )
        q = torch.randn(batch, seqlen_q, nheads, D - DV, device="cuda", dtype=dtype, generator=gen)
        q_v = torch.randn(batch, seqlen_q, nheads, DV, device="cuda", dtype=dtype, generator=gen)
        ref_q, ref_k = torch.cat([q_v, q], -1), torch.cat([v_pad, k_pad], -1)
        return q, k_cache, v_cache, q_v, table, ref_q, ref_k, v_pad
    k_cache, _, table, k_pad, _ = make_cache(batch, CAPACITY, 1, D, dtype, page_size, gen)
    q = torch.randn(batch, seqlen_q, nheads, D, device="cuda", dtype=dtype, generator=gen)
    return q, k_cache, k_cache[..., :DV], None, table, q, k_pad, k_pad[..., :DV]


def _poison_past(cache, table, lengths, page_size):
    """NaN in every cache slot past each sequence's length (V's rows there must not reach O)."""
    for b, n in enumerate(lengths):
        slots = torch.arange(n, CAPACITY, device="cuda")
        if page_size is None:
            cache[b, n:] = float("nan")
        else:
            pages = table[b, slots // page_size].long()
            cache[pages, slots % page_size] = float("nan")


def _launch(problem, q, k, v, num_splits, **tensors):
    plan = plan_forward(problem, num_sms(0), seesaw_config(), num_splits)
    assert plan.variant.config.seesaw
    out = torch.full((*q.shape[:-1], DV), float("nan"), device="cuda", dtype=q.dtype)
    lse_shape = (problem.batch, problem.nheads, problem.max_seqlen_q)
    runner = LaunchPlan.build(plan, q, k, v, out, lse_shape, math.log2(math.e) / math.sqrt(D))
    return plan, runner, out, tensors


@pytest.mark.parametrize("qv", [False, True], ids=["latent", "qv"])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [None, 64, 128])
@pytest.mark.parametrize("seqlen_q, nheads", [(1, 128), (2, 64), (1, 16), (2, 128)])
def test_decode(seqlen_q, nheads, page_size, num_splits, qv):
    _check_decode(seqlen_q, nheads, page_size, num_splits, qv)


# The other head counts and token counts the plan routes here (plan.SEESAW_HEADS, up to
# SEESAW_MAX_TOKENS): (tokens, heads, page_size, num_splits, qv), the forms spread over them.
SHAPES = [
    (1, 8, 64, 0, False),
    (4, 8, None, 3, False),
    (2, 16, 128, 0, False),
    (4, 16, 64, 1, True),
    (3, 16, None, 0, False),
    (1, 32, None, 0, False),
    (3, 32, 64, 3, False),
    (2, 32, 64, 0, True),
    (4, 64, 64, 0, False),
    (3, 64, None, 1, True),
    (3, 128, None, 1, False),
    (4, 128, 64, 0, False),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "s{}-h{}-p{}-n{}-qv{:d}".format(*c))
def test_heads_and_tokens(shape):
    _check_decode(*shape)


def _check_decode(seqlen_q, nheads, page_size, num_splits, qv):
    gen = torch.Generator(device="cuda").manual_seed(
        stable_seed("seesaw", seqlen_q, nheads, page_size)
    )
    case = _case(seqlen_q, nheads, page_size, torch.bfloat16, qv, gen)
    q, k, v, q_v, table, ref_q, ref_k, ref_v = case
    for cache in (k, v) if qv else (k,):  # (the latent's v is a view of k)
        _poison_past(cache, table, LENS, page_size)
    lens = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    problem = _problem(len(LENS), seqlen_q, nheads, "bfloat16", page_size, True, qv)
    plan, runner, out, _ = _launch(problem, q, k, v, num_splits)
    call = Call(q, k, v, seqused_k=lens, page_table=table, qv=q_v)
    out, lse = runner.launch(q, k, v, out, kernel_call_args(call))
    refs, lowps, lse_refs = cache_reference(ref_q, ref_k, ref_v, LENS, True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes_masks_and_graph_replay(dtype, causal):
    """Both 16-bit dtypes, with and without the causal mask (2 query tokens), then a CUDA graph
    of the launch replayed with other lengths."""
    name = str(dtype).split(".")[-1]
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("seesaw-graph", name, causal))
    q, k, v, _, table, ref_q, ref_k, ref_v = _case(2, 128, 64, dtype, False, gen)
    lens = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    problem = _problem(len(LENS), 2, 128, name, 64, causal, False)
    plan, runner, out, _ = _launch(problem, q, k, v, 0)
    args = kernel_call_args(Call(q, k, v, seqused_k=lens, page_table=table))
    out, lse = runner.launch(q, k, v, out, args)
    refs, lowps, lse_refs = cache_reference(ref_q, ref_k, ref_v, LENS, causal)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = runner.launch(q, k, v, out, args)
    new_lens = [64, 4160, 2, 129, 3, 1999]
    lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    g_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    refs, lowps, lse_refs = cache_reference(ref_q, ref_k, ref_v, new_lens, causal)
    assert_close_to_reference(*per_batch(g_out, g_lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("qv", [False, True], ids=["latent", "qv"])
@pytest.mark.parametrize("nheads, seqlen_q", [(128, 1), (16, 2)])
def test_api_routes_latent_decode_here(nheads, seqlen_q, qv):
    """flash_attn_with_kvcache at shapes the plan sends to this kernel (plan.seesaw_route_problem),
    against the reference."""
    import flash_cute
    from flash_cute.runtime import KVCACHE_PLANS

    batch, keys = num_sms(0), 320
    gen = torch.Generator(device="cuda").manual_seed(
        stable_seed("seesaw-api", nheads, seqlen_q, qv)
    )
    lens = torch.randint(1, keys + 1, (batch,), device="cuda", dtype=torch.int32, generator=gen)
    call = dict(cache_seqlens=lens, causal=True, return_softmax_lse=True)
    KVCACHE_PLANS.clear()
    new = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    if qv:
        k_rope, v_cache, table, k_pad, v_pad = make_cache(
            batch, keys, 1, D - DV, torch.bfloat16, 64, gen, head_dim_v=DV
        )
        q = torch.randn(batch, seqlen_q, nheads, D - DV, **new)
        q_v = torch.randn(batch, seqlen_q, nheads, DV, **new)
        out, lse = flash_cute.flash_attn_with_kvcache(
            q, k_rope, v_cache, qv=q_v, page_table=table, **call
        )
        ref_q, ref_k = torch.cat([q_v, q], -1), torch.cat([v_pad, k_pad], -1)
    else:
        k_cache, _, table, k_pad, _ = make_cache(batch, keys, 1, D, torch.bfloat16, 64, gen)
        q = torch.randn(batch, seqlen_q, nheads, D, **new)
        out, lse = flash_cute.flash_attn_with_kvcache(
            q, k_cache, k_cache[..., :DV], page_table=table, **call
        )
        ref_q, ref_k, v_pad = q, k_pad, k_pad[..., :DV]
    assert [p.variant.config.seesaw for p in KVCACHE_PLANS.values()] == [True]
    KVCACHE_PLANS.clear()
    refs, lowps, lse_refs = cache_reference(ref_q, ref_k, v_pad, lens.tolist(), True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


def test_scores_far_below_zero():
    """Every score about -4096 (the rope columns alone: q's -8 against the keys' 8), far below
    what 2^(-max * scale) can hold: the first rescale of each row must give 0, not inf (0 * inf
    would be NaN), and the output the mean of V."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("seesaw-negative"))
    k, _, table, k_pad, _ = make_cache(len(LENS), CAPACITY, 1, D, torch.bfloat16, 64, gen)
    k[..., :DV] *= 0.1
    k[..., DV:] = 8.0
    k_pad = k_pad.clone()
    k_pad[..., :DV] *= 0.1
    k_pad[..., DV:] = 8.0
    q = torch.zeros(len(LENS), 1, 128, D, device="cuda", dtype=torch.bfloat16)
    q[..., DV:] = -8.0
    lens = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    problem = _problem(len(LENS), 1, 128, "bfloat16", 64, True, False)
    plan, runner, out, _ = _launch(problem, q, k, k[..., :DV], 1)
    call = Call(q, k, k[..., :DV], seqused_k=lens, page_table=table)
    out, lse = runner.launch(q, k, k[..., :DV], out, kernel_call_args(call))
    refs, lowps, lse_refs = cache_reference(q, k_pad, k_pad[..., :DV], LENS, True)
    assert_close_to_reference(*per_batch(out, lse), refs, lowps, lse_refs)


@pytest.mark.parametrize("qv", [False, True], ids=["latent", "qv"])
@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("nheads", [16, 128])
def test_varlen_queries_route_here(nheads, num_splits, qv):
    """flash_attn_varlen_func with packed queries of 1-4 tokens a sequence (speculative
    decoding) over a paged latent cache: the plan sends it to this kernel; against the
    reference, outputs poisoned, the cache NaN past each sequence's length."""
    import flash_cute
    from flash_cute.runtime import VARLEN_PLANS

    q_lens, lens = [1, 4, 2, 3, 1, 4], LENS
    gen = torch.Generator(device="cuda").manual_seed(
        stable_seed("seesaw-varlen", nheads, num_splits, qv)
    )
    new = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    batch, total_q = len(lens), sum(q_lens)
    if qv:
        k, v, table, k_pad, v_pad = make_cache(
            batch, CAPACITY, 1, D - DV, torch.bfloat16, 64, gen, head_dim_v=DV
        )
        q, q_v = (
            torch.randn(total_q, nheads, D - DV, **new),
            torch.randn(total_q, nheads, DV, **new),
        )
        ref_q, ref_k = torch.cat([q_v, q], -1), torch.cat([v_pad, k_pad], -1)
        for cache in (k, v):
            _poison_past(cache, table, lens, 64)
    else:
        k, _, table, k_pad, _ = make_cache(batch, CAPACITY, 1, D, torch.bfloat16, 64, gen)
        q, q_v = torch.randn(total_q, nheads, D, **new), None
        ref_q, ref_k, v_pad = q, k_pad, k_pad[..., :DV]
        _poison_past(k, table, lens, 64)
        v = k[..., :DV]
    cu_q = cu_seqlens(q_lens)
    out = torch.full((total_q, nheads, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    VARLEN_PLANS.clear()
    _, lse = flash_cute.flash_attn_varlen_func(
        q, k, v, cu_q, max(q_lens), qv=q_v, page_table=table, causal=True,
        seqused_k=torch.tensor(lens, device="cuda", dtype=torch.int32), num_splits=num_splits,
        return_softmax_lse=True, out=out,
    )  # fmt: skip
    assert [p.variant.config.seesaw for p in VARLEN_PLANS.values()] == [True]
    VARLEN_PLANS.clear()
    refs, lowps, lse_refs = reference_per_sequence(
        seqs(ref_q, q_lens),
        [ref_k[b : b + 1, :n] for b, n in enumerate(lens)],
        [v_pad[b : b + 1, :n] for b, n in enumerate(lens)],
        True,
    )
    assert_close_to_reference(seqs(out, q_lens), seqs(lse, q_lens, dim=1), refs, lowps, lse_refs)
