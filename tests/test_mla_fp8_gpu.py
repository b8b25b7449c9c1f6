"""GPU checks of absorbed-MLA decode on an FP8 (float8_e4m3fn) latent cache (the latent decode
kernel: the seesaw converting in place, kernels/mla_decode/fp8_loads.py, and for tiles of at
most 32 rows the transposed kernel, kernels/mla_decode/transposed.py), through
flash_attn_with_kvcache: FlashMLA's form (one 576-wide cache, v a view of its first 512
columns), padded and paged caches, 1-4 query tokens (padded, or packed through
flash_attn_varlen_func), 8-128 heads, splits, descales (none, one value, per batch and head),
bf16 and fp16 q, graph replay. Against the float32 reference on the dequantized cache, within
the bar of the same math in q's dtype on it (tests/test_fp8_kv_gpu.py's check); outputs
poisoned, slots past each sequence NaN bytes."""

import pytest
import torch
from kv_cases import cu_seqlens, seqs
from test_fp8_kv_gpu import check_against_dequantized, descales, fp8_cache, padded, poison_past

import flash_cute
from flash_cute import plan
from flash_cute.config import TRANSPOSED_ROWS
from flash_cute.reference import stable_seed
from flash_cute.runtime import KVCACHE_PLANS, VARLEN_PLANS

pytestmark = pytest.mark.gpu
D, DV = 576, 512
# One key, a partial block alone, even and odd block counts, partial last blocks.
LENS = [1500, 1, 333, 17, 1000, 4097]
CAPACITY = 4160

CASES = [
    # (q heads, tokens, page_size, num_splits, dtype, descale)
    (128, 1, 64, 0, torch.bfloat16, "tensor"),
    (128, 2, None, 1, torch.bfloat16, "scalar"),
    (128, 1, 128, 3, torch.float16, None),
    (64, 2, 64, 0, torch.bfloat16, "tensor"),
    (64, 1, None, 0, torch.float16, "scalar"),
    (16, 1, 64, 0, torch.bfloat16, "tensor"),
    (16, 1, None, 1, torch.bfloat16, None),
    (16, 1, 256, 5, torch.float16, "tensor"),
    (16, 2, None, 0, torch.bfloat16, "scalar"),
    (8, 4, 64, 0, torch.bfloat16, "tensor"),
    # 8 heads on 16-row tiles: half a tile empty, or two tokens a tile (a causal boundary in it).
    (8, 1, 64, 0, torch.bfloat16, "tensor"),
    (8, 2, None, 3, torch.float16, "scalar"),
    (32, 1, 64, 3, torch.float16, None),
    (32, 3, 128, 0, torch.bfloat16, "tensor"),
    (128, 4, 64, 0, torch.bfloat16, "tensor"),
]


def _run(q, cache, table, lengths, causal, kd, vd, **kw):
    out = torch.full((*q.shape[:-1], DV), float("nan"), device="cuda", dtype=q.dtype)
    _, lse = flash_cute.flash_attn_with_kvcache(
        q, cache, cache[..., :DV], cache_seqlens=lengths, page_table=table, causal=causal,
        out=out, return_softmax_lse=True, k_descale=kd, v_descale=vd, **kw,
    )  # fmt: skip
    return out, lse


def _case_id(c):
    return f"h{c[0]}-s{c[1]}-p{c[2]}-n{c[3]}-{c[5]}"


def _tile_rows(rows: int, transposed: bool = True) -> int:
    """The seesaw_rows the plan picks for sequences of `rows` rows: the transposed kernel's
    fewest tile rows that hold them (16 or 32), else the seesaw's 64."""
    fits = [r for r in TRANSPOSED_ROWS if rows <= r]
    return fits[0] if transposed and fits else 64


# Tiles of at most 32 rows take the transposed kernel (plan.SEESAW_TRANSPOSED); forced onto
# the seesaw too.
SMALL = [c for c in CASES if c[0] * c[1] <= 32]


@pytest.mark.parametrize(
    "case, transposed",
    [(c, True) for c in CASES] + [(c, False) for c in SMALL],
    ids=lambda x: _case_id(x) if isinstance(x, tuple) else ("t" if x else "seesaw"),
)
def test_fp8_latent_decode(case, transposed, monkeypatch):
    nheads, seqlen_q, page_size, num_splits, dtype, descale = case
    monkeypatch.setattr(plan, "SEESAW_TRANSPOSED", transposed)
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-fp8", case))
    batch = len(LENS)
    cache, _, table = fp8_cache(batch, CAPACITY, 1, D, page_size, gen)
    k_pad = padded(cache, table, CAPACITY)
    poison_past(cache, table, LENS, CAPACITY)
    q = torch.randn(batch, seqlen_q, nheads, D, device="cuda", dtype=dtype, generator=gen)
    kd, vd = descales(descale, batch, 1, gen)
    lengths = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    KVCACHE_PLANS.clear()
    out, lse = _run(q, cache, table, lengths, True, kd, vd, num_splits=num_splits)
    plans = list(KVCACHE_PLANS.values())
    rows = _tile_rows(nheads * seqlen_q, transposed)
    assert [
        (p.variant.config.seesaw, p.variant.config.seesaw_rows, p.variant.kv_dtype) for p in plans
    ] == [(True, rows, "float8_e4m3fn")]
    KVCACHE_PLANS.clear()
    check_against_dequantized(q, out, k_pad, k_pad[..., :DV], kd, vd, LENS, True, lse=lse)


@pytest.mark.parametrize("nheads", [128, 16])  # (16 x 2 tokens: the transposed kernel)
def test_fp8_latent_graph_replay(nheads):
    """A CUDA graph of a call replayed with other lengths (and a non-causal call first)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-fp8-graph", nheads))
    batch = len(LENS)
    cache, _, table = fp8_cache(batch, CAPACITY, 1, D, 64, gen)
    k_pad = padded(cache, table, CAPACITY)
    q = torch.randn(batch, 2, nheads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kd, vd = descales("tensor", batch, 1, gen)
    lengths = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    out, lse = _run(q, cache, table, lengths, False, kd, vd)
    check_against_dequantized(q, out, k_pad, k_pad[..., :DV], kd, vd, LENS, False, lse=lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = _run(q, cache, table, lengths, True, kd, vd)
    new_lens = [64, 4160, 2, 129, 3, 1999]
    lengths.copy_(torch.tensor(new_lens, dtype=torch.int32))
    g_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_dequantized(q, g_out, k_pad, k_pad[..., :DV], kd, vd, new_lens, True, lse=g_lse)


@pytest.mark.parametrize("nheads, page_size", [(16, None), (32, 64)])
def test_fp8_latent_rising_maxima(nheads, page_size):
    """Keys whose scale grows toward the sequence's start (the transposed kernel's last
    blocks): the columns' maxima pass their references by more than the headroom again after
    the first block (1-5 times a warpgroup on the longer sequences, in a NumPy model), so O^T,
    the sums and the references move there too; a vote that never fired after the first block
    would overflow P's fp16 at 4097 keys."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-fp8-rising", nheads))
    batch = len(LENS)
    cache, _, table = fp8_cache(batch, CAPACITY, 1, D, page_size, gen)
    k_pad = padded(cache, table, CAPACITY)
    growth = 0.25 + 4.0 * torch.linspace(1.0, 0.0, CAPACITY, device="cuda")  # by position
    k_pad = (k_pad * growth[None, :, None, None]).to(cache.dtype)
    if table is None:
        cache = k_pad.clone()
    else:  # the pages in table order hold the padded rows (CAPACITY: whole pages)
        assert CAPACITY % page_size == 0
        rows = k_pad.view(torch.uint8).unflatten(1, (-1, page_size))
        cache.view(torch.uint8)[table.long()] = rows
    k_pad = padded(cache, table, CAPACITY)
    poison_past(cache, table, LENS, CAPACITY)
    q = torch.randn(batch, 1, nheads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    KVCACHE_PLANS.clear()
    out, lse = _run(q, cache, table, lengths, True, None, None)
    assert [p.variant.config.seesaw_rows for p in KVCACHE_PLANS.values()] == [_tile_rows(nheads)]
    KVCACHE_PLANS.clear()
    check_against_dequantized(q, out, k_pad, k_pad[..., :DV], None, None, LENS, True, lse=lse)


VARLEN_CASES = [
    # (q heads, tokens per sequence, page_size, num_splits, causal, max_seqlen_q given)
    (8, (1, 4, 2, 3, 1, 4), 64, 0, True, 4),
    (16, (1, 2, 2, 1, 1, 2), 128, 1, True, 2),
    (16, (1, 2, 2, 1, 1, 2), 64, 0, False, 2),
    (128, (1, 4, 2, 3, 1, 4), 64, 3, True, 4),
    # max_seqlen_q is a hint: one below the longest sequence still covers it. The transposed
    # kernel's tiles hold the rows the hint says (16 or 32): longer sequences take two
    # (m_block 1), e.g. 32 rows in tiles of 16 and 48-64 in tiles of 32.
    (16, (1, 2, 2, 1, 1, 2), 64, 0, True, 1),
    (16, (1, 2, 4, 1, 3, 2), 64, 0, True, 2),
    (16, (1, 2, 4, 1, 3, 2), 64, 2, False, 2),
    (8, (1, 6, 2, 5, 1, 4), 64, 3, True, 4),
    (8, (1, 2, 2, 1, 1, 2), 64, 0, True, 2),  # 16-row tiles of two tokens
    (8, (1, 3, 2, 1, 3, 2), 64, 2, True, 2),  # 24 rows: two tiles of 16
]


@pytest.mark.parametrize(
    "case", VARLEN_CASES, ids=lambda c: f"h{c[0]}-p{c[2]}-n{c[3]}-c{c[4]:d}-max{c[5]}"
)
def test_fp8_latent_varlen_queries(case):
    """flash_attn_varlen_func with packed queries of 1-6 tokens a sequence over a paged FP8
    latent cache, per sequence against the dequantized cache: the transposed kernel where
    max_seqlen_q says at most 32 rows (q heads x tokens; its tiles hold that many, 16 or 32,
    so a longer sequence takes two), the seesaw above."""
    nheads, q_lens, page_size, num_splits, causal, max_seqlen_q = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("mla-fp8-varlen", case))
    batch, total_q = len(LENS), sum(q_lens)
    cache, _, table = fp8_cache(batch, CAPACITY, 1, D, page_size, gen)
    k_pad = padded(cache, table, CAPACITY)
    poison_past(cache, table, LENS, CAPACITY)
    q = torch.randn(total_q, nheads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kd, vd = descales("tensor", batch, 1, gen)
    cu_q = cu_seqlens(q_lens)
    out = torch.full((total_q, nheads, DV), float("nan"), device="cuda", dtype=q.dtype)
    VARLEN_PLANS.clear()
    _, lse = flash_cute.flash_attn_varlen_func(
        q, cache, cache[..., :DV], cu_q, max_seqlen_q, page_table=table, causal=causal,
        seqused_k=torch.tensor(LENS, device="cuda", dtype=torch.int32), num_splits=num_splits,
        k_descale=kd, v_descale=vd, return_softmax_lse=True, out=out,
    )  # fmt: skip
    rows = _tile_rows(nheads * max_seqlen_q)
    assert [p.variant.config.seesaw_rows for p in VARLEN_PLANS.values()] == [rows]
    VARLEN_PLANS.clear()
    for b, (q_b, out_b, lse_b) in enumerate(
        zip(seqs(q, q_lens), seqs(out, q_lens), seqs(lse, q_lens, dim=1))
    ):
        check_against_dequantized(
            q_b, out_b, k_pad[b : b + 1], k_pad[b : b + 1, :, :, :DV], kd[b : b + 1],
            vd[b : b + 1], [LENS[b]], causal, lse=lse_b,
        )  # fmt: skip
