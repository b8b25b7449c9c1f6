"""Shared GPU test cases for the KV-cache and varlen paths: caches (padded or paged), ragged
lengths, a per-sequence float32 reference and the error bar of test_forward_gpu.

`mask` (a dict) holds the masking and scoring options (window_size, attention_chunk, softcap,
learnable_sink); they are passed unchanged to the entry point and to the reference.
"""

import itertools
import warnings

import torch

import flash_cute
from flash_cute.reference import attention_ref, error_bound, gather_paged, stable_seed


def rand(*shape, dtype=torch.bfloat16, gen=None):
    """A random CUDA tensor (bf16 by default) from generator gen."""
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def captured(step):
    """(graph, output): step() called once (compiling, and setting aside pre-zeroed counters),
    then captured in a CUDA graph on a side stream; a capture that would fall back to a
    captured zero fill (a warning) fails."""
    step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def cu_seqlens(lengths):
    """int32 cumulative offsets (0, l0, l0 + l1, ...) of a list of lengths, on the GPU."""
    return torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


def seqs(x, lengths, starts=None, dim=0):
    """Per-sequence slices of a packed tensor, each with a leading 1: x's indices starts[b] ..
    starts[b] + lengths[b] along dim (0: a (total, ...) tensor; 1: a varlen LSE (h, total)).
    starts default to the lengths' running sums."""
    starts = starts or list(itertools.accumulate([0] + list(lengths[:-1])))
    return [x.narrow(dim, s, n).unsqueeze(0) for s, n in zip(starts, lengths)]


def per_batch(*tensors):
    """Each (batch, ...) tensor as a list of its (1, ...) sequences."""
    return [[t[b : b + 1] for b in range(t.shape[0])] for t in tensors]


def reference_per_sequence(q_list, k_list, v_list, causal, mask=None):
    """Reference over a list of per-sequence (1, s, h, d) tensors: (out, lowp, lse) lists."""
    mask = mask or {}
    refs, lowps, lses = [], [], []
    for q, k, v in zip(q_list, k_list, v_list):
        ref, lse = attention_ref(q, k, v, causal=causal, **mask)
        lowp, _ = attention_ref(q, k, v, causal=causal, upcast=False, **mask)
        refs.append(ref)
        lowps.append(lowp)
        lses.append(lse)
    return refs, lowps, lses


def cache_reference(q, k_pad, v_pad, lengths, causal, rows=None, first=None, mask=None):
    """reference_per_sequence for q (batch, ...) over padded caches: sequence b's keys are
    cache row rows[b] (default b), slots first[b] (default 0) .. lengths[b] - 1."""
    batch = q.shape[0]
    rows = rows or list(range(batch))
    first = first or [0] * batch
    return reference_per_sequence(
        [q[b : b + 1] for b in range(batch)],
        [k_pad[r : r + 1, f:n] for r, f, n in zip(rows, first, lengths)],
        [v_pad[r : r + 1, f:n] for r, f, n in zip(rows, first, lengths)],
        causal,
        mask,
    )


def assert_close_to_reference(outs, lses, refs, lowps, lse_refs):
    for i, (out, ref, lowp) in enumerate(zip(outs, refs, lowps)):
        assert not out.isnan().any(), f"sequence {i}: NaN in output (unwritten?)"
        err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
        bound = error_bound(lowp, ref)
        assert err <= bound, f"sequence {i}: max error {err:.3e} > bound {bound:.3e}"
    if lses is not None:
        for i, (lse, lse_ref) in enumerate(zip(lses, lse_refs)):
            finite = torch.isfinite(lse_ref)
            assert torch.equal(torch.isfinite(lse), finite), f"sequence {i}: lse finiteness differs"
            if finite.any():
                err = (lse[finite] - lse_ref[finite]).abs().max().item()
                assert err < 1e-3 * max(1.0, lse_ref[finite].abs().max().item()), (
                    f"sequence {i}: lse error {err}"
                )


def make_cache(batch, capacity, nheads_kv, head_dim, dtype, page_size, gen, head_dim_v=None):
    """K/V caches (padded, or paged with a random page order) and their padded views; V's
    head dim is head_dim_v (default head_dim)."""
    head_dim_v = head_dim_v or head_dim
    if page_size is None:
        k = torch.randn(
            batch, capacity, nheads_kv, head_dim, device="cuda", dtype=dtype, generator=gen
        )
        v = torch.randn(
            batch, capacity, nheads_kv, head_dim_v, device="cuda", dtype=dtype, generator=gen
        )
        return k, v, None, k, v
    pages_per_seq = -(-capacity // page_size)
    num_pages = batch * pages_per_seq + 3  # spare pages that no sequence uses
    k_cache = torch.randn(
        num_pages, page_size, nheads_kv, head_dim, device="cuda", dtype=dtype, generator=gen
    )
    v_cache = torch.randn(
        num_pages, page_size, nheads_kv, head_dim_v, device="cuda", dtype=dtype, generator=gen
    )
    perm = torch.randperm(num_pages, device="cuda", generator=gen)[: batch * pages_per_seq]
    page_table = perm.view(batch, pages_per_seq).to(torch.int32)
    k_pad = gather_paged(k_cache, page_table, pages_per_seq * page_size)
    v_pad = gather_paged(v_cache, page_table, pages_per_seq * page_size)
    return k_cache, v_cache, page_table, k_pad, v_pad


def ragged_lengths(batch, capacity, gen):
    lengths = torch.randint(
        0, capacity + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32
    )
    lengths[0] = 0
    lengths[1 % batch] = 1
    lengths[2 % batch] = capacity
    return lengths


def run_kvcache_case(
    batch,
    seqlen_q,
    nheads,
    nheads_kv,
    head_dim,
    dtype,
    page_size,
    capacity,
    num_splits,
    causal,
    seed,
    pack_gqa=None,
    config=None,
    pad_rows=0,
    mask=None,
    int_length=None,
):
    """pad_rows: out is the first seqlen_q rows of a NaN-filled buffer this many rows longer,
    whose rows past seqlen_q must stay NaN. int_length: cache_seqlens is this int (every
    sequence that long) instead of a tensor of ragged lengths."""
    mask = mask or {}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype, generator=gen)
    k_cache, v_cache, page_table, k_pad, v_pad = make_cache(
        batch, capacity, nheads_kv, head_dim, dtype, page_size, gen
    )
    lengths = ragged_lengths(batch, capacity, gen)
    if int_length is not None:
        lengths.fill_(int_length)
    padded = torch.full(
        (batch, seqlen_q + pad_rows, nheads, head_dim), float("nan"), device="cuda", dtype=dtype
    )
    out = padded[:, :seqlen_q]
    _, lse = flash_cute.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=lengths if int_length is None else int_length,
        page_table=page_table,
        causal=causal,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
        return_softmax_lse=True,
        out=out,
        config=config,
        **mask,
    )
    n = lengths.tolist()
    refs, lowps, lse_refs = reference_per_sequence(
        [q[b : b + 1] for b in range(batch)],
        [k_pad[b : b + 1, : n[b]] for b in range(batch)],
        [v_pad[b : b + 1, : n[b]] for b in range(batch)],
        causal,
        mask,
    )
    assert_close_to_reference(
        [out[b : b + 1] for b in range(batch)],
        [lse[b : b + 1] for b in range(batch)],
        refs,
        lowps,
        lse_refs,
    )
    assert padded[:, seqlen_q:].isnan().all(), "rows past seqlen_q were written"


def run_varlen_mixed(kv_layout, causal, num_splits, config=None, mask=None):
    mask = mask or {}
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(kv_layout, causal, num_splits))
    q_lens = [1, 300, 1, 77, 0, 1, 513]
    k_lens = [900, 300, 1, 200, 50, 0, 513]
    nheads, nheads_kv, d, dtype = 16, 4, 128, torch.bfloat16
    batch = len(q_lens)
    cu_q = cu_seqlens(q_lens)
    q = torch.randn(int(cu_q[-1]), nheads, d, device="cuda", dtype=dtype, generator=gen)
    kwargs = {}
    if kv_layout == "packed":
        cu_k = cu_seqlens(k_lens)
        k = torch.randn(int(cu_k[-1]), nheads_kv, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn_like(k)
        k_seqs = [k[cu_k[b] : cu_k[b + 1]].unsqueeze(0) for b in range(batch)]
        v_seqs = [v[cu_k[b] : cu_k[b + 1]].unsqueeze(0) for b in range(batch)]
        kwargs["cu_seqlens_k"] = cu_k
    else:
        page_size = 64 if kv_layout == "paged" else None
        k, v, page_table, k_pad, v_pad = make_cache(batch, 960, nheads_kv, d, dtype, page_size, gen)
        k_seqs = [k_pad[b : b + 1, : k_lens[b]] for b in range(batch)]
        v_seqs = [v_pad[b : b + 1, : k_lens[b]] for b in range(batch)]
        kwargs["seqused_k"] = torch.tensor(k_lens, device="cuda", dtype=torch.int32)
        kwargs["page_table"] = page_table
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        max(q_lens),
        max_seqlen_k=max(k_lens),
        causal=causal,
        num_splits=num_splits,
        return_softmax_lse=True,
        out=out,
        config=config,
        **kwargs,
        **mask,
    )
    q_seqs = [q[cu_q[b] : cu_q[b + 1]].unsqueeze(0) for b in range(batch)]
    refs, lowps, lse_refs = reference_per_sequence(q_seqs, k_seqs, v_seqs, causal, mask)
    outs = [out[cu_q[b] : cu_q[b + 1]].unsqueeze(0) for b in range(batch)]
    lses = [lse[:, cu_q[b] : cu_q[b + 1]].unsqueeze(0) for b in range(batch)]
    assert_close_to_reference(outs, lses, refs, lowps, lse_refs)
