"""Argument checks of the public API (CPU: every check here runs before a GPU is needed)."""

import pytest
import torch

import flash_cute
from flash_cute import AttentionConfig, checks


def qkv(b=2, sq=8, sk=8, h=4, hk=2, d=64, dtype=torch.bfloat16):
    return (
        torch.randn(b, sq, h, d, dtype=dtype),
        torch.randn(b, sk, hk, d, dtype=dtype),
        torch.randn(b, sk, hk, d, dtype=dtype),
    )


@pytest.mark.parametrize(
    "mutate, exc, message",
    [
        (lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
        (lambda q, k, v: (q, k[0], v), ValueError, "k must have 4 dimensions"),
        (
            lambda q, k, v: (q.float(), k, v),
            TypeError,
            "q must be float16, bfloat16 or float8_e4m3fn",
        ),
        (lambda q, k, v: (q, k.half(), v), TypeError, "k must have the same dtype as q"),
        (lambda q, k, v: (q, k, v.half()), TypeError, "v must have the same dtype as q"),
        (lambda q, k, v: (q.transpose(1, 3), k, v), ValueError, "contiguous last dimension"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch size 2"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "v must have the shape of k"),
        (
            lambda q, k, v: (q[..., :40], k[..., :40], v[..., :40]),
            ValueError,
            "head_dim must be a multiple of 16",
        ),
        (lambda q, k, v: (q, k, v[..., :40]), ValueError, r"head_dim_v \(v's head dim\) must be"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "k must have headdim 64"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of nheads of k"),
        (lambda q, k, v: (q, k, v), ValueError, "q must be a CUDA tensor"),
    ],
)
def test_bad_inputs(mutate, exc, message):
    q, k, v = mutate(*qkv())
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_func(q, k, v)


def test_bad_flags():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_cute.flash_attn_func(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_cute.flash_attn_func(q, k, v, return_lse=None)
    with pytest.raises(TypeError, match="config must be"):
        flash_cute.flash_attn_func(q, k, v, config=(128, 128))


@pytest.mark.parametrize(
    "scale, exc",
    [
        ("0.1", TypeError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        (-0.125, ValueError),
    ],
)
def test_bad_softmax_scale(scale, exc):
    with pytest.raises(exc, match="softmax_scale"):
        checks.softmax_scale_log2(scale, 64)


def test_softmax_scale_default():
    import math

    assert checks.softmax_scale_log2(None, 64) == pytest.approx(math.log2(math.e) / 8)


def test_bad_config():
    with pytest.raises(TypeError, match="config must be a flash_cute.AttentionConfig"):
        checks.check_config({"tile_m": 128}, 128, "bfloat16")
    with pytest.raises(ValueError, match="shared memory"):
        checks.check_config(AttentionConfig(128, 128), 256, "bfloat16")
    assert checks.check_config(None, 128, "bfloat16") is None


def test_out_checks():
    q, k, v = qkv()
    shape = tuple(q.shape)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        checks.output_for([1], q, k, v)
    with pytest.raises(ValueError, match="out must have shape"):
        checks.output_for(torch.empty(1, 2, 3, 4, dtype=q.dtype), q, k, v)
    with pytest.raises(TypeError, match="out must have dtype"):
        checks.output_for(torch.empty(shape, dtype=torch.float16), q, k, v)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        checks.output_for(torch.empty(shape[::-1], dtype=q.dtype).permute(3, 2, 1, 0), q, k, v)
    with pytest.raises(ValueError, match="broadcast"):
        checks.output_for(torch.empty(1, 1, 1, 64, dtype=q.dtype).expand(shape), q, k, v)
    with pytest.raises(ValueError, match="overlap q"):
        checks.output_for(q, q, k, v)
    given = torch.empty(shape, dtype=q.dtype)
    assert checks.output_for(given, q, k, v) is given
    made = checks.output_for(None, q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    assert made.shape == q.shape and made.is_contiguous()


def test_devices_must_match():
    from types import SimpleNamespace

    gpu0 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    gpu1 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
    checks.check_cuda((("q", gpu0), ("k", gpu0)))
    with pytest.raises(ValueError, match="k must be on q's device"):
        checks.check_cuda((("q", gpu0), ("k", gpu1)))


def test_non_hopper_gpu_is_refused(monkeypatch):
    checks._capability_ok.clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match="compute capability 8.0"):
        checks.check_hopper(torch.device("cuda", 0))
    checks._capability_ok.clear()


def test_grid_limits():
    with pytest.raises(ValueError, match="nheads must be at most"):
        checks.check_grid(70000, 1)
    with pytest.raises(ValueError, match="batch size must be at most"):
        checks.check_grid(8, 70000)


def test_tma_layout_fixups():
    t = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    assert checks.for_tma(t) is t
    odd = t.as_strided((2, 1, 4, 64), (256, 3, 64, 1))  # size-1 dim with an odd stride
    fixed = checks.for_tma(odd)
    assert fixed.data_ptr() == odd.data_ptr() and fixed.stride()[1] % 8 == 0
    assert torch.equal(fixed, odd)
    sliced = torch.randn(2, 5, 4, 65, dtype=torch.bfloat16)[..., :64]  # head stride 65: not 16-byte
    copied = checks.for_tma(sliced)
    assert copied.is_contiguous() and torch.equal(copied, sliced)


# ---- varlen, KV cache and combine entry points ----


def varlen_args(total_q=10, batch=3, h=4, hk=2, d=64):
    q = torch.randn(total_q, h, d, dtype=torch.bfloat16)
    k = torch.randn(20, hk, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 7, total_q], dtype=torch.int32)
    return q, k, k.clone(), cu


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 10])), TypeError, "cu_seqlens_q must be int32"),
        (
            dict(cu_seqlens_q=torch.zeros(2, 2, dtype=torch.int32)),
            ValueError,
            "cu_seqlens_q must have shape",
        ),
        (dict(max_seqlen_q=torch.tensor(5)), TypeError, "max_seqlen_q must be a Python int"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
        (
            dict(seqused_q=torch.tensor([5, 4], dtype=torch.int32)),
            ValueError,
            r"seqused_q must have shape \(3,\) \(queries used per sequence\)",
        ),
        (dict(seqused_q=torch.tensor([5, 4, 1])), TypeError, "seqused_q must be int32"),
        (
            dict(cu_seqlens_k=torch.tensor([0, 5, 20], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_k must have shape \(4,\)",
        ),
        (dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
        (dict(num_splits=129), ValueError, "num_splits must be at most 128"),
        (dict(pack_gqa="yes"), TypeError, "pack_gqa must be a bool"),
        (dict(config=(128, 128)), TypeError, "config must be a flash_cute.AttentionConfig"),
        (dict(config=AttentionConfig(128, 256)), ValueError, "accumulators need"),
        (dict(), ValueError, "q must be a CUDA tensor"),
    ],
)
def test_varlen_bad_inputs(kwargs, exc, message):
    q, k, v, cu = varlen_args()
    args = dict(
        cu_seqlens_q=cu, max_seqlen_q=4, cu_seqlens_k=torch.tensor([0, 5, 9, 20], dtype=torch.int32)
    )
    args.update(kwargs)
    if "seqused_k" in kwargs and "cu_seqlens_k" not in kwargs:
        args.pop("cu_seqlens_k")
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_varlen_func(q, k, v, **args)


def test_varlen_paged_rules():
    q, _, _, cu = varlen_args()
    cache = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_table cannot be combined with cu_seqlens_k"):
        flash_cute.flash_attn_varlen_func(q, cache, cache, cu, 4, cu_seqlens_k=cu, page_table=table)
    with pytest.raises(ValueError, match="k must have 3 dimensions"):
        flash_cute.flash_attn_varlen_func(q, cache, cache, cu, 4, cu_seqlens_k=cu)


def kvcache_args(batch=2, h=8, hk=2, d=128, page_size=16, pages=4):
    q = torch.randn(batch, 1, h, d, dtype=torch.bfloat16)
    cache = torch.randn(batch * pages, page_size, hk, d, dtype=torch.bfloat16)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    return q, cache, cache.clone(), table


@pytest.mark.parametrize(
    "mutate, exc, message",
    [
        (lambda q, k, v, t: dict(page_table=t.long()), TypeError, "page_table must be int32"),
        (
            lambda q, k, v, t: dict(page_table=t[:1]),
            ValueError,
            r"page_table must have shape \(batch=2",
        ),
        (
            lambda q, k, v, t: dict(k_cache=k[:, :0], v_cache=v[:, :0]),
            ValueError,
            "page size .* must be positive",
        ),
        (
            lambda q, k, v, t: dict(cache_seqlens=65),
            ValueError,
            "exceeds the cache's capacity of 64",
        ),
        (
            lambda q, k, v, t: dict(cache_seqlens=torch.tensor([3, 4])),
            TypeError,
            "cache_seqlens must be int32",
        ),
        (
            lambda q, k, v, t: dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)),
            ValueError,
            r"cache_seqlens must have shape \(2,\)",
        ),
        (
            lambda q, k, v, t: dict(cache_seqlens=3.0),
            TypeError,
            "cache_seqlens must be a Python int",
        ),
        (
            lambda q, k, v, t: dict(v_cache=v[:, :, :1]),
            ValueError,
            "v_cache must have the shape of k_cache",
        ),
        (lambda q, k, v, t: dict(num_splits=1.5), TypeError, "num_splits must be a Python int"),
        (
            lambda q, k, v, t: dict(config="64x128"),
            TypeError,
            "config must be a flash_cute.AttentionConfig",
        ),
        (
            lambda q, k, v, t: dict(config=AttentionConfig(192, 256)),
            ValueError,
            "invalid AttentionConfig",
        ),
        (lambda q, k, v, t: dict(), ValueError, "q must be a CUDA tensor"),
    ],
)
def test_kvcache_bad_inputs(mutate, exc, message):
    q, k, v, t = kvcache_args()
    args = dict(
        k_cache=k, v_cache=v, page_table=t, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32)
    )
    args.update(mutate(q, k, v, t))
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_with_kvcache(q, **args)


def test_kvcache_contiguous_batch_mismatch():
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    cache = torch.randn(3, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache must have batch size 2"):
        flash_cute.flash_attn_with_kvcache(q, cache, cache)


@pytest.mark.parametrize(
    "out_p, lse_p, kwargs, exc, message",
    [
        (
            torch.randn(2, 3, 4, 64).half(),
            torch.randn(2, 3, 4),
            {},
            TypeError,
            "out_partial must be float32",
        ),
        (
            torch.randn(2, 3, 4, 64),
            torch.randn(2, 3, 4).double(),
            {},
            TypeError,
            "lse_partial must be float32",
        ),
        (
            torch.randn(2, 3, 4, 64),
            torch.randn(2, 3, 5),
            {},
            ValueError,
            "lse_partial must have shape",
        ),
        (torch.randn(2, 3, 64), torch.randn(2, 3), {}, ValueError, "out_partial must be"),
        (torch.randn(2, 3, 4, 12), torch.randn(2, 3, 4), {}, ValueError, "multiple of 8"),
        (
            torch.randn(2, 3, 4, 64),
            torch.randn(2, 3, 4),
            dict(out_dtype=torch.int8),
            TypeError,
            "out_dtype",
        ),
        (
            torch.randn(2, 3, 4, 64),
            torch.randn(2, 3, 4),
            {},
            ValueError,
            "out_partial must be a CUDA tensor",
        ),
    ],
)
def test_combine_bad_inputs(out_p, lse_p, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_combine(out_p, lse_p, **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(window_size=5), TypeError, r"window_size must be a \(left, right\) pair of ints"),
        (dict(window_size=(1.5, 0)), TypeError, "window_size must be a"),
        (dict(window_size=(4, 0, 1)), TypeError, "window_size must be a"),
        (dict(window_size=(-2, 0)), ValueError, r"window_size sides must be -1 .* got \(-2, 0\)"),
        (dict(window_size=(0, -5)), ValueError, "window_size sides must be -1"),
        (dict(attention_chunk=-1), ValueError, "attention_chunk must be >= 0"),
        (dict(attention_chunk=64.0), TypeError, "attention_chunk must be a Python int"),
        (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
        (dict(softcap="30"), TypeError, "softcap must be a float"),
        (dict(learnable_sink=[0.0] * 4), TypeError, "learnable_sink must be a torch.Tensor"),
        (
            dict(learnable_sink=torch.zeros(4, dtype=torch.float64)),
            TypeError,
            "learnable_sink must be float32, bfloat16 or float16",
        ),
        (dict(learnable_sink=torch.zeros(2)), ValueError, r"learnable_sink must have shape \(4,\)"),
        (dict(learnable_sink=torch.zeros(1, 4)), ValueError, "learnable_sink must have shape"),
        (
            dict(learnable_sink=torch.zeros(8)[::2]),
            ValueError,
            "learnable_sink must be contiguous",
        ),
    ],
)
def test_bad_mask_options(kwargs, exc, message):
    """Windows, chunks, softcap and sinks are checked in every entry point before the GPU."""
    q, k, v = qkv()  # 4 q heads
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_func(q, k, v, **kwargs)
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_with_kvcache(q, k, v, **kwargs)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(exc, match=message):
        flash_cute.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, 8, cu_seqlens_k=cu, **kwargs
        )


def test_good_mask_options_reach_the_device_check():
    q, k, v = qkv()
    for kwargs in (
        dict(window_size=(-1, -1)),
        dict(window_size=[0, 0]),
        dict(window_size=(128, -1), attention_chunk=64, softcap=0),
        dict(softcap=30, learnable_sink=torch.zeros(4, dtype=torch.bfloat16)),
    ):
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            flash_cute.flash_attn_func(q, k, v, causal=True, **kwargs)


def test_sink_must_be_on_q_device():
    from types import SimpleNamespace

    gpu0 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    cpu = SimpleNamespace(is_cuda=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="learnable_sink must be on q's device"):
        checks.check_cuda((("q", gpu0), ("learnable_sink", cpu)))


def test_v_in_k_is_a_view_of_k_leading_columns():
    from flash_cute.forward import _v_in_k

    cache = torch.randn(4, 16, 1, 576, dtype=torch.bfloat16)
    assert _v_in_k(cache, cache[..., :512])
    assert not _v_in_k(cache, cache[..., :512].clone())
    assert not _v_in_k(cache, cache[..., 64:])  # V must be K's leading columns
    assert not _v_in_k(cache[..., :256], cache[..., :128])  # served pairs load V themselves


@pytest.mark.parametrize(
    "d, dv, error, match",
    [
        (64, 64, ValueError, "qv takes q's head dim <= 64 and v's >= 256, got 64 and 64"),
        (96, 512, ValueError, "qv takes q's head dim <= 64 and v's >= 256, got 96 and 512"),
        (32, 512, NotImplementedError, r"q's head dim one of \(64,\).* got 32 \+ 512"),
        (64, 320, NotImplementedError, r"v's one of \(256, 384, 512\).* got 64 \+ 320"),
    ],
)
def test_qv_head_dims_are_fa3s_and_the_unserved_ones_named(d, dv, error, match):
    """FlashAttention-3 takes qv with q's head dim <= 64 and v's 256-512: others are a
    ValueError; those flash_cute does not serve (q's not 64, v's halves not whole 64-column
    atoms) a NotImplementedError naming the pair."""
    q, k = (torch.randn(1, 4, 8, d, dtype=torch.bfloat16) for _ in range(2))
    v, qv = (torch.randn(1, 4, 8, dv, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(error, match=match):
        flash_cute.flash_attn_func(q, k, v, qv=qv)


def test_the_qv_pairs_are_not_latent_cache_widths():
    """q 448 over a latent cache with v = k[..., :384] (the qv pair 64 + 384's widths without
    qv) is refused: no GPU test covers that form."""
    cache = torch.randn(1, 16, 1, 448, dtype=torch.bfloat16)
    q = torch.randn(1, 1, 8, 448, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 up to 256"):
        flash_cute.flash_attn_with_kvcache(q, cache, cache[..., :384], cache_seqlens=16)
