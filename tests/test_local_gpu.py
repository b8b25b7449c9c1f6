"""Sliding windows, chunked local attention, softcap and learnable sinks on a Hopper GPU, alone
and combined, through flash_attn_func, the varlen entry point and the KV-cache path.

Same bar as test_forward_gpu: error <= 2 x the input-dtype PyTorch error + a rounding floor,
outputs poisoned (NaN) before each call; the reference (flash_cute.reference.attention_ref)
implements FlashAttention-3's semantics for all four options.
"""

import pytest
import torch
from kv_cases import (
    assert_close_to_reference,
    make_cache,
    reference_per_sequence,
    run_kvcache_case,
    run_varlen_mixed,
)

import flash_cute
from flash_cute.reference import gather_paged, stable_seed

pytestmark = pytest.mark.gpu


def xdist_group_key(name, params):
    """Tests that compile the same kernels share a pytest-xdist worker."""
    if "mask" in params:
        return (name, params["mask"], params.get("page_size"), params.get("head_dim"))
    return None


def sink(nheads, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # Around the size of a row's logsumexp, so the sink's share of each row is neither 0 nor 1.
    return (torch.randn(nheads, device="cuda", generator=gen) * 2 + 3).to(dtype)


# Masks by name; "sink" is resolved per test (its shape follows the head count).
MASKS = {
    "window1_causal": dict(window_size=(1, 0)),
    "window3": dict(window_size=(3, 3)),
    "window0": dict(window_size=(0, 0)),
    "window127_causal": dict(window_size=(127, -1)),
    "window128": dict(window_size=(128, 128)),
    "window17_113": dict(window_size=(17, 113)),
    "right5": dict(window_size=(-1, 5)),
    "window_past_keys": dict(window_size=(5000, 5000)),
    "chunk128": dict(attention_chunk=128),
    "chunk100_window30": dict(attention_chunk=100, window_size=(30, 7)),
    "softcap1.5": dict(softcap=1.5),
    "softcap50": dict(softcap=50.0),
    "sink": dict(learnable_sink="float32"),
    "sink_bf16_window10": dict(learnable_sink="bfloat16", window_size=(10, 0)),
    "all": dict(window_size=(127, 3), softcap=2.0, learnable_sink="float32"),
}


def resolve(mask_name, nheads, seed=0):
    mask = dict(MASKS[mask_name])
    if "learnable_sink" in mask:
        mask["learnable_sink"] = sink(nheads, getattr(torch, mask["learnable_sink"]), seed)
    return mask


def check_func(q, k, v, causal, mask):
    out = torch.full_like(q, float("nan"))
    out_ret, lse = flash_cute.flash_attn_func(
        q, k, v, causal=causal, return_lse=True, out=out, **mask
    )
    assert out_ret is out
    refs, lowps, lse_refs = reference_per_sequence([q], [k], [v], causal, mask)
    assert_close_to_reference([out], [lse], refs, lowps, lse_refs)


FUNC_CASES = [
    # (mask, causal, (seqlen_q, seqlen_k))
    ("window1_causal", True, (1000, 1000)),
    ("window3", False, (113, 203)),
    ("window0", False, (113, 203)),
    ("window127_causal", True, (1000, 1000)),
    ("window127_causal", True, (17, 17)),
    ("window128", False, (4097, 4097)),
    ("window17_113", False, (1000, 1000)),
    ("right5", False, (239, 1000)),
    ("window_past_keys", False, (113, 203)),
    ("window3", False, (1000, 17)),  # rows 0..972 see no key
    ("chunk128", True, (1000, 1000)),
    ("chunk128", False, (113, 203)),
    ("chunk100_window30", True, (1000, 1000)),
    ("softcap1.5", True, (1000, 1000)),
    ("softcap50", False, (113, 203)),
    ("sink", True, (1000, 1000)),
    ("sink", False, (1, 1)),
    ("sink_bf16_window10", False, (1000, 17)),  # empty rows: out 0, lse = sink
    ("all", True, (1000, 1000)),
    ("all", False, (1, 1000)),
]


@pytest.mark.parametrize(
    "mask,causal,seqlens",
    FUNC_CASES,
    ids=[f"{m}-{'causal' if c else 'full'}-{s[0]}x{s[1]}" for m, c, s in FUNC_CASES],
)
def test_func(mask, causal, seqlens):
    torch.manual_seed(stable_seed(mask, causal, seqlens))
    seqlen_q, seqlen_k = seqlens
    q = torch.randn(2, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, seqlen_k, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    check_func(q, k, v, causal, resolve(mask, 8))


def test_window_covering_every_key_is_causal():
    """A causal window that reaches every key gives plain causal, bit for bit."""
    torch.manual_seed(4)
    q = torch.randn(1, 4097, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4097, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    windowed = flash_cute.flash_attn_func(q, k, v, causal=True, window_size=(4096, 0))
    assert torch.equal(windowed, flash_cute.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["all", "chunk100_window30"])
def test_func_head_dims(head_dim, dtype, mask):
    torch.manual_seed(stable_seed(head_dim, mask))
    q = torch.randn(2, 1000, 8, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, 1000, 2, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    check_func(q, k, v, True, resolve(mask, 8))


KV_MASKS = ["window127_causal", "sink_bf16_window10", "chunk128", "all"]


@pytest.mark.parametrize("page_size", [None, 16, 64], ids=lambda p: f"page{p}" if p else "contig")
@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=lambda s: f"splits{s}" if s else "auto")
@pytest.mark.parametrize("mask", KV_MASKS)
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_decode(page_size, num_splits, mask, seqlen_q):
    seed = stable_seed(page_size, num_splits, mask, seqlen_q)
    run_kvcache_case(
        5, seqlen_q, 32, 8, 128, torch.bfloat16, page_size, 1000, num_splits, True, seed,
        mask=resolve(mask, 32, seed),
    )  # fmt: skip


@pytest.mark.parametrize("page_size", [None, 64], ids=lambda p: f"page{p}" if p else "contig")
@pytest.mark.parametrize("num_splits", [1, 0], ids=lambda s: f"splits{s}" if s else "auto")
@pytest.mark.parametrize("mask", ["window127_causal", "all"])
def test_decode_int_length_and_no_pack(page_size, num_splits, mask):
    """An int cache_seqlens (a scalar to the kernel), and GQA without packed rows."""
    seed = stable_seed("int", page_size, num_splits, mask)
    run_kvcache_case(
        3, 1, 16, 4, 128, torch.bfloat16, page_size, 900, num_splits, True, seed,
        mask=resolve(mask, 16, seed), int_length=700,
    )  # fmt: skip
    run_kvcache_case(
        3, 2, 16, 4, 128, torch.bfloat16, page_size, 900, num_splits, True, seed + 1,
        mask=resolve(mask, 16, seed), pack_gqa=False,
    )  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
@pytest.mark.parametrize("mask", ["all"])
def test_decode_head_dims(head_dim, mask):
    seed = stable_seed("hd", head_dim)
    run_kvcache_case(
        3, 2, 16, 2, head_dim, torch.float16, 64, 777, 0, True, seed, mask=resolve(mask, 16, seed)
    )


@pytest.mark.parametrize("page_size", [None, 64], ids=lambda p: f"page{p}" if p else "contig")
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("mask", ["window127_causal", "chunk100_window30", "all"])
def test_prefill_against_cache(page_size, num_splits, mask):
    seed = stable_seed("prefill", page_size, num_splits, mask)
    run_kvcache_case(
        3, 300, 8, 2, 128, torch.bfloat16, page_size, 1500, num_splits, True, seed,
        mask=resolve(mask, 8, seed), pad_rows=40,
    )  # fmt: skip


@pytest.mark.parametrize("kv_layout", ["packed", "padded", "paged"])
@pytest.mark.parametrize("num_splits", [1, 0], ids=lambda s: f"splits{s}" if s else "auto")
@pytest.mark.parametrize("mask", ["sink_bf16_window10", "chunk128", "all"])
def test_varlen(kv_layout, num_splits, mask):
    run_varlen_mixed(kv_layout, True, num_splits, mask=resolve(mask, 16))


@pytest.mark.parametrize("page_size", [None, 16], ids=lambda p: f"page{p}" if p else "contig")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_blocks_outside_the_window_are_not_read(page_size, num_splits):
    """NaN in every key and value row at least 1024 keys before the window: a key block the
    kernel loads contributes P * V, and 0 * NaN is NaN, so any read of those rows fails."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(page_size, num_splits))
    batch, capacity, left = 2, 3000, 1000
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch, capacity, 8, 128, torch.bfloat16, page_size, gen
    )
    lengths = [3000, 2500]
    poisoned = [n - 1 - left - 1024 for n in lengths]
    for b, end in enumerate(poisoned):
        if page_table is None:
            k_cache[b, :end] = float("nan")
            v_cache[b, :end] = float("nan")
        else:
            rows = torch.arange(end, device="cuda")
            pages = page_table[b, rows // page_size].long()
            k_cache[pages, rows % page_size] = float("nan")
            v_cache[pages, rows % page_size] = float("nan")
    out = flash_cute.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor(lengths, device="cuda", dtype=torch.int32),
        page_table=page_table,
        causal=True,
        window_size=(left, 0),
        num_splits=num_splits,
    )
    refs, lowps, _ = reference_per_sequence(
        [q[b : b + 1] for b in range(batch)],
        [k_pad[b : b + 1, end:n] for b, (end, n) in enumerate(zip(poisoned, lengths))],
        [v_pad[b : b + 1, end:n] for b, (end, n) in enumerate(zip(poisoned, lengths))],
        True,
        dict(window_size=(left, 0)),
    )
    assert_close_to_reference([out[b : b + 1] for b in range(batch)], None, refs, lowps, None)


def test_sink_counted_once_across_splits():
    """The LSE with a sink is the same whatever the split count (the sink enters one split)."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 2000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    s = sink(16)
    lses = []
    for splits in (1, 2, 7):
        _, lse = flash_cute.flash_attn_with_kvcache(
            q, k, v, learnable_sink=s, num_splits=splits, return_softmax_lse=True
        )
        lses.append(lse)
    for lse in lses[1:]:
        assert (lse - lses[0]).abs().max().item() < 1e-3


def test_decode_graph_replay_with_window_and_sink():
    """Capture a windowed decode step with sinks and softcap; replay after changing the cache
    lengths and the page table."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    batch, nheads, nheads_kv, d, page = 4, 32, 8, 128, 16
    mask = dict(window_size=(300, 0), softcap=2.0, learnable_sink=sink(nheads))
    q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, page_table, _, _ = make_cache(
        batch, 2048, nheads_kv, d, torch.bfloat16, page, gen
    )
    lengths = torch.full((batch,), 100, device="cuda", dtype=torch.int32)

    def step():
        return flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, page_table=page_table, causal=True, **mask
        )

    step()  # warm-up compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            graph_out = step()
    torch.cuda.current_stream().wait_stream(stream)
    for trial in range(3):
        lengths.copy_(
            torch.randint(0, 2049, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        )
        lengths[0] = [0, 1, 2048][trial]
        page_table.copy_(
            torch.randperm(k_cache.shape[0], device="cuda", generator=gen)[: page_table.numel()]
            .view_as(page_table)
            .to(torch.int32)
        )
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = lengths.tolist()
        k_pad = gather_paged(k_cache, page_table, page_table.shape[1] * page)
        v_pad = gather_paged(v_cache, page_table, page_table.shape[1] * page)
        refs, lowps, _ = reference_per_sequence(
            [q[b : b + 1] for b in range(batch)],
            [k_pad[b : b + 1, : n[b]] for b in range(batch)],
            [v_pad[b : b + 1, : n[b]] for b in range(batch)],
            True,
            mask,
        )
        assert_close_to_reference(
            [graph_out[b : b + 1] for b in range(batch)], None, refs, lowps, None
        )


@pytest.mark.parametrize("window", [1000, 4095])
def test_decode_loop_with_an_int_length_across_the_window(window):
    """A decode loop whose int cache_seqlens grows one key at a time across the window's edge
    (a plan made for a short length replays at longer ones: each must keep the window). The
    loop starts below the window, jumps to just under it, then steps across it and across the
    next power of two."""
    gen = torch.Generator(device="cuda").manual_seed(window)
    nheads, nheads_kv, d = 8, 2, 128
    capacity = 2 * window + 64
    q = torch.randn(1, 1, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(
        2, capacity, nheads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    k, v = cache[:1], cache[1:]
    lengths = [window // 2, *range(window - 8, window + 24)]
    lengths += [2 * window - 8 + i for i in range(8)] + [
        (1 << window.bit_length()) + i for i in range(3)
    ]
    for length in lengths:
        out = torch.full_like(q, float("nan"))
        flash_cute.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=length, causal=True, window_size=(window, 0), out=out
        )
        refs, lowps, _ = reference_per_sequence(
            [q], [k[:, :length]], [v[:, :length]], True, dict(window_size=(window, 0))
        )
        assert_close_to_reference([out], None, refs, lowps, None)
