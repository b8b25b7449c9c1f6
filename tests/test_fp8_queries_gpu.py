"""FP8 (float8_e4m3fn) queries on a Hopper GPU at a head dim FP8 math does not take (80: q
converted on the host, the FP8-cache kernels in 16-bit math; the other calls run FP8 math:
test_fp8_math_gpu.py): against the float32 reference on the dequantized inputs (q *
q_descale, k * k_descale, v * v_descale, each (batch, kv head) scale over its heads), within
the bar of 16-bit attention. q_descale scales the scores as k_descale does, so the reference
takes q exactly (FP8 values are bf16 values) and k_descale * q_descale. Outputs are poisoned
(NaN) before each call; cache slots past each sequence hold NaN."""

import pytest
import torch
from kv_cases import captured
from test_fp8_kv_gpu import FP8, check_against_dequantized, fp8_cache, padded, poison_past

import flash_cute
from flash_cute import flash_attn_interface as fa3
from flash_cute.reference import stable_seed

pytestmark = pytest.mark.gpu


def scales(batch, nheads_kv, gen):
    """q, k and v descales, (batch, nheads_kv) in [0.25, 2)."""
    return tuple(
        torch.rand(batch, nheads_kv, device="cuda", generator=gen) * 1.75 + 0.25 for _ in range(3)
    )


def fp8_randn(*shape, gen):
    return torch.randn(*shape, device="cuda", generator=gen).to(FP8)


def reference_scales(qd, kd, vd, batch, nheads_kv):
    """The (k, v) descales the reference applies: q's folded into k's; None as 1."""
    ones = torch.ones(batch, nheads_kv, device="cuda")
    qd, kd, vd = (ones if d is None else d for d in (qd, kd, vd))
    return qd * kd, vd


DECODE_CASES = [
    # (page_size, num_splits, (nheads, nheads_kv), descales)
    (None, 0, (32, 8), "all"),
    (1, 0, (16, 2), None),  # SGLang's FA3 call: page 1, FP8 q and cache, descales left at None
    (16, 3, (8, 8), "q"),
]


@pytest.mark.parametrize("api", ["native", "fa3"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"p{c[0]}-s{c[1]}-{c[2]}-{c[3]}")
def test_fp8_decode(case, api):
    page_size, num_splits, (nheads, nheads_kv), descales = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 q decode", case, api))
    batch, capacity, head_dim = 4, 1100, 80
    lengths = [1, 17, 1000, 1100]
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, page_size, gen)
    k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
    poison_past(k_cache, table, lengths, capacity)
    poison_past(v_cache, table, lengths, capacity)
    q8 = fp8_randn(batch, 1, nheads, head_dim, gen=gen)
    qd, kd, vd = scales(batch, nheads_kv, gen)
    if descales is None:
        qd = kd = vd = None
    elif descales == "q":
        kd = vd = None
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    function = (
        flash_cute.flash_attn_with_kvcache if api == "native" else fa3.flash_attn_with_kvcache
    )
    out = function(
        q8, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=True,
        num_splits=num_splits, q_descale=qd, k_descale=kd, v_descale=vd,
    )  # fmt: skip
    ks, vs = reference_scales(qd, kd, vd, batch, nheads_kv)
    check_against_dequantized(q8.bfloat16(), out, k_pad, v_pad, ks, vs, lengths, True)


def test_fp8_decode_graph_replay():
    """A captured FP8 decode step replayed with new queries, lengths and page-table contents
    equals the reference each time (the conversion is captured with the launch)."""
    gen = torch.Generator(device="cuda").manual_seed(stable_seed("fp8 q graph"))
    batch, capacity, nheads, nheads_kv, head_dim, page = 3, 2048, 32, 8, 80, 16
    k_cache, v_cache, table = fp8_cache(batch, capacity, nheads_kv, head_dim, page, gen)
    q8 = fp8_randn(batch, 1, nheads, head_dim, gen=gen)
    qd, kd, vd = scales(batch, nheads_kv, gen)
    seqlens = torch.tensor([5, 700, 2048], device="cuda", dtype=torch.int32)
    graph, out = captured(
        lambda: flash_cute.flash_attn_with_kvcache(
            q8,
            k_cache,
            v_cache,
            cache_seqlens=seqlens,
            page_table=table,
            causal=True,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
        )  # fmt: skip
    )
    for lengths in ([1, 2048, 333], [2000, 64, 1]):
        q8.copy_(fp8_randn(batch, 1, nheads, head_dim, gen=gen))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        table.copy_(table[torch.randperm(batch, device="cuda", generator=gen)])
        out.fill_(float("nan"))
        graph.replay()
        k_pad, v_pad = padded(k_cache, table, capacity), padded(v_cache, table, capacity)
        ks, vs = reference_scales(qd, kd, vd, batch, nheads_kv)
        check_against_dequantized(q8.bfloat16(), out, k_pad, v_pad, ks, vs, lengths, True)
