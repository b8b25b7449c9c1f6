"""FP8 (float8_e4m3fn) queries on the CPU: every entry point hands the kernels q as it is (the
FP8-math kernels) or, at head dims FP8 math does not take, converted to the output's dtype
(exactly: the FP8 K/V path's 16-bit math), with q_descale folded into k_descale; the checks
name what is wrong. The kernels are recorders (the conftest's fake_gpu)."""

import pytest
import torch

import flash_cute
from flash_cute import entry, ops
from flash_cute import flash_attn_interface as fa3
from flash_cute.call import KERNEL_CALL_FIELDS

FP8 = torch.float8_e4m3fn
BATCH, SEQLEN_Q, SEQLEN_K, HEADS, HEADS_KV, D = 2, 3, 40, 8, 2, 64


def fp8(*shape):
    """Random FP8 values, normals and subnormals (|x| up to ~8)."""
    return (torch.randn(*shape) * 2).to(FP8)


@pytest.fixture
def launches(fake_gpu, monkeypatch):
    """The kernel arguments of every launch: {call field: value}, with q, k, v, out and the
    launch plan."""
    from flash_cute import runtime

    seen = []
    real = runtime.LaunchPlan.launch

    def launch(self, q, k, v, out, call_args):
        seen.append(dict(zip(KERNEL_CALL_FIELDS, call_args), q=q, k=k, v=v, out=out, plan=self))
        return real(self, q, k, v, out, call_args)

    monkeypatch.setattr(runtime.LaunchPlan, "launch", launch)
    return seen


def calls(q8, k8, v8, qd, kd, vd, out=None):
    """One FP8 call through each entry point that takes FP8 q (padded and packed keys, a
    paged cache), as (name, thunk)."""
    cu_q = torch.arange(0, (BATCH + 1) * SEQLEN_Q, SEQLEN_Q, dtype=torch.int32)
    cu_k = torch.arange(0, (BATCH + 1) * SEQLEN_K, SEQLEN_K, dtype=torch.int32)
    packed = [t.flatten(0, 1) for t in (q8, k8, v8)]
    out_packed = None if out is None else out.flatten(0, 1)
    pages = k8.view(BATCH * SEQLEN_K // 8, 8, HEADS_KV, D), v8.view(-1, 8, HEADS_KV, D)
    table = torch.arange(BATCH * SEQLEN_K // 8, dtype=torch.int32).view(BATCH, -1)
    lens = torch.full((BATCH,), SEQLEN_K, dtype=torch.int32)
    ds = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    return [
        ("func", lambda: flash_cute.flash_attn_func(q8, k8, v8, out=out, **ds)),
        (
            "varlen",
            lambda: flash_cute.flash_attn_varlen_func(
                *packed, cu_q, SEQLEN_Q, cu_k, max_seqlen_k=SEQLEN_K, out=out_packed, **ds
            ),
        ),
        (
            "kvcache paged",
            lambda: flash_cute.flash_attn_with_kvcache(
                q8, *pages, cache_seqlens=lens, page_table=table, out=out, **ds
            ),
        ),
        ("fa3 func", lambda: fa3.flash_attn_func(q8, k8, v8, **ds)),
        (
            "fa3 varlen",
            lambda: fa3.flash_attn_varlen_func(*packed, cu_q, cu_k, SEQLEN_Q, SEQLEN_K, **ds),
        ),
        ("fa3 kvcache", lambda: fa3.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=7, **ds)),
    ]


@pytest.mark.parametrize("descales", ["none", "q only", "all"])
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_kernels_get_fp8_queries_and_their_descales(launches, descales, out_dtype):
    q8 = fp8(BATCH, SEQLEN_Q, HEADS, D)
    k8, v8 = fp8(BATCH, SEQLEN_K, HEADS_KV, D), fp8(BATCH, SEQLEN_K, HEADS_KV, D)
    qd = None if descales == "none" else torch.rand(BATCH, HEADS_KV) + 0.5
    kd, vd = (torch.rand(BATCH, HEADS_KV) + 0.5 for _ in range(2))
    if descales != "all":
        kd = vd = None
    out = None if out_dtype is None else torch.empty(BATCH, SEQLEN_Q, HEADS, D, dtype=out_dtype)
    expected_dtype = out_dtype or torch.bfloat16
    for name, call in calls(q8, k8, v8, qd, kd, vd, out):
        if out is not None and name.startswith("fa3"):
            continue  # (FlashAttention-3's padded functions take no out)
        before = len(launches)
        result = call()
        result = result[0] if isinstance(result, tuple) else result
        (seen,) = launches[before:]
        assert result.dtype == expected_dtype, name
        variant = seen["plan"].variant
        assert variant.q_dtype is not None, name  # (FP8 math: q as it is)
        assert seen["q"].dtype == FP8 and seen["out"].dtype == expected_dtype, name
        assert torch.equal(seen["q"].float().flatten(), q8.float().flatten()), name  # exact
        assert seen["k"].dtype == FP8 and seen["v"].dtype == FP8, name
        # (The kernel takes each descale as given; None is 1: the launch plan's unit.)
        assert seen["q_descale"] is qd and seen["k_descale"] is kd, name
        assert seen["v_descale"] is vd, name


@pytest.mark.parametrize("page_size", [None, 1])
def test_head_dims_fp8_math_does_not_take_convert_q_exactly(launches, page_size):
    """Head dim 80 (not a multiple of 32): q converted to bf16 (exact), q_descale folded, the
    FP8-cache kernels' 16-bit math."""
    d, keys = 80, 40
    q8, k8, v8 = (
        fp8(BATCH, 1, HEADS, d),
        fp8(BATCH, keys, HEADS_KV, d),
        fp8(BATCH, keys, HEADS_KV, d),
    )
    qd, kd = torch.rand(BATCH, HEADS_KV) + 0.5, torch.rand(BATCH, HEADS_KV) + 0.5
    table = None
    if page_size:
        k8, v8 = (x.view(-1, page_size, HEADS_KV, d) for x in (k8, v8))
        table = torch.arange(BATCH * keys, dtype=torch.int32).view(BATCH, keys)
    lens = torch.full((BATCH,), keys, dtype=torch.int32)
    flash_cute.flash_attn_with_kvcache(
        q8, k8, v8, cache_seqlens=lens, page_table=table, q_descale=qd, k_descale=kd
    )
    (seen,) = launches
    assert seen["plan"].variant.q_dtype is None and seen["q"].dtype == torch.bfloat16
    assert torch.equal(seen["q"].float().flatten(), q8.float().flatten())
    assert torch.equal(seen["k_descale"], qd * kd)


def test_fp8_math_calls_replay_with_their_descales(launches):
    """An FP8-math call's launch plan is kept and replayed (the kernel takes q_descale itself):
    later calls skip the checks and pass each call's own descales; a call whose q_descale
    appears or goes takes a plan of its own."""
    q8, k8 = fp8(BATCH, SEQLEN_Q, HEADS, D), fp8(BATCH, SEQLEN_K, HEADS_KV, D)
    qds = [torch.rand(BATCH, HEADS_KV) + 0.5 for _ in range(3)]
    kd = torch.rand(BATCH, HEADS_KV) + 0.5
    for qd in qds:
        flash_cute.flash_attn_func(q8, k8, k8, q_descale=qd, k_descale=kd)
    assert [seen["q_descale"] for seen in launches] == qds
    assert all(seen["k_descale"] is kd for seen in launches)
    (launch,) = {id(seen["plan"]): seen["plan"] for seen in launches}.values()  # one plan
    flash_cute.flash_attn_func(q8, k8, k8, k_descale=kd)
    assert launches[-1]["plan"] is not launch and launches[-1]["q_descale"] is None


def test_converted_fp8_calls_are_not_replayed(launches):
    """At a head dim FP8 math does not take, the launch plan holds the folded descale and the
    converted q: none is kept under the FP8 call's key, so every call takes the checked path
    and folds (and converts) again."""
    d = 80
    q8, k8 = fp8(BATCH, SEQLEN_Q, HEADS, d), fp8(BATCH, SEQLEN_K, HEADS_KV, d)
    qd, kd = torch.rand(BATCH, HEADS_KV) + 0.5, torch.rand(BATCH, HEADS_KV) + 0.5
    for _ in range(3):
        flash_cute.flash_attn_with_kvcache(q8, k8, k8, cache_seqlens=SEQLEN_K, q_descale=qd,
                                           k_descale=kd)  # fmt: skip
    assert len(launches) == 3 and all(not point.plans for point in entry.ENTRY_POINTS)
    assert len({id(seen["k_descale"]) for seen in launches}) == 3


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: dict(q=q, k=k.bfloat16(), v=v.bfloat16()), TypeError, "with FP8 q"),
        (lambda q, k, v: dict(q=q.to(torch.float8_e5m2)), TypeError, "q must be float16, bfloat16"),
        (
            lambda q, k, v: dict(q_descale=torch.ones(BATCH, HEADS)),
            ValueError,
            r"q_descale must have shape \(batch, nheads_kv\)",
        ),
        (
            lambda q, k, v: dict(q_descale=torch.ones(BATCH, HEADS_KV).double()),
            TypeError,
            "float32",
        ),
        (
            lambda q, k, v: dict(
                q=q.bfloat16(),
                k=k.bfloat16(),
                v=v.bfloat16(),
                q_descale=torch.ones(BATCH, HEADS_KV),
            ),  # fmt: skip
            ValueError,
            "q_descale dequantizes FP8",
        ),
        (
            lambda q, k, v: dict(out=torch.empty(BATCH, SEQLEN_Q, HEADS, D)),
            TypeError,
            "out must be bfloat16 or float16 with float8_e4m3fn q",
        ),
        (
            lambda q, k, v: dict(q=q.bfloat16()),
            TypeError,
            "k and v in float8_e4m3fn need float8_e4m3fn q here",
        ),
    ],
)
def test_bad_fp8_query_calls_raise_by_name(fake_gpu, mutate, error, message):
    q8 = fp8(BATCH, SEQLEN_Q, HEADS, D)
    k8, v8 = fp8(BATCH, SEQLEN_K, HEADS_KV, D), fp8(BATCH, SEQLEN_K, HEADS_KV, D)
    args = dict(q=q8, k=k8, v=v8)
    args.update(mutate(q8, k8, v8))
    with pytest.raises(error, match=message):
        flash_cute.flash_attn_func(**args)


def test_fp8_queries_with_qv_are_refused_by_name(fake_gpu):
    q8 = fp8(BATCH, 1, 16, 64)
    cache = fp8(BATCH, SEQLEN_K, 1, 576)
    with pytest.raises(NotImplementedError, match="qv"):
        flash_cute.flash_attn_with_kvcache(
            q8, cache[..., :64], cache[..., 64:], qv=fp8(BATCH, 1, 16, 512)
        )


def test_traced_output_is_bfloat16():
    """The custom op's caller allocates a bfloat16 out for FP8 q (FlashAttention-3's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_cute.call import Call

    with FakeTensorMode():
        q8 = torch.empty(BATCH, SEQLEN_Q, HEADS, D, dtype=FP8)
        k8 = torch.empty(BATCH, SEQLEN_K, HEADS_KV, D, dtype=FP8)
        out = ops.traced_forward(Call(q=q8, k=k8, v=k8))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (BATCH, SEQLEN_Q, HEADS, D)


@pytest.mark.parametrize("head_dim", list(range(64, 257, 16)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1, 1000), (1000, 1000)])
@pytest.mark.parametrize("splits, pack_gqa", [(1, None), (3, True)])
def test_every_fa3_fp8_shape_plans(fake_gpu, head_dim, causal, seqlens, splits, pack_gqa):
    """FlashAttention-3's FP8 forward test calls (its head dims, masks, splits, packed GQA) get a
    plan and a launch: none is refused by the FP8 form of a table row (shared memory)."""
    seqlen_q, seqlen_k = seqlens
    q8 = fp8(2, seqlen_q, 6, head_dim)
    k8 = fp8(2, seqlen_k, 2, head_dim)
    window = (100, 0) if causal else (-1, -1)
    fa3.flash_attn_func(
        q8, k8, k8, causal=causal, window_size=window, num_splits=splits, pack_gqa=pack_gqa
    )


def test_scheduler_metadata_of_fp8_calls(fake_gpu, launches, monkeypatch):
    """get_scheduler_metadata(qkv_dtype=float8_e4m3fn) gives the split count an FP8 kvcache call
    of those sizes launches with."""
    monkeypatch.setattr(fa3, "num_sms", lambda index: 132)
    monkeypatch.setattr(fa3, "current_device", lambda: 0)
    lens = torch.full((BATCH,), 30000, dtype=torch.int32)
    meta = fa3.get_scheduler_metadata(BATCH, 1, 32768, 32, 8, 128, lens, qkv_dtype=FP8, causal=True)
    q8, cache = fp8(BATCH, 1, 32, 128), fp8(BATCH, 32768, 8, 128)
    fa3.flash_attn_with_kvcache(q8, cache, cache, cache_seqlens=lens, causal=True)
    assert launches[-1]["q"].dtype == FP8  # (FP8 math)
    assert meta.flash_cute_num_splits > 1
    assert launches[-1]["plan"].num_splits == meta.flash_cute_num_splits


def test_device_checks_see_the_callers_tensors(fake_gpu, monkeypatch):
    """The device checks run on the call as given (FP8 q, q_descale among its tensors), before
    the conversion: a q_descale on another device is named, not met in the fold."""
    from flash_cute import checks

    seen = []
    monkeypatch.setattr(checks, "check_cuda", lambda named: seen.extend(named))
    q8, k8 = fp8(BATCH, SEQLEN_Q, HEADS, D), fp8(BATCH, SEQLEN_K, HEADS_KV, D)
    qd = torch.rand(BATCH, HEADS_KV)
    flash_cute.flash_attn_func(q8, k8, k8, q_descale=qd)
    named = dict(seen)
    assert named["q"] is q8 and named["q_descale"] is qd


def test_vllm_descales_on_a_bf16_model_replay_without_them(launches):
    """vLLM passes (num_seqs, nheads_kv) expanded descales on every call, bf16 models included:
    FlashAttention-3's module ignores them there, first call and replays alike."""
    q = torch.randn(BATCH * SEQLEN_Q, HEADS, D, dtype=torch.bfloat16)
    cache = torch.randn(BATCH * 2, 16, HEADS_KV, D, dtype=torch.bfloat16)
    table = torch.arange(BATCH * 2, dtype=torch.int32).view(BATCH, 2)
    cu_q = torch.arange(0, (BATCH + 1) * SEQLEN_Q, SEQLEN_Q, dtype=torch.int32)
    lens = torch.full((BATCH,), 20, dtype=torch.int32)
    scale = torch.ones(1).expand(BATCH, HEADS_KV)
    for _ in range(3):
        fa3.flash_attn_with_kvcache(
            q, cache, cache, cache_seqlens=lens, page_table=table, cu_seqlens_q=cu_q,
            max_seqlen_q=SEQLEN_Q, q_descale=scale, k_descale=scale, v_descale=scale,
        )  # fmt: skip
    assert len(launches) == 3
    assert all(seen["q_descale"] is seen["k_descale"] is None for seen in launches)
    assert fa3.flash_attn_with_kvcache.entry_point.plans  # replayed
    assert launches[1]["plan"] is launches[0]["plan"] is launches[2]["plan"]
