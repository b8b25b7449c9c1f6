"""flash_cute.flash_attn_interface on the CPU: FlashAttention-3's signatures, the arguments it
refuses by name, and how each call maps onto the native entry points (recorded, not run)."""

import inspect

import pytest
import torch

import flash_cute
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


@pytest.fixture
def natives(monkeypatch):
    """The Calls FlashAttention-3's functions hand the shared forward path (flash_cute.forward),
    after its argument checks (describe), not run."""
    from flash_cute import forward

    calls = []

    def run(call, names, plans, key):
        forward.describe(call, names)
        calls.append(call)
        return ("out", "lse") if call.return_lse else "out"

    monkeypatch.setattr(forward, "run", run)
    return calls


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
    call = natives[-1]
    assert call.q is q and call.softmax_scale == 0.3 and call.causal is True
    assert call.return_lse is True and call.window_size == (5, 0)
    assert call.softcap == 7.0 and call.learnable_sink is sink
    assert not call.decode_rows and call.pack_gqa is False  # the padded prefill kernels
    # Splits or packed GQA: those of a cache over the whole of k and v.
    fa3.flash_attn_func(q, k, v, num_splits=0, pack_gqa=True)
    call = natives[-1]
    assert call.k is k and call.seqused_k is None and call.kv_length is None
    assert call.num_splits == 0 and call.pack_gqa is True and call.decode_rows


@pytest.mark.parametrize("window", [[5, 0], torch.tensor([5, 0]), torch.tensor([5, 0]).int()])
def test_window_size_as_list_or_tensor(natives, window):
    """FlashAttention-3 indexes window_size, so lists and 2-element int tensors work there (its
    own tests pass tensors); each entry point hands the native API a tuple of ints."""
    q, k = tensors(2, 9, 8, 64), tensors(2, 17, 2, 64)
    fa3.flash_attn_func(q, k, k, window_size=window)
    fa3.flash_attn_with_kvcache(q, k, k, window_size=window)
    fa3.flash_attn_varlen_func(
        q[0], k[0], k[0], int32(0, 9), int32(0, 17), 9, 17, window_size=window
    )
    assert len(natives) == 3
    assert all(c.window_size == (5, 0) for c in natives)
    assert all(type(w) is int for c in natives for w in c.window_size)


def test_qkvpacked_splits_heads(natives):
    qkv = tensors(2, 9, 3, 4, 64)
    fa3.flash_attn_qkvpacked_func(qkv, causal=True)
    call = natives[-1]
    assert call.q.shape == (2, 9, 4, 64) and torch.equal(call.v, qkv[:, :, 2]) and call.causal
    gqa = tensors(2, 9, 8 + 2 * 2, 64)
    fa3.flash_attn_qkvpacked_func(gqa, num_heads_q=8)
    call = natives[-1]
    assert call.q.shape == (2, 9, 8, 64) and call.k.shape == (2, 9, 2, 64)
    assert torch.equal(call.k, gqa[:, :, 8:10])
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
    call = natives[-1]
    assert call.cu_seqlens_q is cu_q and call.cu_seqlens_k is cu_k
    assert call.seqused_q is used_q and call.seqused_k is used_k
    assert (call.max_seqlen_q, call.max_seqlen_k, call.num_splits) == (20, 25, 0)
    assert call.return_lse is True and call.page_table is None
    # Padded queries and keys (no cu_seqlens): a padded cache with seqused_k.
    qp, kp = tensors(2, 5, 8, 128), tensors(2, 33, 2, 128)
    fa3.flash_attn_varlen_func(qp, kp, kp, None, None, 5, 33, seqused_k=used_k)
    assert natives[-1].seqused_k is used_k and natives[-1].cu_seqlens_q is None
    with pytest.raises(NotImplementedError, match="packed queries"):
        fa3.flash_attn_varlen_func(qp, k, k, None, cu_k, 5, 33)


def test_kvcache_maps_to_native(natives):
    q, cache = tensors(3, 1, 8, 64), tensors(3, 256, 2, 64)
    lens, idx, pad = int32(5, 70, 0), int32(2, 0, 1), int32(1, 4, 0)
    fa3.flash_attn_with_kvcache(
        q, cache, cache, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad,
        causal=True, num_splits=3,
    )  # fmt: skip
    call = natives[-1]
    assert call.seqused_k is lens and call.kv_batch_idx is idx
    assert call.leftpad_k is pad and call.num_splits == 3 and call.causal is True
    # rotary_seqlens without rotary_cos changes nothing (FlashAttention-3's tests pass it).
    fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, rotary_seqlens=lens)
    assert natives[-1].seqused_k is lens
    # Packed queries over a (paged) cache, an int length for every sequence.
    pages, table = tensors(20, 16, 2, 64), torch.zeros(3, 4, dtype=torch.int32)
    qv = tensors(7, 8, 64)
    fa3.flash_attn_with_kvcache(
        qv, pages, pages, cache_seqlens=40, page_table=table, cu_seqlens_q=int32(0, 1, 3, 7),
        max_seqlen_q=4,
    )  # fmt: skip
    call = natives[-1]
    assert call.page_table is table and call.max_seqlen_q == 4
    assert call.kv_length == 40 and call.seqused_k is None and call.cu_seqlens_k is None
    fa3.flash_attn_with_kvcache(
        qv, pages, pages, cache_seqlens=lens, page_table=table, cu_seqlens_q=int32(0, 1, 3, 7),
        max_seqlen_q=4, cache_batch_idx=idx, cache_leftpad=pad,
    )  # fmt: skip
    call = natives[-1]
    assert call.kv_batch_idx is idx and call.leftpad_k is pad and call.cu_seqlens_q is not None
    with pytest.raises(ValueError, match="max_seqlen_q must be given with cu_seqlens_q"):
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
    assert natives[-1].qv is qv
    fa3.flash_attn_with_kvcache(q, k, v, qv=qv, cache_seqlens=5)
    assert natives[-1].qv is qv
    qv0 = qv[0]
    fa3.flash_attn_varlen_func(q[0], k[0], v[0], int32(0, 4), int32(0, 9), 4, 9, qv=qv0)
    assert natives[-1].qv is qv0


def test_kvcache_lse_returns_fa3_tuple(monkeypatch):
    from flash_cute import forward

    out, lse = tensors(1, 1, 8, 64), torch.zeros(1, 8, 1)
    monkeypatch.setattr(forward, "run", lambda *a: (out, lse))
    q, cache = tensors(1, 1, 8, 64), tensors(1, 16, 8, 64)
    result = fa3.flash_attn_with_kvcache(q, cache, cache, return_softmax_lse=True)
    assert len(result) == 4 and result[0] is out and result[1] is lse
    assert result[2].numel() == 0 and result[3].numel() == 0


def _q_k():
    return tensors(1, 4, 2, 64), tensors(1, 4, 2, 64)


def test_scheduler_metadata_fixes_split_count(natives, monkeypatch):
    monkeypatch.setattr(fa3, "num_sms", lambda index: 132)
    monkeypatch.setattr(fa3, "current_device", lambda: 0)
    lens = int32(*([100] * 2))
    meta = fa3.get_scheduler_metadata(2, 1, 65536, 32, 8, 128, lens, causal=True)
    assert meta.dtype == torch.int32 and meta.shape == (1,)
    splits = int(meta[0])
    assert splits > 1 and meta.flash_cute_num_splits == splits  # a long cache, batch 2: split
    assert int(fa3.get_scheduler_metadata(2, 1, 65536, 32, 8, 128, lens, num_splits=5)[0]) == 5
    # sm_margin: the heuristic shares out the SMs left (fewer: fewer splits fill them).
    fewer = fa3.get_scheduler_metadata(2, 1, 65536, 32, 8, 128, lens, causal=True, sm_margin=100)
    assert 1 <= int(fewer[0]) < splits
    with pytest.raises(ValueError, match="sm_margin"):
        fa3.get_scheduler_metadata(2, 1, 65536, 32, 8, 128, lens, sm_margin=132)
    q, cache = tensors(2, 1, 32, 128), tensors(2, 64, 8, 128)
    fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, scheduler_metadata=meta)
    assert natives[-1].num_splits == splits
    # The call's own num_splits wins; a copy (an engine's buffer: no host count) is read.
    fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata=meta, num_splits=2)
    assert natives[-1].num_splits == 2
    buffer = torch.zeros(4, dtype=torch.int32)
    buffer[:1] = meta
    fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata=buffer[:1])
    assert natives[-1].num_splits == splits
    with pytest.raises(TypeError, match="scheduler_metadata must be an int32 tensor"):
        fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata=meta.float())


def test_fp8_queries_are_served(natives):
    """FP8 q (as SGLang calls FlashAttention-3: float8_e4m3fn q, k_cache, v_cache, descales
    left at None; or with FlashAttention-3's FP8 descales) reaches the shared path in every
    function, descales included."""
    q8 = tensors(2, 1, 8, 64).to(torch.float8_e4m3fn)
    k8 = tensors(2, 64, 2, 64).to(torch.float8_e4m3fn)
    d = torch.rand(2, 2)
    for call in (
        lambda: fa3.flash_attn_with_kvcache(q8, k8, k8, cache_seqlens=int32(5, 9)),
        lambda: fa3.flash_attn_with_kvcache(q8, k8, k8, q_descale=d, k_descale=d, v_descale=d),
        lambda: fa3.flash_attn_func(q8, k8, k8, q_descale=d, k_descale=d, v_descale=d),
        lambda: fa3.flash_attn_qkvpacked_func(
            torch.stack([q8, q8, q8], 2), q_descale=torch.rand(2, 8)
        ),
        lambda: fa3.flash_attn_varlen_func(
            q8[:, 0], k8[0], k8[0], int32(0, 1, 2), int32(0, 30, 64), 1, 34, q_descale=d
        ),
    ):
        call()
        assert natives[-1].q.dtype == torch.float8_e4m3fn


def test_descales_of_16bit_operands_are_ignored(natives):
    """FlashAttention-3 reads descales only with FP8 operands (vLLM passes all three on every
    call, bf16 models included): q_descale drops with 16-bit q, k_descale and v_descale with a
    16-bit cache; with an FP8 cache and 16-bit q (a flash_cute extension) those two are read."""
    q, k = _q_k()
    d = torch.ones(1, 2)
    fa3.flash_attn_func(q, k, k, q_descale=d, k_descale=d, v_descale=d)
    fa3.flash_attn_varlen_func(
        q[0], k[0], k[0], int32(0, 4), int32(0, 4), 4, 4, q_descale=d, k_descale=d, v_descale=d
    )
    fa3.flash_attn_with_kvcache(q, k, k, q_descale=d, k_descale=d, v_descale=d)
    fa3.flash_attn_qkvpacked_func(torch.stack([q, k, k], 2), k_descale=d)
    for call in natives:
        assert call.q_descale is call.k_descale is call.v_descale is None
    k8 = k.to(torch.float8_e4m3fn)
    fa3.flash_attn_with_kvcache(q, k8, k8, q_descale=d, k_descale=d, v_descale=d)
    assert natives[-1].q_descale is None
    assert natives[-1].k_descale is d and natives[-1].v_descale is d


def test_native_functions_refuse_descales_of_16bit_operands(natives):
    q, k = _q_k()
    for name in ("q_descale", "k_descale", "v_descale"):
        with pytest.raises(ValueError, match=f"{name} dequantizes FP8"):
            flash_cute.flash_attn_func(q, k, k, **{name: torch.ones(1, 2)})


@pytest.mark.parametrize(
    "sizes, message",
    [((32, 8, 40), "head_dim must be a multiple of 16"), ((6, 4, 128), "multiple of nheads")],
)
def test_scheduler_metadata_checks_head_dims_and_gqa(sizes, message):
    """Described calls are checked as run calls are: a head dim or head ratio no kernel
    serves is named, not met as a plan error."""
    nheads, nheads_kv, head_dim = sizes
    with pytest.raises(ValueError, match=message):
        fa3.get_scheduler_metadata(2, 1, 4096, nheads, nheads_kv, head_dim, int32(100, 200))
