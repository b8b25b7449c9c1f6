"""KV-cache, varlen and split-KV forward against the float32 reference on a Hopper GPU.

Same bar as test_forward_gpu: error <= 2 x the input-dtype PyTorch error + a rounding floor,
outputs poisoned (NaN) before each call.
"""

import functools

import pytest
import torch
from kv_cases import (
    assert_close_to_reference,
    captured,
    cu_seqlens,
    make_cache,
    ragged_lengths,
    reference_per_sequence,
    run_kvcache_case,
    run_varlen_mixed,
)

import flash_cute
from flash_cute import runtime
from flash_cute.reference import combine_ref, gather_paged, stable_seed

pytestmark = pytest.mark.gpu


def xdist_group_key(name, params):
    """Tests that compile the same kernels share a pytest-xdist worker."""
    if name == "test_decode":
        return (params["page_size"], params["heads"], params["num_splits"] != 1, params["causal"])
    return None


# 1 and 24: pages no TMA box follows (rows gathered with cp.async).
PAGE_SIZES = [None, 1, 16, 24, 32, 48, 64, 128, 256]
GQA = [(8, 8), (32, 8), (64, 8), (128, 8)]  # ratios 1, 4, 8, 16


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize(
    "num_splits", [1, 2, 7, 0], ids=lambda s: f"splits{s}" if s else "splits_auto"
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_decode(page_size, heads, num_splits, causal, seqlen_q):
    run_kvcache_case(
        5,
        seqlen_q,
        *heads,
        128,
        torch.bfloat16,
        page_size,
        1000,
        num_splits,
        causal,
        seed=stable_seed(page_size, heads, num_splits, causal, seqlen_q),
    )


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
@pytest.mark.parametrize("page_size", [None, 64, 1, 8])
def test_decode_other_head_dims(head_dim, page_size):
    run_kvcache_case(3, 2, 16, 2, head_dim, torch.float16, page_size, 777, 0, True, seed=head_dim)


@pytest.mark.parametrize("page_size", [None, 16, 128, 1, 40])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_against_cache(page_size, num_splits, causal):
    """Long query chunks against a cache (chunked prefill): the prefill tile configs."""
    run_kvcache_case(
        3, 300, 8, 2, 128, torch.bfloat16, page_size, 1500, num_splits, causal, seed=11
    )


@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "page_size", [None, 64, 3], ids=lambda p: f"page{p}" if p else "contiguous"
)
def test_prefill_against_cache_other_head_dims(head_dim, causal, page_size):
    """The prefill rows of every head dim through the KV-cache path, GQA packed by 4 (hdim 64
    non-causal stores O from registers, with packed rows); out is a slice of a NaN-filled
    buffer, whose rows past seqlen_q must stay NaN."""
    run_kvcache_case(
        2,
        300,
        8,
        2,
        head_dim,
        torch.bfloat16,
        page_size,
        1100,
        1,
        causal,
        seed=stable_seed(head_dim, causal, page_size),
        pad_rows=40,
    )


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_explicit_configs(page_size, num_splits):
    """config= overrides the decode and prefill tables (a persistent scheduler where the call
    does not split)."""
    decode_cfg = flash_cute.AttentionConfig(64, 64, num_stages=3, pingpong=False)
    run_kvcache_case(
        4,
        1,
        32,
        8,
        128,
        torch.bfloat16,
        page_size,
        900,
        num_splits,
        True,
        seed=21,
        config=decode_cfg,
    )
    prefill_cfg = flash_cute.AttentionConfig(128, 128, scheduler="dynamic_persistent")
    run_kvcache_case(
        3,
        300,
        8,
        2,
        128,
        torch.bfloat16,
        page_size,
        1500,
        num_splits,
        True,
        seed=22,
        config=prefill_cfg,
    )


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softmax_knobs_split_and_paged(page_size, num_splits, dtype):
    """The lazy rescale, a lagging max and FMA-pipe exponentials through split-KV partials (merged
    by their LSE) and paged caches, in the decode and the prefill shapes."""
    knobs = dict(lazy_rescale=True, rescale_threshold=8, exp2_on_fma=4)
    decode_cfg = flash_cute.decode_config(128, "bfloat16").replace(**knobs)
    run_kvcache_case(
        4, 1, 32, 8, 128, dtype, page_size, 900, num_splits, True, seed=31, config=decode_cfg
    )
    prefill_cfg = flash_cute.AttentionConfig(128, 128, scheduler="dynamic_persistent", **knobs)
    run_kvcache_case(
        3, 300, 8, 2, 128, dtype, page_size, 1500, num_splits, True, seed=32, config=prefill_cfg
    )


def test_pack_gqa_off_and_forced():
    for pack in (False, True):
        run_kvcache_case(4, 1, 32, 4, 128, torch.bfloat16, 32, 600, 0, True, seed=3, pack_gqa=pack)
    # 12 q heads per kv head do not divide the decode tile's 64 rows: groups of 4 are folded.
    run_kvcache_case(2, 3, 24, 2, 128, torch.bfloat16, None, 300, 1, True, seed=4, pack_gqa=True)


def test_int_and_missing_cache_seqlens():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 3, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 500, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 500, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    for seqlens, keys in ((None, 500), (123, 123), (0, 0)):
        out = flash_cute.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
        refs, lowps, _ = reference_per_sequence([q], [k[:, :keys]], [v[:, :keys]], True)
        assert_close_to_reference([out], None, refs, lowps, None)
    with pytest.raises(ValueError, match="exceeds the cache's capacity"):
        flash_cute.flash_attn_with_kvcache(q, k, v, cache_seqlens=501)


@pytest.mark.parametrize("page_size", [None, 64], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("num_splits", [1, 0], ids=lambda s: f"splits{s}" if s else "splits_auto")
def test_int_cache_seqlens_replays_launch_plan(page_size, num_splits, monkeypatch):
    """Repeated calls with an int cache_seqlens replay a launch plan (the length goes to the
    kernel as a scalar, for a contiguous or a paged cache) on new cache tensors of the same
    layout, and so do other lengths of the same bit length (one plan per power of two); lengths
    out of range in a planned bucket still raise. Also inside a CUDA graph, captured after an
    eager replay on its stream: the graph replays its length, also after other lengths ran and
    after empty_cache()."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    batch, capacity = 2, 700
    q = torch.randn(batch, 1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, _, page_table, _, _ = make_cache(batch, capacity, 4, 128, torch.bfloat16, page_size, gen)
    runs = []
    real_build = runtime.LaunchPlan.build
    monkeypatch.setattr(
        runtime.LaunchPlan,
        "build",
        staticmethod(lambda *a, **kw: runs.append(1) or real_build(*a, **kw)),
    )
    runtime.KVCACHE_PLANS.clear()
    flash_cute.empty_cache()

    def check(out, k_cache, v_cache, n):
        if page_size is None:
            k_pad, v_pad = k_cache, v_cache
        else:
            k_pad = gather_paged(k_cache, page_table, page_table.shape[1] * page_size)
            v_pad = gather_paged(v_cache, page_table, page_table.shape[1] * page_size)
        refs, lowps, _ = reference_per_sequence([q], [k_pad[:, :n]], [v_pad[:, :n]], False)
        assert_close_to_reference([out], None, refs, lowps, None)

    for n in (333, 333, 700, 333, 400, 511, 256):
        k_cache, v_cache, _, _, _ = make_cache(
            batch, capacity, 4, 128, torch.bfloat16, page_size, gen
        )
        out = flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=n, page_table=page_table, num_splits=num_splits
        )
        check(out, k_cache, v_cache, n)
    assert len(runs) == 2, (
        f"expected 2 full-path calls (n = 333, 700; 256-511 replay 333's plan), got {len(runs)}"
    )
    full = (
        capacity if page_size is None else page_table.shape[1] * page_size
    )  # 700, or 704 in pages
    with pytest.raises(
        ValueError, match="exceeds the cache's capacity"
    ):  # in the bucket of 700's plan
        flash_cute.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=full + 1,
            page_table=page_table,
            num_splits=num_splits,
        )
    with pytest.raises(ValueError, match="must be >= 0"):  # -333: the bit length of 333's plan
        flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=-333, page_table=page_table, num_splits=num_splits
        )
    # Captured: the replayed plan's launch and its length tensor in a graph.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # An eager replay on the capture stream first: its cached length tensor must stay out of
        # the graph.
        flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=333, page_table=page_table, num_splits=num_splits
        )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = flash_cute.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=333, page_table=page_table, num_splits=num_splits
            )
    torch.cuda.current_stream().wait_stream(stream)
    flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=400, page_table=page_table, num_splits=num_splits
    )
    for _ in range(2):  # after another length ran, then with no cached buffers at all
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, k_cache, v_cache, 333)
        flash_cute.empty_cache()
    assert len(runs) == 2


@pytest.mark.parametrize("kv_layout", ["packed", "padded", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "num_splits", [1, 3, 0], ids=lambda s: f"splits{s}" if s else "splits_auto"
)
def test_varlen_mixed_batch(kv_layout, causal, num_splits):
    """Long prefills and single-token decodes in one varlen batch."""
    run_varlen_mixed(kv_layout, causal, num_splits)


@pytest.mark.parametrize("kv_layout", ["packed", "paged", "padded"])
def test_varlen_explicit_config(kv_layout):
    run_varlen_mixed(
        kv_layout, True, 1, flash_cute.AttentionConfig(64, 128, num_stages=3, pingpong=False)
    )
    run_varlen_mixed(
        kv_layout, False, 2, flash_cute.AttentionConfig(128, 96, scheduler="dynamic_persistent")
    )
    # Persistent varlen: static and dynamic, O from registers (Q freed after the mainloop).
    run_varlen_mixed(
        kv_layout, True, 1, flash_cute.AttentionConfig(128, 96, scheduler="static_persistent")
    )
    run_varlen_mixed(
        kv_layout,
        False,
        1,
        flash_cute.AttentionConfig(
            128, 80, pingpong=False, rescale_o_before_pv=True, scheduler="dynamic_persistent"
        ),
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    "scheduler",
    [None, "single_tile", "static_persistent", "dynamic_persistent"],
    ids=lambda s: s or "table",
)
def test_varlen_many_sequences(causal, num_splits, scheduler):
    """More sequences than a warp scans at once (the varlen tile lookup walks 32 at a time),
    and more tiles than SMs, so persistent CTAs take several tiles (the table's rows for this
    problem: static persistent non-causal, dynamic persistent causal)."""
    config = (
        None if scheduler is None else flash_cute.AttentionConfig(128, 128, scheduler=scheduler)
    )
    gen = torch.Generator(device="cuda").manual_seed(int(causal) + 2 * num_splits)
    batch, nheads, nheads_kv, d, dtype = 70, 8, 2, 64, torch.float16
    q_lens = torch.tensor([0, 1, 2, 5, 17, 100], device="cuda")[
        torch.randint(0, 6, (batch,), generator=gen, device="cuda")
    ]
    k_lens = torch.randint(0, 300, (batch,), generator=gen, device="cuda")
    cu_q = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(k_lens.cumsum(0), (1, 0)).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), nheads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(int(cu_k[-1]), nheads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        int(q_lens.max()),
        cu_seqlens_k=cu_k,
        causal=causal,
        num_splits=num_splits,
        return_softmax_lse=True,
        out=out,
        config=config,
    )
    cq, ck = cu_q.tolist(), cu_k.tolist()
    seq = lambda t, c, b: t[c[b] : c[b + 1]].unsqueeze(0)  # noqa: E731
    refs, lowps, lse_refs = reference_per_sequence(
        [seq(q, cq, b) for b in range(batch)],
        [seq(k, ck, b) for b in range(batch)],
        [seq(v, ck, b) for b in range(batch)],
        causal,
    )
    assert_close_to_reference(
        [seq(out, cq, b) for b in range(batch)],
        [lse[:, cq[b] : cq[b + 1]].unsqueeze(0) for b in range(batch)],
        refs,
        lowps,
        lse_refs,
    )


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_combine(out_dtype, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    splits, batch, seqlen, nheads = 9, 3, 33, 5
    out_p = torch.randn(splits, batch, seqlen, nheads, head_dim, device="cuda", generator=gen)
    lse_p = torch.randn(splits, batch, seqlen, nheads, device="cuda", generator=gen) * 3
    lse_p[::2, 0] = float("-inf")  # empty splits ...
    out_p[::2, 0] = float("nan")  # ... whose partial out must not be used
    lse_p[:, 1, 3, 2] = float("-inf")  # a row with no keys at all
    out, lse = flash_cute.flash_attn_combine(out_p, lse_p, out_dtype=out_dtype, return_lse=True)
    want, want_lse = combine_ref(out_p, lse_p)
    assert out.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert (out[1, 3, 2] == 0).all() and lse[1, 3, 2] == float("-inf")
    # varlen form and strided (transposed-lse) inputs
    lse_t = lse_p.transpose(2, 3).contiguous().transpose(2, 3)
    out4 = flash_cute.flash_attn_combine(
        out_p.flatten(1, 2), lse_t.flatten(1, 2), out_dtype=out_dtype
    )
    torch.testing.assert_close(out4.float(), want.flatten(0, 1), atol=tol, rtol=tol)


def _split_launches(gen):
    """Split launches of several kinds, as partials over fixed random inputs: padded caches
    with GQA packed (ratio 4), packing off, 1-70 query tokens, empty and full cache lengths;
    a causal varlen batch on a paged cache with empty and short sequences."""
    bf16 = torch.bfloat16
    launches = []
    for batch, seqlen_q, nheads, nheads_kv, pack_gqa, splits, causal in [
        (2, 1, 32, 8, None, 2, False),
        (6, 5, 32, 8, None, 5, True),
        (3, 70, 16, 4, None, 3, True),
        (5, 1, 8, 8, None, 16, False),
        (4, 3, 32, 8, False, 7, False),
        (40, 1, 32, 8, None, 4, False),
    ]:
        q = torch.randn(batch, seqlen_q, nheads, 128, device="cuda", dtype=bf16, generator=gen)
        k = torch.randn(batch, 700, nheads_kv, 128, device="cuda", dtype=bf16, generator=gen)
        v = torch.randn_like(k)
        lengths = ragged_lengths(batch, 700, gen)
        launches.append(
            functools.partial(
                flash_cute.flash_attn_with_kvcache,
                q,
                k,
                v,
                cache_seqlens=lengths,
                causal=causal,
                num_splits=splits,
                pack_gqa=pack_gqa,
            )
        )
    q_lens, k_lens = [1, 0, 17, 100, 3], [600, 0, 17, 300, 1]
    cu_q = cu_seqlens(q_lens)
    q = torch.randn(int(cu_q[-1]), 16, 128, device="cuda", dtype=bf16, generator=gen)
    k, v, page_table, _, _ = make_cache(len(q_lens), 640, 4, 128, bf16, 64, gen)
    used = torch.tensor(k_lens, device="cuda", dtype=torch.int32)
    launches.append(
        functools.partial(
            flash_cute.flash_attn_varlen_func,
            q,
            k,
            v,
            cu_q,
            max(q_lens),
            seqused_k=used,
            max_seqlen_k=max(k_lens),
            page_table=page_table,
            causal=True,
            num_splits=4,
        )
    )
    return launches


def test_split_counters_match_the_kernel_grid(monkeypatch):
    """Each split launch gets exactly the counters the host counts for it (plan.split_tiles),
    followed by sentinel slots: the kernel's per-tile slots stay inside the count (no sentinel
    touched) and the last CTA of every tile resets its slot."""
    sentinel = 0x5EED
    handed_out = []

    def exact_counters(device, count, stream):
        buffer = torch.full((count + 64,), sentinel, dtype=torch.int32, device=device)
        buffer[:count] = 0
        handed_out.append((buffer, count))
        return buffer

    monkeypatch.setattr(runtime.BUFFERS, "zeroed_counters", exact_counters)
    gen = torch.Generator(device="cuda").manual_seed(41)
    for launch in _split_launches(gen):
        for _ in range(2):  # the first call builds the launch plan, the second replays it
            handed_out.clear()
            flash_cute.empty_cache()  # no memo of the last launch's buffers: a lookup
            launch()
            torch.cuda.synchronize()
            assert len(handed_out) == 1, "a split launch took no counters"
            buffer, count = handed_out[0]
            assert int(buffer[:count].count_nonzero()) == 0, (
                "a split launch left an arrival counter set"
            )
            assert bool((buffer[count:] == sentinel).all()), (
                "a split launch used a counter past the host's count"
            )


def test_split_launches_back_to_back_on_two_streams():
    """Split launches queued without host syncs, on the current stream and a second one (each
    stream's launches share its counters and partials scratch, which grow along the way), give
    the same bits as the same launches run one at a time (which match their unsplit results),
    and leave every counter zero."""
    gen = torch.Generator(device="cuda").manual_seed(42)
    launches = _split_launches(gen)
    expected = []
    for launch in launches:
        expected.append(launch().clone())
        unsplit = launch.func(*launch.args, **{**launch.keywords, "num_splits": 1})
        torch.testing.assert_close(expected[-1].float(), unsplit.float(), atol=1e-2, rtol=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    results = []
    for _ in range(3):
        for launch in launches:
            results.append(launch())
            with torch.cuda.stream(side):
                results.append(launch())
    torch.cuda.synchronize()
    for i, out in enumerate(results):
        assert torch.equal(out, expected[(i // 2) % len(launches)]), f"queued launch {i} differs"
    assert len([key for key in runtime.BUFFERS.counters if key[1] == side.cuda_stream]) == 1
    for buffer in runtime.BUFFERS.counters.values():
        assert int(buffer.count_nonzero()) == 0, "a split launch left an arrival counter set"
    flash_cute.empty_cache()
    assert not runtime.BUFFERS.counters and not runtime.BUFFERS.scratch
    assert torch.equal(launches[0](), expected[0]), "a launch after empty_cache differs"


def test_split_scratch_past_two_to_the_31_floats():
    """A forced split count whose fp32 partials pass 2^31 elements (8 GiB): the kernel's
    scratch offsets are 64-bit (its __call__), so the merged output matches the unsplit call's."""
    if torch.cuda.mem_get_info()[0] < 12 << 30:
        pytest.skip("needs 12 GiB of free GPU memory")
    gen = torch.Generator(device="cuda").manual_seed(59)
    q = torch.randn(1, 32768, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (
        torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    # 16 splits x 2^27 output elements: the LSE partial starts exactly 2^31 floats in.
    poisoned = torch.full_like(q, float("nan"))
    out, lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, num_splits=16, return_softmax_lse=True, out=poisoned
    )
    ref, ref_lse = flash_cute.flash_attn_with_kvcache(
        q, k_cache, v_cache, num_splits=1, return_softmax_lse=True
    )
    assert not out.isnan().any(), "unwritten output rows"
    assert (out.float() - ref.float()).abs().max().item() <= 2**-6
    assert (lse - ref_lse).abs().max().item() <= 1e-4
    del out, lse, ref, ref_lse, poisoned
    flash_cute.empty_cache()


@pytest.mark.parametrize("out_kind", ["slice", "odd_strides"])
def test_split_merge_writes_into_given_out(out_kind):
    """The in-kernel merge writes O through out's strides: a slice of a bigger buffer gets only
    its own elements; strides that are not multiples of 16 bytes go through a copy."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, nheads, nheads_kv, d = 3, 16, 4, 128
    q = torch.randn(batch, 2, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, 900, nheads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    lengths = torch.tensor([900, 1, 517], dtype=torch.int32, device="cuda")
    width = nheads + 3 if out_kind == "slice" else nheads + 1
    last = d if out_kind == "slice" else d + 1  # head stride d + 1 elements: 258 bytes
    big = torch.full((batch, 2, width, last), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[:, :, 1 : nheads + 1, :d]
    for _ in range(2):  # the second call replays the launch plan
        out.fill_(float("nan"))
        flash_cute.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, num_splits=5, out=out)
        n = lengths.tolist()
        refs, lowps, _ = reference_per_sequence(
            [q[b : b + 1] for b in range(batch)],
            [k[b : b + 1, : n[b]] for b in range(batch)],
            [v[b : b + 1, : n[b]] for b in range(batch)],
            False,
        )
        assert_close_to_reference([out[b : b + 1] for b in range(batch)], None, refs, lowps, None)
    assert big[:, :, 0].isnan().all() and big[:, :, nheads + 1 :].isnan().all(), "wrote outside out"
    if out_kind == "odd_strides":
        assert big[..., d:].isnan().all(), "wrote outside out"


def test_decode_graph_replay_with_new_lengths_and_pages():
    """Capture one decode step; replay after changing cache_seqlens and the page table."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    batch, nheads, nheads_kv, d, page = 4, 32, 8, 128, 16
    q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache, page_table, _, _ = make_cache(
        batch, 2048, nheads_kv, d, torch.bfloat16, page, gen
    )
    lengths = torch.full((batch,), 100, device="cuda", dtype=torch.int32)

    def step():
        return flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, page_table=page_table, causal=True
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
        num_pages = k_cache.shape[0]
        page_table.copy_(
            torch.randperm(num_pages, device="cuda", generator=gen)[: page_table.numel()]
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
        )
        assert_close_to_reference(
            [graph_out[b : b + 1] for b in range(batch)], None, refs, lowps, None
        )


def test_split_decode_graph_replays_one_kernel():
    """A captured split decode step (merged in the kernel) replays as one kernel: its arrival
    counters come pre-zeroed (runtime.GRAPH_COUNTERS), no zeroing kernel is captured, and the
    kernel leaves them zero, so replays with new lengths stay right."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    batch, nheads, nheads_kv, d, capacity = 2, 32, 8, 128, 4096
    q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    shape = (batch, capacity, nheads_kv, d)
    k_cache, v_cache = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)
    )
    lengths = torch.full((batch,), capacity, device="cuda", dtype=torch.int32)

    def step():
        return flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, causal=True, num_splits=6
        )

    graph, graph_out = captured(step)
    for _ in range(4):
        lengths.copy_(torch.randint(1, capacity + 1, (batch,), device="cuda", generator=gen))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = lengths.tolist()
        refs, lowps, _ = reference_per_sequence(
            [q[b : b + 1] for b in range(batch)],
            [k_cache[b : b + 1, : n[b]] for b in range(batch)],
            [v_cache[b : b + 1, : n[b]] for b in range(batch)],
            True,
        )
        assert_close_to_reference(
            [graph_out[b : b + 1] for b in range(batch)], None, refs, lowps, None
        )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("return_lse", [False, True])
def test_varlen_repeated_calls_use_new_contents(num_splits, return_lse):
    """Calls with the same metadata replay a launch plan: new cu_seqlens, seqused_k and page
    table contents (same shapes) must still give the right answer every time."""
    gen = torch.Generator(device="cuda").manual_seed(31 + num_splits + 2 * return_lse)
    batch, nheads, nheads_kv, d, dtype, page_size = 5, 16, 4, 128, torch.bfloat16, 32
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch, 640, nheads_kv, d, dtype, page_size, gen
    )
    total_q = 400
    for _ in range(3):
        q_lens = torch.randint(
            0, 80, (batch,), generator=gen, device="cuda"
        )  # sums stay within total_q
        cu_q = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
        k_lens = (q_lens + torch.randint(0, 500, (batch,), generator=gen, device="cuda")).to(
            torch.int32
        )
        perm = torch.randperm(batch, generator=gen, device="cuda")
        table = page_table[perm].contiguous()  # a different page table each step, same shape
        k_view, v_view = k_pad[perm], v_pad[perm]
        q = torch.randn(total_q, nheads, d, device="cuda", dtype=dtype, generator=gen)
        out = torch.full_like(q, float("nan"))
        result = flash_cute.flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_q,
            120,
            seqused_k=k_lens,
            max_seqlen_k=640,
            page_table=table,
            causal=True,
            num_splits=num_splits,
            return_softmax_lse=return_lse,
            out=out,
        )
        lse = result[1] if return_lse else None
        cq, kl = cu_q.tolist(), k_lens.tolist()
        q_seqs = [q[cq[b] : cq[b + 1]].unsqueeze(0) for b in range(batch)]
        refs, lowps, lse_refs = reference_per_sequence(
            q_seqs,
            [k_view[b : b + 1, : kl[b]] for b in range(batch)],
            [v_view[b : b + 1, : kl[b]] for b in range(batch)],
            True,
        )
        outs = [out[cq[b] : cq[b + 1]].unsqueeze(0) for b in range(batch)]
        lses = (
            [lse[:, cq[b] : cq[b + 1]].unsqueeze(0) for b in range(batch)] if return_lse else None
        )
        assert_close_to_reference(outs, lses, refs, lowps, lse_refs)
    assert len(runtime.VARLEN_PLANS) > 0, "the repeated calls did not take the launch-plan path"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_varlen_plan_replay_leaves_checks_to_compiled_function(num_splits):
    """A varlen plan's key holds q's metadata, k's shape and the int32 tensors' shapes and
    dtypes: the compiled function checks the rest (k's and v's dtypes, strides and alignment,
    v's shape, every tensor's device, the int32 tensors' contiguity) and raises before
    launching, and the call then goes through the full checks: clear errors, a copy for
    strides TMA cannot read, and the plan replays afterwards."""
    gen = torch.Generator(device="cuda").manual_seed(71 + num_splits)
    batch, nheads, nheads_kv, d, page_size, pages_per_seq = 4, 16, 2, 128, 16, 8
    q = torch.randn(
        batch, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen
    )  # one token each
    k = torch.randn(
        batch * pages_per_seq,
        page_size,
        nheads_kv,
        d,
        device="cuda",
        dtype=torch.bfloat16,
        generator=gen,
    )
    v = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    used = torch.tensor([5, 128, 77, 100], dtype=torch.int32, device="cuda")
    table = (
        torch.randperm(batch * pages_per_seq, device="cuda", generator=gen)
        .to(torch.int32)
        .view(batch, -1)
    )

    def call(q=q, k=k, v=v, cu_q=cu_q, used=used, table=table):
        return flash_cute.flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            1,
            seqused_k=used,
            max_seqlen_k=128,
            page_table=table,
            num_splits=num_splits,
        )

    ref = call()
    k_pad, v_pad = (gather_paged(t, table, 128) for t in (k, v))
    refs, lowps, lse_refs = reference_per_sequence(
        [q[b : b + 1].unsqueeze(0) for b in range(batch)],
        [k_pad[b : b + 1, :n] for b, n in enumerate(used.tolist())],
        [v_pad[b : b + 1, :n] for b, n in enumerate(used.tolist())],
        False,
    )
    assert_close_to_reference(
        [ref[b : b + 1].unsqueeze(0) for b in range(batch)], None, refs, lowps, lse_refs
    )
    assert torch.equal(call(), ref)  # replayed
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        call(k=k.half())
    with pytest.raises(ValueError, match="v must have the shape of k"):
        call(v=v[:-1])
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        call(cu_q=cu_q.to(torch.uint32))
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        call(cu_q=torch.stack([cu_q, cu_q], 1)[:, 0])
    with pytest.raises(ValueError, match="seqused_k must be on q's device"):
        call(used=used.cpu())
    with pytest.raises(TypeError, match="page_table must be int32"):
        call(table=table.to(torch.uint32))
    # Same shape, head stride 132 elements (264 bytes): TMA cannot read it, so the full path
    # copies k.
    odd_k = torch.empty(k.shape[:-1] + (d + 4,), device="cuda", dtype=k.dtype)[..., :d]
    odd_k.copy_(k)
    assert torch.equal(call(k=odd_k), ref)
    assert torch.equal(call(), ref)


def poison_past_lengths(k_cache, v_cache, page_table, lengths, capacity):
    """Write NaN into every cache slot at or past each sequence's length (what a cache from
    torch.empty may hold), through the page table for a paged cache."""
    for b, n in enumerate(lengths):
        if n >= capacity:
            continue
        if page_table is None:
            k_cache[b, n:] = float("nan")
            v_cache[b, n:] = float("nan")
            continue
        page_size = k_cache.shape[1]
        positions = torch.arange(n, capacity, device="cuda")
        pages = page_table[b, positions // page_size].long()
        k_cache[pages, positions % page_size] = float("nan")
        v_cache[pages, positions % page_size] = float("nan")


def run_nan_past_cache_lengths(
    page_size, lengths, num_splits, seqlen_q, causal, config, head_dim=128
):
    gen = torch.Generator(device="cuda").manual_seed(
        stable_seed(page_size, lengths, num_splits, seqlen_q, str(config), head_dim)
    )
    batch, capacity, nheads, nheads_kv, dtype = 3, 700, 16, 4, torch.bfloat16
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k_cache, v_cache, page_table, _, _ = make_cache(
        batch, capacity, nheads_kv, head_dim, dtype, page_size, gen
    )
    # Lengths that end inside a key block (and one that ends exactly on the capacity).
    per_seq = [333, 333, 333] if lengths == "int" else [37, 333, 700]
    ref_k = gather_paged(k_cache, page_table, capacity) if page_size else k_cache.clone()
    ref_v = gather_paged(v_cache, page_table, capacity) if page_size else v_cache.clone()
    poison_past_lengths(k_cache, v_cache, page_table, per_seq, capacity)
    cache_seqlens = (
        333 if lengths == "int" else torch.tensor(per_seq, device="cuda", dtype=torch.int32)
    )
    out = flash_cute.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        causal=causal,
        num_splits=num_splits,
        config=config,
    )
    refs, lowps, _ = reference_per_sequence(
        [q[b : b + 1] for b in range(batch)],
        [ref_k[b : b + 1, :n] for b, n in enumerate(per_seq)],
        [ref_v[b : b + 1, :n] for b, n in enumerate(per_seq)],
        causal,
    )
    assert_close_to_reference([out[b : b + 1] for b in range(batch)], None, refs, lowps, None)


@pytest.mark.parametrize(
    "page_size", [None, 16, 64], ids=lambda p: f"page{p}" if p else "contiguous"
)
@pytest.mark.parametrize("lengths", ["int", "tensor"])
@pytest.mark.parametrize("num_splits", [1, 0], ids=lambda s: f"splits{s}" if s else "splits_auto")
@pytest.mark.parametrize(
    "seqlen_q,causal", [(1, False), (37, True)], ids=["decode", "prefill_causal"]
)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_nan_past_cache_lengths_stays_out(
    page_size, lengths, num_splits, seqlen_q, causal, overlap
):
    """Cache slots past cache_seqlens hold NaN: the keys there are masked, and the V rows the
    last key block loads past the end must not reach the output (P = 0 there, but 0 * NaN is
    NaN), with and without intra-warpgroup overlap (their first P V happens in different places)."""
    config = (
        None
        if overlap
        else flash_cute.AttentionConfig(64, 128, intra_wg_overlap=False, pingpong=False)
    )
    run_nan_past_cache_lengths(page_size, lengths, num_splits, seqlen_q, causal, config)


@pytest.mark.parametrize("page_size", [None, 64], ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("head_dim", [64, 96, 192, 256])
def test_nan_past_cache_lengths_other_head_dims(head_dim, page_size):
    """The same through the table's prefill rows of the other head dims (2 or 3 ping-ponging
    MMA warpgroups, persistent schedulers, P through smem at hdim 96; 64- and 128-byte
    swizzled V tiles)."""
    run_nan_past_cache_lengths(page_size, "tensor", 1, 37, True, None, head_dim=head_dim)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_inf_in_next_packed_sequence_stays_out(num_splits):
    """Packed K/V: the last key block of a sequence also loads the first rows of the next one;
    an inf there (the next sequence's own business) must not reach this sequence's output."""
    gen = torch.Generator(device="cuda").manual_seed(77 + num_splits)
    nheads, nheads_kv, d, dtype = 8, 8, 128, torch.bfloat16
    cu_k = torch.tensor([0, 100, 350], device="cuda", dtype=torch.int32)
    cu_q = torch.tensor([0, 5, 10], device="cuda", dtype=torch.int32)
    q = torch.randn(10, nheads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(350, nheads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    v[100:110] = float("inf")
    out = flash_cute.flash_attn_varlen_func(
        q, k, v, cu_q, 5, cu_seqlens_k=cu_k, max_seqlen_k=250, num_splits=num_splits
    )
    refs, lowps, _ = reference_per_sequence(
        [q[:5].unsqueeze(0)], [k[:100].unsqueeze(0)], [v[:100].unsqueeze(0)], False
    )
    assert_close_to_reference([out[:5].unsqueeze(0)], None, refs, lowps, None)
