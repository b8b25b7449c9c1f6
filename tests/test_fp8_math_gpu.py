"""FP8 math on a Hopper GPU: float8_e4m3fn q, k and v in e4m3 GEMMs (flash_attn_func,
flash_attn_varlen_func, flash_attn_with_kvcache and FlashAttention-3's; prefill shapes and
decode steps over padded or paged caches),
against the float32 reference on the dequantized inputs. The bar: twice the error of a naive
FP8 attention in PyTorch on the same inputs (scores and P V in float32 from the FP8 values,
the normalized probabilities rounded to e4m3), plus a floor; the LSE as for 16-bit inputs.
That bar is loose against a key-order slip at long key counts, so one test makes each query
attend to known keys (a wrong order there is an O(1) error). Native calls' outputs are
poisoned (NaN) before the call; cache slots past each sequence hold NaN."""

import functools

import pytest
import torch
from kv_cases import captured, cu_seqlens
from test_fp8_kv_gpu import fp8_cache, padded, poison_past

import flash_cute
from flash_cute import flash_attn_interface as fa3
from flash_cute.reference import attention_ref, error_bound, stable_seed

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn


def fp8_randn(*shape, gen):
    return torch.randn(*shape, device="cuda", generator=gen).to(FP8)


def descales(form, batch, nheads_kv, gen):
    """q, k and v descales: per (batch, kv head) in [0.25, 2), an expanded scalar, or None."""
    if form is None:
        return None, None, None
    if form == "scalar":
        return tuple(
            torch.full((1, 1), 0.5 + i, device="cuda").expand(batch, nheads_kv) for i in range(3)
        )
    return tuple(
        torch.rand(batch, nheads_kv, device="cuda", generator=gen) * 1.75 + 0.25 for _ in range(3)
    )


def dequantized(x8, scale):
    """x8 (b, s, h_kv, d) FP8 times its (b, h_kv) descale, float32."""
    x = x8.float()
    return x if scale is None else x * scale[:, None, :, None]


def check(out, lse, q8, k8, v8, qd, kd, vd, **mask):
    """out (and lse) against the float32 reference on the dequantized inputs; the bar is twice
    the naive FP8 attention's error (error_bound)."""
    nheads_kv = k8.shape[2]
    q = q8.float()
    if qd is not None:  # q's descale is per kv head: over its group of q heads
        q = q * qd.repeat_interleave(q8.shape[2] // nheads_kv, dim=1)[:, None, :, None]
    k, v = dequantized(k8, kd), dequantized(v8, vd)
    ref, lse_ref = attention_ref(q, k, v, **mask)
    naive, _ = attention_ref(q, k, v, p_dtype=FP8, **mask)
    assert not out.isnan().any(), "NaN in the output (unwritten?)"
    err = (out.float() - ref).abs().max().item()
    bound = error_bound(naive.to(torch.bfloat16), ref)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e} (naive FP8: {bound / 2:.3e})"
    if lse is not None:
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite)
        lse_err = (lse[finite] - lse_ref[finite]).abs().max().item()
        assert lse_err < 1e-3 * max(1.0, lse_ref[finite].abs().max().item()), lse_err


def check_cache(out, lse, q8, k8, v8, table, capacity, lengths, qd, kd, vd):
    """check() of each sequence of a causal call over an FP8 cache (paged through table, or
    padded), keys up to its length; lse may be None."""
    k_pad, v_pad = padded(k8, table, capacity), padded(v8, table, capacity)
    for b, n in enumerate(lengths):
        qb, kb, vb = (None if t is None else t[b : b + 1] for t in (qd, kd, vd))
        check(
            out[b : b + 1], None if lse is None else lse[b : b + 1], q8[b : b + 1],
            k_pad[b : b + 1, :n].to(FP8), v_pad[b : b + 1, :n].to(FP8), qb, kb, vb, causal=True,
        )  # fmt: skip


CASES = [
    # (head_dim, causal, (nheads, nheads_kv), seqlen_q, seqlen_k, descale form)
    (64, False, (8, 8), 113, 1000, "tensor"),
    (64, True, (8, 2), 1000, 1000, None),
    (96, False, (4, 4), 17, 4097, "scalar"),
    (128, False, (16, 4), 1000, 1000, "tensor"),
    (128, True, (16, 4), 4097, 4097, "tensor"),
    (128, True, (8, 8), 1, 1000, "tensor"),
    (192, True, (4, 1), 1000, 113, "tensor"),
    (256, False, (8, 2), 1000, 4097, "tensor"),
    (256, True, (8, 2), 17, 4097, None),
]


@pytest.mark.parametrize("api", ["native", "fa3"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"d{c[0]}-{'causal' if c[1] else 'full'}-{c[3]}x{c[4]}-{c[5]}"
)
def test_fp8_math_prefill(case, api):
    head_dim, causal, (nheads, nheads_kv), seqlen_q, seqlen_k, form = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math", case, api))
    batch = 2
    q8 = fp8_randn(batch, seqlen_q, nheads, head_dim, gen=gen)
    k8 = fp8_randn(batch, seqlen_k, nheads_kv, head_dim, gen=gen)
    v8 = fp8_randn(batch, seqlen_k, nheads_kv, head_dim, gen=gen)
    qd, kd, vd = descales(form, batch, nheads_kv, gen)
    if api == "native":
        out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        _, lse = flash_cute.flash_attn_func(
            q8, k8, v8, causal=causal, out=out, q_descale=qd, k_descale=kd, v_descale=vd,
            return_lse=True,
        )  # fmt: skip
    else:
        out, lse = fa3.flash_attn_func(
            q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
            return_attn_probs=True,
        )  # fmt: skip
    assert out.dtype == torch.bfloat16
    check(out, lse, q8, k8, v8, qd, kd, vd, causal=causal)


# (head dim, mask). A short window at head dim 64 takes the short-window table row (three CTAs
# per SM), whose FP8 form must run one.
MASKS = [
    (128, dict(window_size=(100, 0))),
    (64, dict(window_size=(100, 0))),
    (128, dict(window_size=(300, 64))),
    (128, dict(attention_chunk=256, causal=True)),
    (128, dict(softcap=15.0, causal=True)),
]


@pytest.mark.parametrize(
    "d, mask",
    MASKS,
    ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()) if isinstance(m, dict) else f"d{m}",
)
def test_fp8_math_masks(d, mask):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math mask", str(mask), d))
    batch, seqlen, nheads, nheads_kv = 2, 1000, 8, 2
    q8 = fp8_randn(batch, seqlen, nheads, d, gen=gen)
    k8, v8 = (fp8_randn(batch, seqlen, nheads_kv, d, gen=gen) for _ in range(2))
    qd, kd, vd = descales("tensor", batch, nheads_kv, gen)
    out, lse = flash_cute.flash_attn_func(
        q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, **mask
    )
    check(out, lse, q8, k8, v8, qd, kd, vd, **mask)


def test_fp8_math_sinks_and_splits():
    """Learnable sinks, and a forced split (partials merged in the kernel, their LSEs carrying
    the FP8 offset)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math sinks"))
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, d = 2, 64, 4097, 8, 8, 128
    q8 = fp8_randn(batch, seqlen_q, nheads, d, gen=gen)
    k8, v8 = (fp8_randn(batch, seqlen_k, nheads_kv, d, gen=gen) for _ in range(2))
    qd, kd, vd = descales("tensor", batch, nheads_kv, gen)
    sink = torch.randn(nheads, device="cuda", generator=gen)
    out, lse = flash_cute.flash_attn_func(
        q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
        learnable_sink=sink, return_lse=True,
    )  # fmt: skip
    check(out, lse, q8, k8, v8, qd, kd, vd, causal=True, learnable_sink=sink)
    out, lse = fa3.flash_attn_func(
        q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, num_splits=3,
        return_attn_probs=True,
    )  # fmt: skip
    check(out, lse, q8, k8, v8, qd, kd, vd, causal=True)


@pytest.mark.parametrize("api", ["native", "fa3"])
def test_fp8_math_varlen(api):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math varlen", api))
    seqlens_q, seqlens_k = [1, 17, 1000, 113], [1000, 17, 1000, 4097]
    nheads, nheads_kv, d = 8, 2, 128
    q8 = fp8_randn(sum(seqlens_q), nheads, d, gen=gen)
    k8, v8 = (fp8_randn(sum(seqlens_k), nheads_kv, d, gen=gen) for _ in range(2))
    qd, kd, vd = descales("tensor", len(seqlens_q), nheads_kv, gen)
    cu_q, cu_k = cu_seqlens(seqlens_q), cu_seqlens(seqlens_k)
    if api == "native":
        out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        flash_cute.flash_attn_varlen_func(
            q8, k8, v8, cu_q, max(seqlens_q), cu_seqlens_k=cu_k, max_seqlen_k=max(seqlens_k),
            causal=True, out=out, q_descale=qd, k_descale=kd, v_descale=vd,
        )  # fmt: skip
    else:
        out = fa3.flash_attn_varlen_func(
            q8, k8, v8, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
            q_descale=qd, k_descale=kd, v_descale=vd,
        )  # fmt: skip
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        q0, k0 = sum(seqlens_q[:b]), sum(seqlens_k[:b])
        qb, kb, vb = (None if t is None else t[b : b + 1] for t in (qd, kd, vd))
        check(
            out[None, q0 : q0 + sq], None, q8[None, q0 : q0 + sq], k8[None, k0 : k0 + sk],
            v8[None, k0 : k0 + sk], qb, kb, vb, causal=True,
        )  # fmt: skip


def test_fp8_math_key_order():
    """Scale 1 and one-hot q and k (8 at dim i % d): query i attends to the keys j with
    j % d == i % d alone (score 64 against 0), so O is the mean of those keys' V rows; a key
    permuted within its 32 (the V^T order) or a column of V^T lost lands far from it. Keys
    4097: partial last blocks; fp16 out."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math key order"))
    for d, seqlen_k in ((128, 4097), (256, 1000), (64, 333)):
        seqlen_q, nheads = 256, 4
        eye = torch.eye(d, device="cuda") * 8
        q8 = eye[torch.arange(seqlen_q) % d].view(1, seqlen_q, 1, d).expand(2, -1, nheads, -1)
        k8 = eye[torch.arange(seqlen_k) % d].view(1, seqlen_k, 1, d).expand(2, -1, nheads, -1)
        q8, k8 = q8.contiguous().to(FP8), k8.contiguous().to(FP8)
        v8 = fp8_randn(2, seqlen_k, nheads, d, gen=gen)
        out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.float16)
        flash_cute.flash_attn_func(q8, k8, v8, softmax_scale=1.0, out=out)
        rows = torch.arange(seqlen_k, device="cuda") % d
        means = torch.stack([v8.float()[:, rows == r].mean(1) for r in range(d)], 1)
        expected = means[:, torch.arange(seqlen_q) % d]  # (2, seqlen_q, nheads, d)
        err = (out.float() - expected).abs().max().item()
        assert err < 0.05, f"d{d} keys {seqlen_k}: max error {err:.3e} (key order?)"


@pytest.mark.parametrize("page", [None, 16])
def test_fp8_math_cache_prefill(page):
    """A prefill against an FP8 cache (flash_attn_with_kvcache; padded, or pages of 16 whose
    rows are gathered): per-sequence lengths whose last key block is partial, NaN in every
    slot past them (the transposing warps zero V^T's keys past the sequence; P is 0 there,
    0 * NaN must not reach O)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math cache prefill", page))
    batch, capacity, seqlen_q, nheads, nheads_kv, d = 3, 1100, 300, 8, 2, 128
    lengths = [1000, 517, 1100]
    k8, v8, table = fp8_cache(batch, capacity, nheads_kv, d, page, gen)
    poison_past(k8, table, lengths, capacity)
    poison_past(v8, table, lengths, capacity)
    q8 = fp8_randn(batch, seqlen_q, nheads, d, gen=gen)
    qd, kd, vd = descales("tensor", batch, nheads_kv, gen)
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    flash_cute.flash_attn_with_kvcache(
        q8, k8, v8, cache_seqlens=seqlens, page_table=table, causal=True, out=out,
        q_descale=qd, k_descale=kd, v_descale=vd,
    )  # fmt: skip
    check_cache(out, None, q8, k8, v8, table, capacity, lengths, qd, kd, vd)


DECODE_CASES = [
    # (head_dim, page_size, num_splits, (nheads, nheads_kv), seqlen_q, descale form)
    (128, None, 0, (32, 8), 1, "tensor"),
    (128, 64, 0, (32, 8), 1, None),  # SGLang's call: FP8 q and cache, descales left at None
    (128, 64, 3, (8, 8), 1, "scalar"),
    (64, 128, 0, (16, 2), 4, "tensor"),  # speculative tokens
    (96, None, 1, (8, 1), 1, "tensor"),
    (192, 64, 0, (16, 4), 1, "tensor"),
    (256, None, 0, (16, 2), 1, "tensor"),
    (256, 256, 2, (8, 1), 2, None),
    # Pages no TMA box follows (rows gathered with cp.async): vLLM's 16, SGLang's 1, others.
    (128, 16, 0, (32, 8), 1, "tensor"),
    (128, 1, 0, (32, 8), 1, None),
    (64, 8, 3, (16, 4), 2, "scalar"),
    (256, 24, 0, (8, 2), 1, "tensor"),
]


@pytest.mark.parametrize("api", ["native", "fa3"])
@pytest.mark.parametrize(
    "case",
    DECODE_CASES,
    ids=lambda c: f"d{c[0]}-p{c[1]}-s{c[2]}-{c[3][0]}x{c[3][1]}-q{c[4]}-{c[5]}",
)
def test_fp8_math_decode(case, api):
    """Decode steps over FP8 caches (padded, or paged: TMA boxes or gathered rows), lengths 1
    to 4097 with NaN past each, forced and heuristic splits, the LSE."""
    head_dim, page_size, num_splits, (nheads, nheads_kv), seqlen_q, form = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math decode", case, api))
    batch, capacity = 4, 4097
    lengths = [seqlen_q, 17, 1000, 4097]
    k8, v8, table = fp8_cache(batch, capacity, nheads_kv, head_dim, page_size, gen)
    poison_past(k8, table, lengths, capacity)
    poison_past(v8, table, lengths, capacity)
    q8 = fp8_randn(batch, seqlen_q, nheads, head_dim, gen=gen)
    qd, kd, vd = descales(form, batch, nheads_kv, gen)
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    kw = dict(
        cache_seqlens=seqlens, page_table=table, causal=True, num_splits=num_splits,
        q_descale=qd, k_descale=kd, v_descale=vd, return_softmax_lse=True,
    )  # fmt: skip
    if api == "native":
        out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        _, lse = flash_cute.flash_attn_with_kvcache(q8, k8, v8, out=out, **kw)
    else:
        out, lse, *_ = fa3.flash_attn_with_kvcache(q8, k8, v8, **kw)
    check_cache(out, lse, q8, k8, v8, table, capacity, lengths, qd, kd, vd)


@pytest.mark.parametrize("page", [64, 1])
def test_fp8_math_decode_graph_replay(page):
    """A captured FP8 decode step (paged: TMA boxes or gathered rows; split by the heuristic)
    replayed with new queries, lengths and page-table contents holds the bar each time."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 math graph", page))
    batch, capacity, nheads, nheads_kv, d = 3, 2048, 32, 8, 128
    k8, v8, table = fp8_cache(batch, capacity, nheads_kv, d, page, gen)
    q8 = fp8_randn(batch, 1, nheads, d, gen=gen)
    qd, kd, vd = descales("tensor", batch, nheads_kv, gen)
    seqlens = torch.tensor([5, 700, 2048], device="cuda", dtype=torch.int32)
    step = dict(cache_seqlens=seqlens, page_table=table, q_descale=qd, k_descale=kd, v_descale=vd)
    graph, out = captured(
        functools.partial(flash_cute.flash_attn_with_kvcache, q8, k8, v8, causal=True, **step)
    )
    for lengths in ([1, 2048, 333], [2000, 64, 1]):
        q8.copy_(fp8_randn(batch, 1, nheads, d, gen=gen))
        for scale, new in zip((qd, kd, vd), descales("tensor", batch, nheads_kv, gen)):
            scale.copy_(new)  # (read by the kernel at each replay, none folded at capture)
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        table.copy_(table[torch.randperm(batch, device="cuda", generator=gen)])
        out.fill_(float("nan"))
        graph.replay()
        check_cache(out, None, q8, k8, v8, table, capacity, lengths, qd, kd, vd)
