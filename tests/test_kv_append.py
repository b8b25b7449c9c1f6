"""Appending keys and values to a KV cache (flash_cute.kv_append, FlashAttention-3's k, v,
rotary_cos, ... of flash_attn_with_kvcache) against a row-by-row reference: the cache after the
call (the untouched rows bit-identical), the rotated queries and the lengths the attention then
reads. The `run` fixture runs each case on the CPU (PyTorch ops) and, marked gpu, on the GPU
(the append kernel, kernels/kv_append.py)."""

import dataclasses
import itertools
import math

import pytest
import torch

from flash_cute import flash_attn_interface as fa3
from flash_cute import forward
from flash_cute.kv_append import KVAppend, apply


def rotate_one(x, cos, sin, interleaved):
    """One vector x (d,) rotated over its first 2 * len(cos) dims, in float64."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    out, half = x.clone(), cos.shape[0]
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        out[a] = x[a] * cos[j] - x[b] * sin[j]
        out[b] = x[a] * sin[j] + x[b] * cos[j]
    return out


def reference(q, k_cache, v_cache, append, lengths, page_table=None, batch_idx=None, cu_q=None,
              per_row=True):  # fmt: skip
    """(q rotated, k_cache, v_cache after the append, lengths after it), row by row."""
    a = append
    q, k_cache, v_cache = q.clone(), k_cache.clone(), v_cache.clone()
    batch = len(lengths)
    cu_new = a.cu_seqlens_k_new
    for b in range(batch):
        if cu_new is None:
            new_k, new_v = a.k[b], a.v[b]
        else:
            new_k, new_v = a.k[cu_new[b] : cu_new[b + 1]], a.v[cu_new[b] : cu_new[b + 1]]
        offset = int((a.rotary_seqlens if a.rotary_seqlens is not None else lengths)[b])
        row = b if batch_idx is None else int(batch_idx[b])
        for i in range(new_k.shape[0]):
            pos = int(lengths[b]) + i
            kk = new_k[i]
            if a.rotary_cos is not None:
                c, s = a.rotary_cos[offset + i], a.rotary_sin[offset + i]
                kk = torch.stack([rotate_one(kk[h], c, s, a.rotary_interleaved)
                                  for h in range(kk.shape[0])]).to(kk.dtype)  # fmt: skip
            if page_table is None:
                if pos < k_cache.shape[1]:
                    k_cache[row, pos], v_cache[row, pos] = kk, new_v[i]
            else:
                ps = k_cache.shape[1]
                if pos // ps < page_table.shape[1]:
                    page = int(page_table[row, pos // ps])
                    k_cache[page, pos % ps], v_cache[page, pos % ps] = kk, new_v[i]
        if a.rotary_cos is not None:
            rows = range(cu_q[b], cu_q[b + 1]) if cu_q is not None else range(q.shape[1])
            for n, r in enumerate(rows):
                p = offset + (n if per_row else 0)
                c, s = a.rotary_cos[p], a.rotary_sin[p]
                view = q[r] if cu_q is not None else q[b, r]
                for h in range(view.shape[0]):
                    view[h] = rotate_one(view[h], c, s, a.rotary_interleaved).to(q.dtype)
    if cu_new is None:
        counts = [a.k.shape[1]] * batch
    else:
        counts = [int(cu_new[b + 1] - cu_new[b]) for b in range(batch)]
    return q, k_cache, v_cache, [int(lengths[b]) + counts[b] for b in range(batch)]


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def run(request):
    """apply on the fixture's device: the inputs moved there, the results moved back, and
    seqused_k the lengths the attention reads (the kernel's path leaves seqused_k as it was
    and says how many rows each sequence gained in appended_keys: the forward adds them)."""
    device = request.param

    def move(t, to=device):
        return t.to(to) if isinstance(t, torch.Tensor) else t

    def run_apply(append, fields):
        values = {f.name: move(getattr(append, f.name)) for f in dataclasses.fields(append)}
        # (fuse=False: the kernel writes the rows here; the fused path is end to end,
        # tests/test_kv_append_gpu.py)
        got = apply(KVAppend(**values), {n: move(t) for n, t in fields.items()}, fuse=False)
        got = {name: move(t, "cpu") for name, t in got.items()}
        appended = got.pop("appended_keys", None)
        if appended is not None:
            got["seqused_k"] = (got["seqused_k"] + appended).to(torch.int32)
        return got

    return run_apply


CASES = list(
    itertools.product(
        [None, 4],  # page size
        [False, True],  # cache_batch_idx
        [False, True],  # varlen new rows (cu_seqlens_k_new)
        [0, 8, 16],  # rotary_dim (of head dim 16)
        [False, True],  # interleaved
        [False, True],  # causal (queries rotated per row)
    )
)


@pytest.mark.parametrize("page_size, has_batch_idx, varlen_new, rotary_dim, interleaved, causal",
                         CASES)  # fmt: skip
def test_append_matches_row_by_row(page_size, has_batch_idx, varlen_new, rotary_dim, interleaved,
                                   causal, run):  # fmt: skip
    gen = torch.Generator().manual_seed(hash((page_size, has_batch_idx, varlen_new)) % 1000)
    batch, hkv, h, d, capacity, seqlen_q = 3, 2, 4, 16, 22, 5
    rows = batch * 2 if has_batch_idx else batch
    if page_size is None:
        k_cache = torch.randn(rows, capacity, hkv, d, generator=gen)
        page_table = None
    else:
        pages = rows * (capacity // page_size)  # (5 pages a row: 20 slots)
        k_cache = torch.randn(pages, page_size, hkv, d, generator=gen)
        page_table = torch.randperm(pages, generator=gen).int().reshape(rows, -1)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    lengths = int32(3, 0, 19)  # the last sequence's new rows run past the capacity: dropped
    if varlen_new:
        cu_new = int32(0, 2, 7, 11)  # (a 12th row past the last sequence writes nothing)
        k, v = (torch.randn(12, hkv, d, generator=gen) for _ in range(2))
    else:
        cu_new = None
        k, v = (torch.randn(batch, 4, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(batch, seqlen_q, h, d, generator=gen)
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(40, rotary_dim // 2, generator=gen) * 2 * math.pi
        cos, sin = torch.cos(angle), torch.sin(angle)
    batch_idx = torch.randperm(rows, generator=gen)[:batch].int() if has_batch_idx else None
    append = KVAppend(k, v, cos, sin, cu_new, None, interleaved)
    want = reference(q, k_cache, v_cache, append, lengths, page_table, batch_idx, per_row=causal)
    fields = dict(q=q, k=k_cache.clone(), v=v_cache.clone(), seqused_k=lengths,
                  page_table=page_table, kv_batch_idx=batch_idx, causal=causal)  # fmt: skip
    got = run(append, fields)
    assert torch.allclose(got["q"], want[0], atol=1e-6)
    assert torch.allclose(got["k"], want[1], atol=1e-6)
    assert torch.equal(got["v"], want[2])
    assert got["seqused_k"].tolist() == want[3] and got["seqused_k"].dtype == torch.int32
    untouched = (want[1] == k_cache).all(-1).all(-1)  # rows the append leaves: bit-identical
    assert torch.equal(got["k"][untouched], k_cache[untouched])


@pytest.mark.parametrize("page_size, has_batch_idx, varlen_new, rotary_dim, interleaved, causal",
                         CASES[::5])  # fmt: skip
def test_append_reads_no_value_on_the_host(page_size, has_batch_idx, varlen_new, rotary_dim,
                                           interleaved, causal):  # fmt: skip
    """The append runs on meta tensors, which have no values: it never reads one on the host
    (a graph capture cannot, and a read would sync every decode step)."""
    batch, hkv, h, d, capacity, rows = 3, 2, 4, 16, 20, 6
    meta = dict(device="meta")
    if page_size is None:
        k_cache, page_table = torch.empty(rows, capacity, hkv, d, **meta), None
    else:
        k_cache = torch.empty(rows * 5, page_size, hkv, d, **meta)
        page_table = torch.empty(rows, 5, dtype=torch.int32, **meta)
    n_new = (12,) if varlen_new else (batch, 4)
    k, v = (torch.empty(*n_new, hkv, d, **meta) for _ in range(2))
    cu_new = torch.empty(batch + 1, dtype=torch.int32, **meta) if varlen_new else None
    cos = sin = None
    if rotary_dim:
        cos, sin = (torch.empty(40, rotary_dim // 2, **meta) for _ in range(2))
    batch_idx = torch.empty(batch, dtype=torch.int32, **meta) if has_batch_idx else None
    fields = dict(q=torch.empty(batch, 5, h, d, **meta), k=k_cache, v=torch.empty_like(k_cache),
                  seqused_k=torch.empty(batch, dtype=torch.int32, **meta),
                  page_table=page_table, kv_batch_idx=batch_idx, causal=causal)  # fmt: skip
    got = apply(KVAppend(k, v, cos, sin, cu_new, None, interleaved), fields)
    assert got["q"].shape == fields["q"].shape and got["seqused_k"].shape == (batch,)


def test_varlen_queries_and_int_lengths_and_bf16(run):
    """Packed queries rotate per sequence; an int cache_seqlens is every sequence's; a bf16
    cache gets the float32 rotation rounded once."""
    gen = torch.Generator().manual_seed(5)
    batch, hkv, h, d = 2, 1, 2, 32
    k_cache = torch.randn(batch, 16, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(batch, 16, hkv, d, generator=gen).bfloat16()
    k, v = (torch.randn(batch, 3, hkv, d, generator=gen).bfloat16() for _ in range(2))
    cu_q = int32(0, 1, 4)
    q = torch.randn(4, h, d, generator=gen).bfloat16()
    angle = torch.rand(20, 8, generator=gen) * 6.0
    cos, sin = torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()
    append = KVAppend(k, v, cos, sin, rotary_interleaved=False)
    want = reference(q, k_cache, v_cache, append, [5, 5], cu_q=cu_q, per_row=True)
    got = run(append, dict(q=q, k=k_cache.clone(), v=v_cache.clone(), kv_length=5,
                             cu_seqlens_q=cu_q, causal=True))  # fmt: skip
    ulp = 2.0**-7  # (float32 against float64 rotation: at most one bf16 rounding apart)
    assert ((got["q"].float() - want[0].float()).abs() <= ulp * want[0].float().abs() + 1e-6).all()
    assert ((got["k"].float() - want[1].float()).abs() <= ulp * want[1].float().abs() + 1e-6).all()
    assert torch.equal(got["v"], want[2]) and got["seqused_k"].tolist() == [8, 8]


@pytest.fixture
def natives(fake_gpu, monkeypatch):
    """The Calls (and keys) flash_attn_with_kvcache hands the forward path, which is not run
    (its checks are: fake_gpu lets CPU tensors through them)."""
    calls = []

    def run(call, names, plans, key):
        calls.append((call, key))
        return ("out", "lse") if call.return_lse else "out"

    monkeypatch.setattr(forward, "run", run)
    return calls


def test_fa3_kvcache_appends_then_attends_without_replay(natives):
    q = torch.randn(2, 1, 4, 64).bfloat16()
    cache = torch.zeros(2, 32, 2, 64).bfloat16()
    k = torch.randn(2, 1, 2, 64).bfloat16()
    fa3.flash_attn_with_kvcache(q, cache, cache.clone(), k, k, cache_seqlens=int32(3, 7))
    (call, key), = natives  # fmt: skip
    assert key is None  # (an appending call is not replayed: its plan would skip the append)
    assert call.seqused_k.tolist() == [4, 8]
    assert torch.equal(cache[0, 3], k[0, 0]) and torch.equal(cache[1, 7], k[1, 0])
    fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=int32(3, 7))
    assert natives[-1][1] is not None  # (no append: replayable)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(k="k"), ValueError, "k and v .* must be given together"),
        (dict(rotary_cos="cos", rotary_sin="cos"), ValueError, "need k and v"),
        (dict(k="k", v="k", rotary_cos="cos"), ValueError, "rotary_cos and rotary_sin"),
        (dict(k="k", v="k", cache_seqlens=None), ValueError, "needs cache_seqlens"),
        (dict(k="k8", v="k8"), ValueError, "k must have its cache's dtype"),
        (dict(k="k3", v="k3"), ValueError, r"k and v must be \(batch=2"),
        (dict(k="k", v="k", rotary_cos="wide", rotary_sin="wide"), ValueError, "rotary_dim"),
        (dict(k="k", v="k", cu_seqlens_k_new="cu"), ValueError, "total_new"),
        (
            dict(k="k", v="k", rotary_cos="cos", rotary_sin="cos16"),
            ValueError,
            "one shape and dtype",
        ),
        (dict(k="k", v="k", rotary_cos="cosT", rotary_sin="cosT"), ValueError, "contiguous last"),
        (
            dict(k="k", v="k", rotary_cos="cos64", rotary_sin="cos64"),
            ValueError,
            "float8_e4m3fn tensor",
        ),
    ],
)
def test_append_arguments_are_checked_by_name(natives, kwargs, error, match):
    q = torch.randn(2, 1, 4, 64).bfloat16()
    cache = torch.zeros(2, 32, 2, 64).bfloat16()
    named = {
        "k": torch.randn(2, 1, 2, 64).bfloat16(),
        "k8": torch.randn(2, 1, 2, 64).float(),
        "k3": torch.randn(3, 1, 2, 64).bfloat16(),
        "cos": torch.ones(40, 16),
        "cos16": torch.ones(40, 16).bfloat16(),
        "cosT": torch.ones(16, 40).t(),
        "cos64": torch.ones(40, 16).double(),
        "wide": torch.ones(40, 40),
        "cu": int32(0, 1, 2),
    }
    args = dict(cache_seqlens=int32(3, 7))
    args.update({n: named.get(v, v) if isinstance(v, str) else v for n, v in kwargs.items()})
    with pytest.raises(error, match=match):
        fa3.flash_attn_with_kvcache(q, cache, cache, **args)
    assert not natives


def _small(gen, batch=2, capacity=16, hkv=1, d=16, new=2):
    k_cache = torch.randn(batch, capacity, hkv, d, generator=gen)
    v_cache = torch.randn(batch, capacity, hkv, d, generator=gen)
    k, v = (torch.randn(batch, new, hkv, d, generator=gen) for _ in range(2))
    angle = torch.rand(capacity + 8, d // 2, generator=gen) * 6.0
    return k_cache, v_cache, k, v, torch.cos(angle), torch.sin(angle)


@pytest.mark.parametrize(
    "mask, per_row",
    [
        (dict(causal=True), True),
        (dict(), False),
        (dict(window_size=(2, -1)), True),  # (a window narrower than the keys: local)
        (dict(window_size=(-1, 5)), False),  # (wider than 3 queries: FA3 drops it)
        (dict(window_size=(15, -1)), False),  # (covers all 16 slots: dropped too)
        (dict(attention_chunk=4), True),
    ],
)
def test_query_positions_follow_the_mask_and_rotary_seqlens(mask, per_row, run):
    """Queries rotate per row where FlashAttention-3's mask is causal or local (a window side
    covering everything counts as none), at rotary_seqlens when given."""
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, k, v, cos, sin = _small(gen)
    q = torch.randn(2, 3, 2, 16, generator=gen)
    offsets = int32(9, 1)
    append = KVAppend(k, v, cos, sin, rotary_seqlens=offsets, rotary_interleaved=False)
    lengths = int32(4, 6)
    want = reference(q, k_cache, v_cache, append, lengths, per_row=per_row)
    got = run(append, dict(q=q, k=k_cache.clone(), v=v_cache.clone(), seqused_k=lengths,
                             **mask))  # fmt: skip
    assert torch.allclose(got["q"], want[0], atol=1e-6)
    assert torch.allclose(got["k"], want[1], atol=1e-6)  # (keys at rotary_seqlens + i)
    # Packed queries: the same positions per sequence.
    cu_q = int32(0, 3, 6)
    packed = run(append, dict(q=q.reshape(6, 2, 16), k=k_cache.clone(), v=v_cache.clone(),
                                seqused_k=lengths, cu_seqlens_q=cu_q, max_seqlen_q=3,
                                **mask))  # fmt: skip
    assert torch.allclose(packed["q"], want[0].reshape(6, 2, 16), atol=1e-6)


def test_rows_without_a_real_slot_write_nothing(run):
    """Packed rows outside cu_seqlens_k_new's range, negative lengths, cache rows out of range:
    no exception, no write outside the cache, every other slot as the reference leaves it."""
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache, _, _, _, _ = _small(gen, batch=3)
    k, v = (torch.randn(7, 1, 16, generator=gen) for _ in range(2))
    cu_new = int32(1, 3, 3, 5)  # rows 0, 5 and 6 belong to no sequence; sequence 1 has none
    lengths = int32(2, 4, 15)  # sequence 2's second row falls past the capacity (16)
    batch_idx = int32(2, 0, 1)
    append = KVAppend(k, v, cu_seqlens_k_new=cu_new)
    fields = dict(q=torch.randn(3, 1, 2, 16, generator=gen), k=k_cache.clone(), v=v_cache.clone())
    got = run(append, dict(fields, seqused_k=lengths, kv_batch_idx=batch_idx))
    want_k = k_cache.clone()
    want_k[2, 2:4] = k[1:3]  # sequence 0 -> cache row 2, slots 2, 3
    want_k[1, 15] = k[3]  # sequence 2 -> cache row 1, slot 15 (slot 16 dropped)
    assert torch.equal(got["k"], want_k) and got["seqused_k"].tolist() == [4, 4, 17]
    bad = run(KVAppend(k[:2], v[:2], cu_seqlens_k_new=int32(0, 1, 1, 2)),
                dict(q=torch.randn(3, 1, 2, 16), k=k_cache.clone(), v=v_cache.clone(),
                     seqused_k=int32(-3, 0, 2), kv_batch_idx=int32(0, 1, 7)))  # fmt: skip
    assert torch.equal(bad["k"], k_cache)  # (a negative length, a row past the cache's 3)
    assert torch.equal(bad["v"], v_cache) and bad["seqused_k"].tolist() == [-2, 0, 3]
    # Pages out of range (negative, or past the pool's 6) write nothing either.
    pool_k, pool_v = (torch.randn(6, 4, 1, 16, generator=gen) for _ in range(2))
    table = int32(0, -1, 2, 3, 6, 5).reshape(2, 3)
    paged = run(KVAppend(k[:4].reshape(2, 2, 1, 16), v[:4].reshape(2, 2, 1, 16)),
                dict(q=torch.randn(2, 1, 2, 16), k=pool_k.clone(), v=pool_v.clone(),
                     seqused_k=int32(3, 0), page_table=table))  # fmt: skip
    want_k, want_v = pool_k.clone(), pool_v.clone()
    want_k[0, 3], want_v[0, 3] = k[0], v[0]  # sequence 0's slot 3 (page 0); slot 4: page -1
    want_k[3, 0:2], want_v[3, 0:2] = k[2:4], v[2:4]  # sequence 1's slots 0, 1 (page 3)
    assert torch.equal(paged["k"], want_k) and torch.equal(paged["v"], want_v)


def test_a_refused_call_leaves_the_cache_alone(natives):
    q = torch.randn(2, 1, 4, 64).bfloat16()
    cache = torch.zeros(2, 32, 2, 64).bfloat16()
    k = torch.randn(2, 1, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="softcap"):
        fa3.flash_attn_with_kvcache(q, cache, cache, k, k, cache_seqlens=int32(3, 7), softcap=-1.0)
    assert not cache.any() and not natives
    with pytest.raises(ValueError, match="a row per cache slot"):
        short = torch.ones(8, 16)
        fa3.flash_attn_with_kvcache(
            q, cache, cache, k, k, rotary_cos=short, rotary_sin=short, cache_seqlens=int32(3, 7)
        )
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        fa3.flash_attn_with_kvcache(q, cache, cache, k, k, rotary_cos=torch.ones(32, 16),
                                    rotary_sin=torch.ones(32, 16), cache_seqlens=int32(3, 7),
                                    rotary_interleaved=None)  # fmt: skip
    assert not cache.any() and not natives


def test_appends_are_refused_inside_torch_compile(natives, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q = torch.randn(2, 1, 4, 64).bfloat16()
    cache = torch.zeros(2, 32, 2, 64).bfloat16()
    k = torch.randn(2, 1, 2, 64).bfloat16()
    with pytest.raises(NotImplementedError, match="torch.compile"):
        fa3.flash_attn_with_kvcache(q, cache, cache, k, k, cache_seqlens=int32(3, 7))
    assert not cache.any()


def test_no_sequences_append_nothing(run):
    """A batch of no sequences: nothing written (on the GPU, no launch of no blocks)."""
    k_cache, v_cache = torch.randn(2, 16, 1, 16), torch.randn(2, 16, 1, 16)
    k = torch.randn(0, 1, 16)
    got = run(KVAppend(k, k, cu_seqlens_k_new=int32(0)),
              dict(q=torch.randn(0, 2, 16), k=k_cache.clone(), v=v_cache.clone(),
                   seqused_k=int32(), cu_seqlens_q=int32(0), max_seqlen_q=0))  # fmt: skip
    assert torch.equal(got["k"], k_cache) and got["seqused_k"].shape == (0,)


def test_other_widths_and_an_fp8_cache(run):
    """v wider than k (64 / 512, a latent cache's shapes) and an FP8 cache, copied as they
    are (no rotary)."""
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache = (
        torch.randn(2, 8, 1, 64, generator=gen),
        torch.randn(2, 8, 1, 512, generator=gen),
    )
    k, v = torch.randn(2, 1, 1, 64, generator=gen), torch.randn(2, 1, 1, 512, generator=gen)
    got = run(KVAppend(k, v), dict(q=torch.randn(2, 1, 4, 64), k=k_cache.clone(),
                                   v=v_cache.clone(), seqused_k=int32(5, 7)))  # fmt: skip
    assert torch.equal(got["k"][0, 5], k[0, 0]) and torch.equal(got["v"][1, 7], v[1, 0])
    assert torch.equal(got["v"][0, :5], v_cache[0, :5]) and got["seqused_k"].tolist() == [6, 8]
    fp8 = torch.float8_e4m3fn
    cache8 = torch.randn(2, 8, 2, 32, generator=gen).to(fp8)
    new8 = torch.randn(2, 2, 2, 32, generator=gen).to(fp8)
    got = run(KVAppend(new8, new8), dict(q=torch.randn(2, 1, 4, 32), k=cache8.clone(),
                                         v=cache8.clone(), seqused_k=int32(0, 6)))  # fmt: skip
    bits = lambda t: t.view(torch.uint8)  # noqa: E731  (float8 equality by bytes)
    assert torch.equal(bits(got["k"][0, :2]), bits(new8[0]))
    assert torch.equal(bits(got["v"][1, 6:8]), bits(new8[1]))
    assert torch.equal(bits(got["k"][1, :6]), bits(cache8[1, :6]))


def test_no_new_rows_append_nothing(run):
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache, k, v, _, _ = _small(gen, new=0)
    got = run(KVAppend(k, v), dict(q=torch.randn(2, 1, 1, 16), k=k_cache.clone(),
                                     v=v_cache.clone(), seqused_k=int32(3, 5)))  # fmt: skip
    assert torch.equal(got["k"], k_cache) and got["seqused_k"].tolist() == [3, 5]


def test_the_launch_passes_each_argument_by_its_name(monkeypatch):
    """APPEND_ARGUMENTS is the kernel's __call__ signature (its one declaration); the launch
    passes the value of each name in that order."""
    import contextlib

    from flash_cute.kernels.kv_append import APPEND_ARGUMENTS

    from flash_cute import kv_append
    from flash_cute.kv_append import _checked, _launch

    got = []
    monkeypatch.setattr(kv_append, "get_append_kernel", lambda key: lambda *a: got.extend(a))
    monkeypatch.setattr(kv_append, "on_device", lambda device: contextlib.nullcontext())
    gen = torch.Generator().manual_seed(15)
    k_cache, v_cache, k, v, cos, sin = _small(gen)
    lengths, q = int32(3, 5), torch.randn(2, 1, 2, 16)
    append = KVAppend(k, v, cos, sin, rotary_seqlens=int32(1, 2))
    c = _checked(append, dict(q=q, k=k_cache, v=v_cache, seqused_k=lengths, causal=True))
    _launch(c, append)
    by_name = dict(zip(APPEND_ARGUMENTS, got))
    assert len(got) == len(APPEND_ARGUMENTS)
    assert by_name["k_cache"] is k_cache and by_name["v_cache"] is v_cache
    assert by_name["lengths"] is lengths and by_name["seqlen_new"] == 2
    assert by_name["cos"] is cos and by_name["sin"] is sin
    assert by_name["rotary_seqlens"] is append.rotary_seqlens and by_name["seqlen_q"] == 1
    assert by_name["q"].shape == (2, 2, 16) and by_name["q_out"].shape == (2, 2, 16)


@pytest.mark.parametrize("form", ["lengths", "varlen new rows", "int lengths"])
def test_the_kernel_path_leaves_the_lengths_to_the_forward(form, monkeypatch):
    """Through the kernel, a lengths tensor and batch-major new rows reach the forward as they
    were, with appended_keys the rows each sequence gained (the forward adds them and starts
    while the append runs); other forms get the lengths the append kernel wrote."""
    from flash_cute import kv_append

    written = int32(9, 9)
    monkeypatch.setattr(kv_append, "_uses_kernel", lambda c: True)
    launched = []

    def launch(c, append, writes_lengths=True):
        launched.append(writes_lengths)
        return c.q, written if writes_lengths else None

    monkeypatch.setattr(kv_append, "_launch", launch)
    gen = torch.Generator().manual_seed(16)
    k_cache, v_cache, k, v, _, _ = _small(gen)
    lengths, q = int32(3, 5), torch.randn(2, 1, 2, 16)
    fields = dict(q=q, k=k_cache, v=v_cache, seqused_k=lengths)
    append = KVAppend(k, v)
    if form == "varlen new rows":
        append = KVAppend(k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_k_new=int32(0, 2, 4))
    if form == "int lengths":
        fields = dict(fields, seqused_k=None, kv_length=3)
    got = apply(append, fields)
    if form == "lengths":
        assert got["seqused_k"] is lengths and got["appended_keys"] == 2
        assert launched == [False]  # (the kernel writes no lengths the forward could race)
    else:
        assert got["seqused_k"] is written and got.get("appended_keys") is None
        assert got["kv_length"] is None


def test_appended_keys_count_rows_past_seqused_k():
    """Call.appended_keys: the forward plans an after_append variant and passes the count as
    the kernel's scalar; without seqused_k it is refused by name."""
    q, k = torch.randn(2, 1, 4, 64).bfloat16(), torch.randn(2, 32, 2, 64).bfloat16()
    call = forward.Call(q, k, k, seqused_k=int32(3, 7), appended_keys=1)
    assert forward.describe(call, {}).after_append
    assert forward.kernel_call_args(call)[-1] == 1
    assert not forward.describe(call.replace(appended_keys=None), {}).after_append
    with pytest.raises(ValueError, match="appended_keys"):
        forward.describe(call.replace(seqused_k=None), {})
    with pytest.raises(ValueError, match="appended_keys=33 exceeds"):
        forward.describe(call.replace(appended_keys=33), {})
    with pytest.raises(ValueError, match="appended_keys must be >= 0"):
        forward.describe(call.replace(appended_keys=-1), {})
    with pytest.raises(ValueError, match="after_append"):
        dataclasses.replace(_decode_variant(), seqused_k=False, after_append=True)


def _decode_variant():
    from flash_cute.plan import Problem, plan_forward

    problem = Problem(
        batch=1, nheads=4, nheads_kv=2, head_dim=64, dtype="bfloat16", max_seqlen_q=1,
        max_seqlen_k=32, kv_capacity=32, seqused_k=True, after_append=True,
    )  # fmt: skip
    return plan_forward(problem, 132, None, 0, None, True).variant


def _e4m3_close(got, want):
    """Values within one step of their dtype (e4m3 or bf16) of each other: the rotations may
    round a float32 sum on either side."""
    assert got.dtype == want.dtype
    bits, tiny = (3, 2**-9) if got.dtype == torch.float8_e4m3fn else (7, 2**-126)
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= want.abs() * 2.0**-bits + tiny).all())


FP8_ROTARY = [  # (cache, queries, tables): FlashAttention-3's FP8 forms
    ("e4m3", "e4m3", "e4m3"),
    ("e4m3", "bf16", "bf16"),
    ("bf16", "e4m3", "bf16"),
    ("bf16", "bf16", "e4m3"),
]


@pytest.mark.parametrize("dtypes", FP8_ROTARY, ids="-".join)
@pytest.mark.parametrize("interleaved", [False, True])
def test_fp8_rotation_matches_row_by_row(dtypes, interleaved, run):
    """Rotary with an FP8 cache, FP8 queries or FP8 tables: the rows rotated in float32 and
    rounded once to their dtype, as the 16-bit rows are."""
    names = {"e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    cache_dtype, q_dtype, table_dtype = (names[n] for n in dtypes)
    gen = torch.Generator().manual_seed(17)
    k_cache, v_cache, k, v, cos, sin = _small(gen, d=32)
    k_cache, v_cache, k, v = (t.to(cache_dtype) for t in (k_cache, v_cache, k, v))
    cos, sin = cos.to(table_dtype), sin.to(table_dtype)
    q = torch.randn(2, 3, 2, 32, generator=gen).to(q_dtype)
    lengths = int32(3, 9)
    append = KVAppend(k, v, cos[:, :12], sin[:, :12], rotary_interleaved=interleaved)
    fields = dict(q=q, k=k_cache.clone(), v=v_cache.clone(), seqused_k=lengths, causal=True)
    got = run(append, fields)
    want = reference(q, k_cache, v_cache, append, lengths)
    assert _e4m3_close(got["q"], want[0]) and _e4m3_close(got["k"], want[1])
    assert torch.equal(got["v"].view(torch.uint8), want[2].view(torch.uint8))
    assert got["seqused_k"].tolist() == want[3]


@pytest.mark.parametrize(
    "change, fused",
    [
        ({}, True),
        (dict(window_size=(-1, 0)), True),
        (dict(rotary=False), True),
        (dict(page_table=True), True),
        (dict(cache_batch_idx=True), False),
        (dict(leftpad_k=True), False),
        (dict(window_size=(4, 0)), False),
        (dict(attention_chunk=8), False),
        (dict(rotary_seqlens=True), False),
        (dict(fp8_tables=True), False),
        (dict(int_lengths=True), False),
        (dict(varlen_new=True), False),
        (dict(float32=True), False),
        (dict(new_rows=5), False),  # (more than FUSED_MAX_NEW_ROWS)
        (dict(unaligned=True), False),  # (TMA would read a copy, and the writes go there)
    ],
    ids=str,
)
def test_fusable_appends_leave_the_writes_to_the_attention(change, fused, monkeypatch):
    """On a GPU, an append the attention kernel can do itself (kv_append.fuses) launches
    nothing: the fields carry the new rows and tables, q unrotated, appended_keys the rows each
    sequence gains; any other form launches the append kernel."""
    from flash_cute import kv_append

    monkeypatch.setattr(kv_append, "_uses_kernel", lambda c: True)
    launched = []

    def launch(c, append, writes_lengths=True):
        launched.append(writes_lengths)
        return c.q, int32(9, 9) if writes_lengths else None

    monkeypatch.setattr(kv_append, "_launch", launch)
    gen = torch.Generator().manual_seed(17)
    dtype = torch.float32 if change.get("float32") else torch.bfloat16
    new = change.get("new_rows", 2)
    k_cache, v_cache, k, v, cos, sin = (t.to(dtype) for t in _small(gen, new=new))
    if change.get("unaligned"):  # (rows 20 elements apart: 40 bytes)
        k_cache, v_cache = (torch.cat((c, c[..., :4]), -1)[..., :16] for c in (k_cache, v_cache))
    if change.get("fp8_tables"):
        cos, sin = cos.to(torch.float8_e4m3fn), sin.to(torch.float8_e4m3fn)
    if change.get("rotary") is False:
        cos = sin = None
    lengths, q = int32(3, 5), torch.randn(2, new, 2, 16).to(dtype)
    fields = dict(q=q, k=k_cache, v=v_cache, seqused_k=lengths, causal=True)
    for name in ("window_size", "attention_chunk"):
        if name in change:
            fields[name] = change[name]
    if change.get("page_table"):  # (pages of 4 slots, in reverse order)
        fields["k"], fields["v"] = (c.reshape(8, 4, *c.shape[2:]) for c in (k_cache, v_cache))
        fields["page_table"] = torch.arange(7, -1, -1, dtype=torch.int32).view(2, 4)
    if change.get("cache_batch_idx"):
        fields["kv_batch_idx"] = int32(1, 0)
    if change.get("leftpad_k"):
        fields["leftpad_k"] = int32(1, 0)
    if change.get("int_lengths"):
        fields = dict(fields, seqused_k=None, kv_length=3)
    rotary_seqlens = int32(0, 1) if change.get("rotary_seqlens") else None
    append = KVAppend(k, v, cos, sin, rotary_seqlens=rotary_seqlens)
    if change.get("varlen_new"):
        append = KVAppend(k.flatten(0, 1), v.flatten(0, 1), cos, sin, int32(0, 2, 4))
    got = apply(append, fields)
    assert bool(launched) != fused
    if fused:
        assert got["append_k"] is k and got["append_v"] is v and got["q"] is q
        assert got["append_cos"] is cos and got["append_sin"] is sin
        assert got["seqused_k"] is lengths and got["appended_keys"] == new
        assert got["append_per_row"] == (cos is not None)  # (causal: q rows per position)
    else:
        assert got.get("append_k") is None


def test_a_fused_append_is_described_and_checked():
    """A Call carrying a fused append (kv_append's fields) describes as a fused_append problem
    with its rotation; rows of the wrong shape or a missing table are refused by name."""
    from flash_cute.call import Call
    from flash_cute.forward import describe

    gen = torch.Generator().manual_seed(18)
    k_cache, v_cache, k, v, cos, sin = (t.bfloat16() for t in _small(gen))
    q = torch.randn(2, 1, 2, 16).bfloat16()
    call = Call(
        q, k_cache, v_cache, seqused_k=int32(3, 5), appended_keys=2, append_k=k, append_v=v,
        append_cos=cos, append_sin=sin, append_per_row=True, causal=True,
    )  # fmt: skip
    problem = describe(call)
    assert problem.fused_append and problem.after_append
    assert (problem.rotary_dim, problem.rotary_per_row, problem.rotary_interleaved) == (
        16,
        True,
        False,
    )
    assert problem.rotary_dtype == "bfloat16"
    with pytest.raises(ValueError, match="append_k must be"):
        describe(call.replace(append_k=k[:, :1]))
    with pytest.raises(ValueError, match="append_cos and append_sin"):
        describe(call.replace(append_sin=None))
    with pytest.raises(ValueError, match="need append_k"):
        describe(call.replace(append_k=None))


def test_the_op_refuses_a_fused_append():
    """flash_cute::forward declares out its only mutated argument, so a Call carrying a fused
    append (which writes k and v) is refused by name rather than traced."""
    from flash_cute import ops
    from flash_cute.call import Call

    gen = torch.Generator().manual_seed(19)
    k_cache, v_cache, k, v, _, _ = (t.bfloat16() for t in _small(gen))
    call = Call(torch.randn(2, 1, 2, 16).bfloat16(), k_cache, v_cache, seqused_k=int32(3, 5),
                appended_keys=2, append_k=k, append_v=v)  # fmt: skip
    with pytest.raises(NotImplementedError, match="append_k"):
        ops.traced_forward(call)
