"""FP8 (float8_e4m3fn) K/V caches on the CPU: the argument checks, the plan's FP8 form of the
table rows, and the FlashAttention-3 interface passing the descales on."""

import pytest
import torch

import flash_cute
from flash_cute import flash_attn_interface as fa3
from flash_cute.config import decode_config, default_config, fp8_kv_config
from flash_cute.plan import Problem, plan_forward

FP8 = torch.float8_e4m3fn


def caches(dtype=FP8, batch=2, seqlen=32, nheads_kv=2, head_dim=64):
    shape = (batch, seqlen, nheads_kv, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def q_of(batch=2, nheads=4, head_dim=64):
    return torch.randn(batch, 1, nheads, head_dim, dtype=torch.bfloat16)


def test_mixed_cache_dtypes_raise():
    k, _ = caches()
    _, v = caches(torch.bfloat16)
    with pytest.raises(TypeError, match="k_cache and v_cache must both be float8_e4m3fn"):
        flash_cute.flash_attn_with_kvcache(q_of(), k, v)


def test_other_fp8_formats_raise():
    k, v = caches(torch.float8_e5m2)
    with pytest.raises(TypeError, match="k_cache must be float16, bfloat16 or float8_e4m3fn"):
        flash_cute.flash_attn_with_kvcache(q_of(), k, v)


@pytest.mark.parametrize(
    "descale, error, message",
    [
        (torch.ones(2, 3), ValueError, r"k_descale must have shape \(batch, nheads_kv\)"),
        (torch.ones(2, 2, dtype=torch.float16), TypeError, "k_descale must be float32"),
        (1.0, TypeError, "k_descale must be a torch.Tensor or None"),
    ],
)
def test_bad_descales_raise(descale, error, message):
    k, v = caches()
    with pytest.raises(error, match=message):
        flash_cute.flash_attn_with_kvcache(q_of(), k, v, k_descale=descale)


def test_descales_need_an_fp8_cache():
    k, v = caches(torch.bfloat16)
    with pytest.raises(ValueError, match="v_descale dequantizes FP8"):
        flash_cute.flash_attn_with_kvcache(q_of(), k, v, v_descale=torch.ones(2, 2))


def test_varlen_checks_descales_per_sequence():
    k, v = caches()
    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\(batch, nheads_kv\) = \(2, 2\)"):
        flash_cute.flash_attn_varlen_func(q, k, v, cu, 3, k_descale=torch.ones(5, 2))


def test_expanded_scalar_descales_pass_the_checks():
    """An engine's (1,) scale expanded to (batch, nheads_kv), stride 0, is accepted: the call
    goes on to the device check (CPU tensors)."""
    k, v = caches()
    scale = torch.tensor([0.5]).expand(2, 2)
    with pytest.raises(ValueError, match="CUDA"):
        flash_cute.flash_attn_with_kvcache(q_of(), k, v, k_descale=scale, v_descale=scale)


@pytest.mark.parametrize(
    "config, head_dim, head_dim_v",
    [
        (decode_config(128, "bfloat16"), 128, 128),
        (default_config(128, "bfloat16", True, 4096), 128, 128),
        (default_config(64, "float16", False, 8192), 64, 64),
        (decode_config(256, "bfloat16"), 256, 256),
        (decode_config(192, "bfloat16", 128), 192, 128),
        # A short window's row runs three CTAs per SM; the FP8 forms' register splits take one.
        (default_config(64, "bfloat16", False, 8192, 101), 64, 64),
    ],
)
def test_fp8_form_of_table_rows_fits(config, head_dim, head_dim_v):
    fp8 = fp8_kv_config(config, head_dim, head_dim_v)
    assert fp8.tile_m == 64 and fp8.scheduler == "single_tile" and fp8.num_stages == 2
    assert fp8.smem_bytes(head_dim, 2, head_dim_v, kv_fp8=True) <= fp8.smem_limit()
    fp8.validate(head_dim, "bfloat16", head_dim_v)


def test_plan_takes_the_fp8_form_and_names_it():
    problem = Problem(
        batch=4, nheads=32, nheads_kv=8, head_dim=128, dtype="bfloat16", max_seqlen_q=1,
        max_seqlen_k=8192, kv_capacity=8192, causal=True, kv_layout="paged", page_size=64,
        seqused_k=True, kv_dtype="float8_e4m3fn",
    )  # fmt: skip
    variant = plan_forward(problem, 132, None, 0).variant
    assert variant.kv_dtype == "float8_e4m3fn" and "kv-float8_e4m3fn" in variant.describe()
    assert variant.config.scheduler == "single_tile" and variant.takes_optionals


@pytest.mark.parametrize(
    "page_size, head_dim, kv_dtype, loads",
    [
        (1, 128, "float8_e4m3fn", "gather"),  # SGLang's pages
        (16, 128, "float8_e4m3fn", "gather"),  # 2 KB boxes: rows gathered instead
        (16, 256, "float8_e4m3fn", "tma"),  # 4 KB boxes
        (64, 128, "float8_e4m3fn", "tma"),
        (16, 128, None, "tma"),  # a bf16 page of 16 rows: 4 KB boxes
        (8, 128, None, "gather"),  # no box of a multiple of 16 rows
    ],
)
def test_paged_loads_follow_the_box_size(page_size, head_dim, kv_dtype, loads):
    problem = Problem(
        batch=8, nheads=32, nheads_kv=8, head_dim=head_dim, dtype="bfloat16", max_seqlen_q=1,
        max_seqlen_k=32768, kv_capacity=32768, kv_layout="paged", page_size=page_size,
        seqused_k=True, kv_dtype=kv_dtype,
    )  # fmt: skip
    variant = plan_forward(problem, 132, None, 0).variant
    gathered = variant.gather_page_size == page_size and variant.page_box_rows is None
    assert gathered == (loads == "gather")
    assert (variant.page_box_rows is not None) == (loads == "tma")
    if gathered:  # registers to read page-table entries ahead of the copies
        assert variant.config.producer_registers >= 128


def test_caller_config_that_cannot_read_fp8_raises():
    problem = Problem(
        batch=1, nheads=8, nheads_kv=8, head_dim=128, dtype="bfloat16", max_seqlen_q=1000,
        max_seqlen_k=1000, kv_capacity=1000, kv_dtype="float8_e4m3fn",
    )  # fmt: skip
    persistent = default_config(128, "bfloat16", False, 1000).replace(
        scheduler="dynamic_persistent"
    )
    with pytest.raises(ValueError, match="FP8"):
        plan_forward(problem, 132, persistent, 1)


def test_qv_needs_a_16bit_cache():
    k, v = caches(head_dim=512)
    kr, _ = caches(head_dim=64)
    q = torch.randn(2, 1, 16, 64, dtype=torch.bfloat16)
    qv = torch.randn(2, 1, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="16-bit latent cache"):
        flash_cute.flash_attn_with_kvcache(q, kr, v, qv=qv)


def test_fa3_interface_passes_descales(monkeypatch):
    from flash_cute import forward

    seen = []
    monkeypatch.setattr(forward, "run", lambda call, *rest: seen.append(call) or "out")
    k, v = caches()
    kd, vd = torch.ones(2, 2), torch.full((2, 2), 2.0)
    assert fa3.flash_attn_with_kvcache(q_of(), k, v, k_descale=kd, v_descale=vd) == "out"
    assert seen[-1].k_descale is kd and seen[-1].v_descale is vd
    q = torch.randn(5, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    fa3.flash_attn_with_kvcache(
        q, k, v, cu_seqlens_q=cu, max_seqlen_q=3, k_descale=kd, v_descale=vd
    )
    assert seen[-1].k_descale is kd and seen[-1].v_descale is vd
    fa3.flash_attn_varlen_func(q, k, v, cu, None, 3, 32, k_descale=kd, v_descale=vd)
    assert seen[-1].k_descale is kd and seen[-1].v_descale is vd and seen[-1].cu_seqlens_q is cu
    fa3.flash_attn_with_kvcache(q_of(), k, v, q_descale=kd)  # (16-bit q: ignored, as in FA3)
    assert seen[-1].q_descale is None
