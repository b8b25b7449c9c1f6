"""FP8 (float8_e4m3fn) K/V caches on a Hopper GPU: against the float32 reference computed on the
dequantized cache (k_cache * k_descale[b, h]), within the bar of 16-bit attention (error <= 2 x
that of the same math in q's dtype by PyTorch on the dequantized cache, plus a floor). Outputs
are poisoned (NaN) before each call; cache slots past each sequence hold NaN."""

import functools

import pytest
import torch
from kv_cases import assert_close_to_reference, captured, cu_seqlens, reference_per_sequence

import flash_cute
from flash_cute.reference import stable_seed

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
NAN_FP8 = 0x7F  # e4m3fn's NaN byte


def fp8_cache(batch, capacity, nheads_kv, head_dim, page_size, gen):
    """(k_cache, v_cache, page_table) in float8_e4m3fn, paged in a random page order when
    page_size; every slot is random (|x| up to ~4: e4m3 normals and subnormals both)."""
    if page_size is None:
        shape, table = (batch, capacity, nheads_kv, head_dim), None
    else:
        pages = -(-capacity // page_size)
        num_pages = batch * pages + 3
        shape = (num_pages, page_size, nheads_kv, head_dim)
        perm = torch.randperm(num_pages, device="cuda", generator=gen)[: batch * pages]
        table = perm.view(batch, pages).to(torch.int32)
    k, v = (torch.randn(shape, device="cuda", generator=gen).to(FP8) for _ in range(2))
    return k, v, table


def padded(cache, table, capacity):
    """(batch, capacity, h, d) float32 view of a cache (paged: its pages in table order)."""
    if table is not None:  # (uint8 view: indexing float8 tensors is not everywhere)
        rows = cache.view(torch.uint8)[table.long()].flatten(1, 2)[:, :capacity]
        cache = rows.view(FP8)
    return cache.float()


def poison_past(cache, table, lengths, capacity, firsts=None):
    """NaN bytes in every slot past each sequence's length, and before its first slot where
    firsts (left padding) are given: what a reused cache may hold."""
    raw = cache.view(torch.uint8)
    for b, n in enumerate(lengths):
        slots = list(range(n, capacity)) + list(range(firsts[b] if firsts else 0))
        if table is None:
            raw[b, slots] = NAN_FP8
        else:
            page = cache.shape[1]
            for slot in slots:
                raw[table[b, slot // page].item(), slot % page] = NAN_FP8


def descales(kind, batch, nheads_kv, gen):
    if kind is None:
        return None, None
    if kind == "scalar":  # as engines pass one scale: a stride-0 expansion
        return tuple(torch.tensor(s, device="cuda").expand(batch, nheads_kv) for s in (0.7, 1.9))
    return tuple(
        torch.rand(batch, nheads_kv, device="cuda", generator=gen) * 1.75 + 0.25 for _ in range(2)
    )


def check_against_dequantized(q, out, k_pad, v_pad, kd, vd, lengths, causal, mask=None, lse=None):
    """out (batch, sq, h, dv) against attention over k_pad * kd, v_pad * vd per sequence."""
    batch = q.shape[0]
    if kd is not None:
        k_pad = k_pad * kd[:, None, :, None]
        v_pad = v_pad * vd[:, None, :, None]
    qs = [q[b : b + 1] for b in range(batch)]
    ks = [k_pad[b : b + 1, : lengths[b]] for b in range(batch)]
    vs = [v_pad[b : b + 1, : lengths[b]] for b in range(batch)]
    # The float32 reference, and the input-dtype math on the dequantized cache rounded to q's
    # dtype (its lowp outputs are the bar's).
    refs, _, lse_refs = reference_per_sequence([x.float() for x in qs], ks, vs, causal, mask)
    _, lowps, _ = reference_per_sequence(
        qs, [k.to(q.dtype) for k in ks], [v.to(q.dtype) for v in vs], causal, mask
    )
    lses = None if lse is None else [lse[b : b + 1] for b in range(batch)]
    assert_close_to_reference([out[b : b + 1] for b in range(batch)], lses, refs, lowps, lse_refs)


DECODE_CASES = [
    # (head_dim, page_size, num_splits, heads, dtype)
    (64, None, 1, (32, 8), torch.bfloat16),
    (64, 64, 0, (32, 8), torch.bfloat16),
    (128, None, 1, (32, 8), torch.bfloat16),
    (128, None, 0, (32, 8), torch.bfloat16),
    (128, 16, 0, (32, 8), torch.bfloat16),
    (128, 64, 3, (32, 8), torch.bfloat16),
    (128, 64, 0, (8, 8), torch.bfloat16),
    (128, None, 0, (32, 8), torch.float16),
    (128, 16, 1, (64, 8), torch.float16),
    (256, None, 0, (32, 8), torch.bfloat16),
    (256, 64, 1, (16, 2), torch.bfloat16),
    (96, None, 0, (8, 1), torch.bfloat16),
    # Pages no TMA box follows: rows gathered with cp.async by the TMA warp.
    (128, 1, 0, (32, 8), torch.bfloat16),
    (64, 8, 3, (16, 4), torch.float16),
    (256, 24, 0, (16, 2), torch.bfloat16),
]


@pytest.mark.parametrize("descale", [None, "scalar", "tensor"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"d{c[0]}-p{c[1]}-s{c[2]}-{c[3]}")
def test_fp8_decode(case, descale):
    head_dim, page_size, num_splits, (nheads, nheads_kv), dtype = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8", case, descale))
    batch, capacity = 4, 1100
    lengths = [1, 17, 1000, 1100]
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, page_size, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    poison_past(k_cache, table, lengths, capacity)
    poison_past(v_cache, table, lengths, capacity)
    q = torch.randn(batch, 1, nheads, head_dim, device="cuda", dtype=dtype, generator=gen)
    kd, vd = descales(descale, batch, nheads_kv, gen)
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, device="cuda", dtype=torch.int32),
        page_table=table, causal=True, num_splits=num_splits, out=out, return_softmax_lse=True,
        k_descale=kd, v_descale=vd,
    )  # fmt: skip
    check_against_dequantized(q, out, k_pad, v_pad, kd, vd, lengths, True, lse=lse)


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, mask", [(128, {}), (64, dict(window_size=(100, 0)))])
def test_fp8_chunked_prefill(page_size, dtype, head_dim, mask):
    """113 new queries per sequence against an FP8 cache holding them (prefill in chunks). A
    short window at head dim 64 takes the short-window table row (three CTAs per SM), whose
    FP8 form must run one."""
    gen = torch.Generator(device="cuda").manual_seed(
        stable_seed("fp8 prefill", page_size, dtype, head_dim)
    )
    batch, capacity, nheads, nheads_kv, seqlen_q = 3, 4097, 16, 4, 113
    lengths = [4097, 1000, 113]
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, page_size, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    poison_past(k_cache, table, lengths, capacity)
    poison_past(v_cache, table, lengths, capacity)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype, generator=gen)
    kd, vd = descales("tensor", batch, nheads_kv, gen)
    out = torch.full_like(q, float("nan"))
    flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, device="cuda", dtype=torch.int32),
        page_table=table, causal=True, out=out, k_descale=kd, v_descale=vd, **mask,
    )  # fmt: skip
    check_against_dequantized(q, out, k_pad, v_pad, kd, vd, lengths, True, mask=mask)


MASKS = {
    "softcap": dict(softcap=30.0),
    "window": dict(window_size=(100, 0)),
    "sink": "sink",
}


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_fp8_masks(mask_name):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 mask", mask_name))
    batch, capacity, nheads, nheads_kv, head_dim = 3, 700, 32, 8, 128
    lengths = [1, 333, 700]
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, 64, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    poison_past(k_cache, table, lengths, capacity)
    poison_past(v_cache, table, lengths, capacity)
    q = torch.randn(batch, 2, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kd, vd = descales("tensor", batch, nheads_kv, gen)
    kwargs = MASKS[mask_name]
    if kwargs == "sink":
        kwargs = dict(learnable_sink=torch.randn(nheads, device="cuda", generator=gen))
    out = torch.full_like(q, float("nan"))
    flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, device="cuda", dtype=torch.int32),
        page_table=table, causal=True, out=out, k_descale=kd, v_descale=vd, **kwargs,
    )  # fmt: skip
    check_against_dequantized(q, out, k_pad, v_pad, kd, vd, lengths, True, mask=kwargs)


@pytest.mark.parametrize("num_splits", [1, 0])
def test_fp8_varlen_paged(num_splits):
    """flash_attn_varlen_func over a paged FP8 cache (an engine's mixed prefill + decode)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 varlen", num_splits))
    seqlens_q, lengths = [1, 17, 5, 113], [1, 900, 17, 2000]
    batch, capacity, nheads, nheads_kv, head_dim = 4, 2048, 16, 2, 128
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, 16, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    poison_past(k_cache, table, lengths, capacity)
    poison_past(v_cache, table, lengths, capacity)
    q = torch.randn(sum(seqlens_q), nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=gen)  # fmt: skip
    kd, vd = descales("tensor", batch, nheads_kv, gen)
    out = torch.full_like(q, float("nan"))
    flash_cute.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(seqlens_q), max(seqlens_q),
        seqused_k=torch.tensor(lengths, device="cuda", dtype=torch.int32), page_table=table,
        causal=True, num_splits=num_splits, out=out, k_descale=kd, v_descale=vd,
    )  # fmt: skip
    starts = [sum(seqlens_q[:b]) for b in range(batch)]
    for b in range(batch):
        rows = slice(starts[b], starts[b] + seqlens_q[b])
        check_against_dequantized(
            q[None, rows], out[None, rows], k_pad[b : b + 1], v_pad[b : b + 1], kd[b : b + 1],
            vd[b : b + 1], [lengths[b]], True,
        )  # fmt: skip


def test_fp8_decode_graph_replay():
    """A captured FP8 decode step replays as one kernel with new lengths and queries."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, capacity, nheads, nheads_kv, head_dim = 2, 4096, 32, 8, 128
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, 64, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    q = torch.randn(batch, 1, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kd, vd = descales("tensor", batch, nheads_kv, gen)
    lengths = torch.full((batch,), capacity, device="cuda", dtype=torch.int32)

    def step():
        return flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, page_table=table, causal=True,
            num_splits=8, k_descale=kd, v_descale=vd,
        )  # fmt: skip

    graph, graph_out = captured(step)
    for _ in range(3):
        lengths.copy_(torch.randint(1, capacity + 1, (batch,), device="cuda", generator=gen))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_against_dequantized(q, graph_out, k_pad, v_pad, kd, vd, lengths.tolist(), True)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_fp8_left_padded_pages(page_size, num_splits):
    """cache_leftpad on paged FP8 caches (rows gathered at any page size) with cache_batch_idx:
    sequence b reads slots leftpad[b] .. cache_seqlens[b] of cache row idx[b]."""
    seed = stable_seed("fp8 leftpad", page_size, num_splits)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch, rows, capacity, nheads, nheads_kv, head_dim = 4, 6, 1100, 16, 4, 128
    lengths, firsts = [1, 700, 1100, 40], [0, 300, 17, 39]
    k_cache, v_cache, table = fp8_cache(rows, capacity, nheads_kv, head_dim, page_size, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    idx = torch.randperm(rows, device="cuda", generator=gen)[:batch].to(torch.int32)
    for cache in (k_cache, v_cache):
        poison_past(cache, table[idx.long()], lengths, capacity, firsts)
    q = torch.randn(batch, 2, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kd, vd = descales("tensor", batch, nheads_kv, gen)
    out = torch.full_like(q, float("nan"))
    as_i32 = functools.partial(torch.tensor, device="cuda", dtype=torch.int32)
    flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=as_i32(lengths), page_table=table,
        cache_batch_idx=idx, cache_leftpad=as_i32(firsts), causal=True, num_splits=num_splits,
        out=out, k_descale=kd, v_descale=vd,
    )  # fmt: skip
    for b, (row, first, n) in enumerate(zip(idx.tolist(), firsts, lengths)):
        check_against_dequantized(
            q[b : b + 1], out[b : b + 1], k_pad[row : row + 1, first:n],
            v_pad[row : row + 1, first:n], kd[b : b + 1], vd[b : b + 1], [n - first], True,
        )  # fmt: skip
