"""flash_cute.flash_attn_interface on the CPU: FlashAttention-3's signatures, the arguments it
refuses by name, and how each call maps onto the native entry points (recorded, not run)."""

import inspect

import pytest
import torch

from flash_cute import flash_attn_interface as fa3

# FlashAttention-3's public functions (Dao-AILab/flash-attention hopper/flash_attn_interface.py):
# parameter names in order, with defaults.
_SCALE_MASK = [
    ("window_size", (-1, -1)),
    ("attention_chunk", 0),
    ("softcap", 0.0),
]
_DESCALES = [("q_descale", None), ("k_descale", None), ("v_descale", None)]
FA3_SIGNATURES = {
    "flash_attn_func": [
        ("q", inspect.Parameter.empty),
        ("k", inspect.Parameter.empty),
        ("v", inspect.Parameter.empty),
        ("softmax_scale", None),
        ("causal", False),
        ("qv", None),
        *_DESCALES,
        *_SCALE_MASK,
        ("num_splits", 1),
        ("pack_gqa", None),
        ("deterministic", False),
        ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "flash_attn_qkvpacked_func": [
        ("qkv", inspect.Parameter.empty),
        ("softmax_scale", None),
        ("causal", False),
        *_DESCALES,
        *_SCALE_MASK,
        ("deterministic", False),
        ("num_heads_q", None),
        ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", inspect.Parameter.empty),
        ("k", inspect.Parameter.empty),
        ("v", inspect.Parameter.empty),
        ("cu_seqlens_q", inspect.Parameter.empty),
        ("cu_seqlens_k", inspect.Parameter.empty),
        ("max_seqlen_q", inspect.Parameter.empty),
        ("max_seqlen_k", inspect.Parameter.empty),
        ("seqused_q", None),
        ("seqused_k", None),
        ("softmax_scale", None),
        ("causal", False),
        ("qv", None),
        *_DESCALES,
        *_SCALE_MASK,
        ("num_splits", 1),
        ("pack_gqa", None),
        ("deterministic", False),
        ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "flash_attn_combine": [
        ("out_partial", inspect.Parameter.empty),
        ("lse_partial", inspect.Parameter.empty),
        ("out", None),
        ("out_dtype", None),
    ],
    "flash_attn_with_kvcache": [
        ("q", inspect.Parameter.empty),
        ("k_cache", inspect.Parameter.empty),
        ("v_cache", inspect.Parameter.empty),
        ("k", None),
        ("v", None),
        ("qv", None),
        ("rotary_cos", None),
        ("rotary_sin", None),
        ("cache_seqlens", None),
        ("cache_batch_idx", None),
        ("cache_leftpad", None),
        ("page_table", None),
        ("cu_seqlens_q", None),
        ("cu_seqlens_k_new", None),
        ("max_seqlen_q", None),
        ("rotary_seqlens", None),
        *_DESCALES,
        ("softmax_scale", None),
        ("causal", False),
        *_SCALE_MASK,
        ("rotary_interleaved", True),
        ("scheduler_metadata", None),
        ("num_splits", 0),
        ("pack_gqa", None),
        ("sm_margin", 0),
        ("return_softmax_lse", False),
    ],
    "get_scheduler_metadata": [
        ("batch_size", inspect.Parameter.empty),
        ("max_seqlen_q", inspect.Parameter.empty),
        ("max_seqlen_k", inspect.Parameter.empty),
        ("num_heads_q", inspect.Parameter.empty),
        ("num_heads_kv", inspect.Parameter.empty),
        ("headdim", inspect.Parameter.empty),
        ("cache_seqlens", inspect.Parameter.empty),
        ("qkv_dtype", torch.bfloat16),
        ("headdim_v", None),
        ("cu_seqlens_q", None),
        ("cu_seqlens_k_new", None),
        ("cache_leftpad", None),
        ("page_size", None),
        ("max_seqlen_k_new", 0),
        ("causal", False),
        *_SCALE_MASK[:2],
        ("has_softcap", False),
        ("num_splits", 0),
        ("pack_gqa", None),
        ("sm_margin", 0),
    ],
}


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_signatures_match_fa3(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    positional = [(p.name, p.default) for p in params if p.kind != p.KEYWORD_ONLY]
    assert positional == FA3_SIGNATURES[name]
    # Extensions are keyword-only, so FlashAttention-3's positional calls keep their meaning.
    extra = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert extra in ([], ["learnable_sink"])


class Recorder:
    """Stands in for a native entry point: records its arguments by name."""

    def __init__(self, native):
        self.signature = inspect.signature(native)
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append(self.signature.bind(*args, **kwargs).arguments)
        return "out"


@pytest.fixture
def natives(monkeypatch):
    from flash_cute import interface

    recorders = {
        "func": Recorder(interface.flash_attn_func),
        "varlen": Recorder(interface.flash_attn_varlen_func),
        "kvcache": Recorder(interface.flash_attn_with_kvcache),
    }
    monkeypatch.setattr(fa3, "_native_func", recorders["func"])
    monkeypatch.setattr(fa3, "_native_varlen", recorders["varlen"])
    monkeypatch.setattr(fa3, "_native_kvcache", recorders["kvcache"])
    return recorders


def tensors(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_func_maps_to_native(natives):
    q, k, v = tensors(2, 9, 8, 64), tensors(2, 17, 2, 64), tensors(2, 17, 2, 64)
    sink = torch.zeros(8)
    fa3.flash_attn_func(
        q, k, v, 0.3, True, window_size=(5, 0), softcap=7.0, return_attn_probs=True,
        learnable_sink=sink,
    )  # fmt: skip
    call = natives["func"].calls[-1]
    assert call["q"] is q and call["softmax_scale"] == 0.3 and call["causal"] is True
    assert call["return_lse"] is True and call["window_size"] == (5, 0)
    assert call["softcap"] == 7.0 and call["learnable_sink"] is sink
    # Splits or packed GQA: the cache entry point over the whole (padded) cache.
    fa3.flash_attn_func(q, k, v, num_splits=0, pack_gqa=True)
    call = natives["kvcache"].calls[-1]
    assert call["k_cache"] is k and call["cache_seqlens"] is None
    assert call["num_splits"] == 0 and call["pack_gqa"] is True


@pytest.mark.parametrize("window", [[5, 0], torch.tensor([5, 0]), torch.tensor([5, 0]).int()])
def test_window_size_as_list_or_tensor(natives, window):
    """FlashAttention-3 indexes window_size, so lists and 2-element int tensors work there (its
    own tests pass tensors); each entry point hands the native API a tuple of ints."""
    q, k = tensors(2, 9, 8, 64), tensors(2, 17, 2, 64)
    fa3.flash_attn_func(q, k, k, window_size=window)
    assert natives["func"].calls[-1]["window_size"] == (5, 0)
    fa3.flash_attn_with_kvcache(q, k, k, window_size=window)
    assert natives["kvcache"].calls[-1]["window_size"] == (5, 0)
    fa3.flash_attn_varlen_func(
        q[0], k[0], k[0], int32(0, 9), int32(0, 17), 9, 17, window_size=window
    )
    assert natives["varlen"].calls[-1]["window_size"] == (5, 0)
    assert all(type(w) is int for w in natives["varlen"].calls[-1]["window_size"])


def test_qkvpacked_splits_heads(natives):
    qkv = tensors(2, 9, 3, 4, 64)
    fa3.flash_attn_qkvpacked_func(qkv, causal=True)
    call = natives["func"].calls[-1]
    assert call["q"].shape == (2, 9, 4, 64) and torch.equal(call["v"], qkv[:, :, 2])
    gqa = tensors(2, 9, 8 + 2 * 2, 64)
    fa3.flash_attn_qkvpacked_func(gqa, num_heads_q=8)
    call = natives["func"].calls[-1]
    assert call["q"].shape == (2, 9, 8, 64) and call["k"].shape == (2, 9, 2, 64)
    assert torch.equal(call["k"], gqa[:, :, 8:10])
    with pytest.raises(ValueError, match="needs num_heads_q"):
        fa3.flash_attn_qkvpacked_func(gqa)
    with pytest.raises(ValueError, match="not num_heads_q=7"):
        fa3.flash_attn_qkvpacked_func(gqa, num_heads_q=7)


def test_varlen_maps_to_native(natives):
    q, k = tensors(30, 8, 128), tensors(40, 2, 128)
    cu_q, cu_k, used_q, used_k = int32(0, 10, 30), int32(0, 15, 40), int32(9, 20), int32(3, 25)
    fa3.flash_attn_varlen_func(
        q, k, k, cu_q, cu_k, 20, 25, used_q, used_k, causal=True, num_splits=0,
        return_attn_probs=True,
    )  # fmt: skip
    call = natives["varlen"].calls[-1]
    assert call["cu_seqlens_q"] is cu_q and call["cu_seqlens_k"] is cu_k
    assert call["seqused_q"] is used_q and call["seqused_k"] is used_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["num_splits"]) == (20, 25, 0)
    assert call["return_softmax_lse"] is True and call["page_table"] is None
    # Padded queries and keys (no cu_seqlens): the cache entry point with seqused_k.
    qp, kp = tensors(2, 5, 8, 128), tensors(2, 33, 2, 128)
    fa3.flash_attn_varlen_func(qp, kp, kp, None, None, 5, 33, seqused_k=used_k)
    assert natives["kvcache"].calls[-1]["cache_seqlens"] is used_k
    with pytest.raises(NotImplementedError, match="packed queries"):
        fa3.flash_attn_varlen_func(qp, k, k, None, cu_k, 5, 33)


def test_kvcache_maps_to_native(natives):
    q, cache = tensors(3, 1, 8, 64), tensors(3, 256, 2, 64)
    lens, idx, pad = int32(5, 70, 0), int32(2, 0, 1), int32(1, 4, 0)
    fa3.flash_attn_with_kvcache(
        q, cache, cache, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad,
        causal=True, num_splits=3,
    )  # fmt: skip
    call = natives["kvcache"].calls[-1]
    assert call["cache_seqlens"] is lens and call["cache_batch_idx"] is idx
    assert call["cache_leftpad"] is pad and call["num_splits"] == 3 and call["causal"] is True
    # rotary_seqlens without rotary_cos changes nothing (FlashAttention-3's tests pass it).
    fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, rotary_seqlens=lens)
    assert natives["kvcache"].calls[-1]["cache_seqlens"] is lens
    # Packed queries over a (paged) cache: the varlen entry point, an int length made a tensor.
    pages, table = tensors(20, 16, 2, 64), torch.zeros(3, 4, dtype=torch.int32)
    qv = tensors(7, 8, 64)
    fa3.flash_attn_with_kvcache(
        qv, pages, pages, cache_seqlens=40, page_table=table, cu_seqlens_q=int32(0, 1, 3, 7),
        max_seqlen_q=4,
    )  # fmt: skip
    call = natives["varlen"].calls[-1]
    assert call["page_table"] is table and call["max_seqlen_q"] == 4
    assert call["seqused_k"].tolist() == [40, 40, 40] and call["cu_seqlens_k"] is None
    fa3.flash_attn_with_kvcache(
        qv, pages, pages, cache_seqlens=lens, page_table=table, cu_seqlens_q=int32(0, 1, 3, 7),
        max_seqlen_q=4, cache_batch_idx=idx, cache_leftpad=pad,
    )  # fmt: skip
    call = natives["varlen"].calls[-1]
    assert call["cache_batch_idx"] is idx and call["cache_leftpad"] is pad
    with pytest.raises(ValueError, match="max_seqlen_q must be given"):
        fa3.flash_attn_with_kvcache(qv, pages, pages, page_table=table, cu_seqlens_q=int32(0, 7))


def test_qv_passes_through(natives):
    """FlashAttention-3's absorbed-MLA qv reaches every native entry point (which serve it with
    the wide heads)."""
    q, k, v, qv = (
        tensors(1, 4, 8, 64),
        tensors(1, 9, 1, 64),
        tensors(1, 9, 1, 512),
        tensors(1, 4, 8, 512),
    )
    fa3.flash_attn_func(q, k, v, qv=qv)
    assert natives["func"].calls[-1]["qv"] is qv
    fa3.flash_attn_with_kvcache(q, k, v, qv=qv, cache_seqlens=5)
    assert natives["kvcache"].calls[-1]["qv"] is qv
    qv0 = qv[0]
    fa3.flash_attn_varlen_func(q[0], k[0], v[0], int32(0, 4), int32(0, 9), 4, 9, qv=qv0)
    assert natives["varlen"].calls[-1]["qv"] is qv0


def test_kvcache_lse_returns_fa3_tuple(monkeypatch):
    out, lse = tensors(1, 1, 8, 64), torch.zeros(1, 8, 1)
    monkeypatch.setattr(fa3, "_native_kvcache", lambda *a, **k: (out, lse))
    q, cache = tensors(1, 1, 8, 64), tensors(1, 16, 8, 64)
    result = fa3.flash_attn_with_kvcache(q, cache, cache, return_softmax_lse=True)
    assert len(result) == 4 and result[0] is out and result[1] is lse
    assert result[2].numel() == 0 and result[3].numel() == 0


def _q_k():
    return tensors(1, 4, 2, 64), tensors(1, 4, 2, 64)


@pytest.mark.parametrize(
    "call, names",
    [
        (
            lambda q, k: fa3.flash_attn_func(q, k, k, q_descale=1, v_descale=1),
            ["q_descale", "v_descale"],
        ),
        (lambda q, k: fa3.flash_attn_func(q, k, k, sm_margin=4), ["sm_margin"]),
        (
            lambda q, k: fa3.flash_attn_qkvpacked_func(torch.stack([q, k, k], 2), k_descale=1),
            ["k_descale"],
        ),  # noqa: E501
        (lambda q, k: fa3.flash_attn_with_kvcache(q, k, k, k=k, v=k), ["k", "v"]),
        (
            lambda q, k: fa3.flash_attn_with_kvcache(q, k, k, rotary_cos=q, rotary_sin=q),
            ["rotary_cos", "rotary_sin"],
        ),
        (
            lambda q, k: fa3.flash_attn_with_kvcache(q, k, k, cu_seqlens_k_new=int32(0, 1)),
            ["cu_seqlens_k_new"],
        ),  # noqa: E501
        (lambda q, k: fa3.flash_attn_with_kvcache(q, k, k, q_descale=1), ["q_descale"]),
        (lambda q, k: fa3.flash_attn_with_kvcache(q, k, k, sm_margin=2), ["sm_margin"]),
    ],
)
def test_unserved_arguments_raise_by_name(natives, call, names):
    with pytest.raises(NotImplementedError) as err:
        call(*_q_k())
    for name in names:
        assert name in str(err.value)
    assert not any(r.calls for r in natives.values())


def test_scheduler_metadata_fixes_split_count(natives, monkeypatch):
    monkeypatch.setattr(fa3, "num_sms", lambda index: 132)
    monkeypatch.setattr(fa3, "current_device", lambda: 0)
    lens = int32(*([100] * 2))
    meta = fa3.get_scheduler_metadata(2, 1, 65536, 32, 8, 128, lens, causal=True)
    assert meta.dtype == torch.int32 and meta.shape == (1,)
    splits = int(meta[0])
    assert splits > 1 and meta.flash_cute_num_splits == splits  # a long cache, batch 2: split
    assert int(fa3.get_scheduler_metadata(2, 1, 65536, 32, 8, 128, lens, num_splits=5)[0]) == 5
    q, cache = tensors(2, 1, 32, 128), tensors(2, 64, 8, 128)
    fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, scheduler_metadata=meta)
    assert natives["kvcache"].calls[-1]["num_splits"] == splits
    # The call's own num_splits wins; a copied buffer (no host count) leaves the heuristic.
    fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata=meta, num_splits=2)
    assert natives["kvcache"].calls[-1]["num_splits"] == 2
    fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata=meta.clone())
    assert natives["kvcache"].calls[-1]["num_splits"] == 0
    with pytest.raises(TypeError, match="scheduler_metadata must be an int32 tensor"):
        fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata=meta.float())
