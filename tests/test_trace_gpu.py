"""Traced launches on a Hopper GPU (marker: gpu): every work tile of a problem appears exactly
once in its trace, with its phases in order, and tracing leaves the output unchanged."""

import math
from collections import Counter

import pytest
import torch
from kv_cases import cu_seqlens

import flash_cute
from flash_cute import trace
from flash_cute.config import default_config

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def traced(call):
    """(call's result untraced, its result traced, the traced launches)."""
    plain = call()
    with trace.record() as rec:
        again = call()
    return plain, again, rec.launches


def tile_coords(launch):
    """Each record's (m_block, head, batch, split)."""
    table = launch.table()
    return list(zip(*(table[c].tolist() for c in ("m_block", "head", "batch", "split"))))


def check_tiles(launch, expected, is_empty=lambda tile: False):
    """Every tile of `expected` recorded exactly once; any other record is of a tile with no
    rows (is_empty: a varlen tile space holds spare tiles past its sequences' ends, which may
    share coordinates)."""
    table = launch.table()
    seen = Counter(tile_coords(launch))
    assert {tile: seen[tile] for tile in expected} == {tile: 1 for tile in expected}, launch.label
    assert all(is_empty(tile) for tile in set(seen) - set(expected)), launch.label
    assert (table["start"] <= table["kv_ready"]).all()
    assert (table["kv_ready"] <= table["mainloop_end"]).all()
    assert (table["mainloop_end"] <= table["end"]).all()
    assert (table["load_start"] <= table["load_end"]).all()
    assert (table["sm"] < launch.num_sms).all()
    summary = launch.summary()
    assert 0.0 <= summary.idle_fraction < 1.0 and summary.span_ns > 0


@pytest.mark.parametrize("scheduler", ["single_tile", "static_persistent", "dynamic_persistent"])
def test_causal_prefill_every_tile_once(scheduler):
    batch, seqlen, heads = 2, 1000, 4
    gen = torch.Generator(device="cuda").manual_seed(19)
    q, k, v = (
        torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=BF16, generator=gen)
        for _ in range(3)
    )
    config = default_config(128, "bfloat16", True, seqlen).replace(scheduler=scheduler)
    plain, again, launches = traced(
        lambda: flash_cute.flash_attn_func(q, k, v, causal=True, config=config)
    )
    assert torch.equal(plain, again)
    assert len(launches) == 1
    m_blocks = math.ceil(seqlen / config.tile_m)
    expected = [(m, h, b, 0) for m in range(m_blocks) for h in range(heads) for b in range(batch)]
    check_tiles(launches[0], expected)


def test_split_decode_every_split_once():
    batch, keys, heads, heads_kv, splits = 1, 32768, 32, 8, 8
    gen = torch.Generator(device="cuda").manual_seed(20)
    q = torch.randn(batch, 1, heads, 128, device="cuda", dtype=BF16, generator=gen)
    k, v = (
        torch.randn(batch, keys, heads_kv, 128, device="cuda", dtype=BF16, generator=gen)
        for _ in range(2)
    )
    plain, again, launches = traced(
        lambda: flash_cute.flash_attn_with_kvcache(q, k, v, num_splits=splits)
    )
    assert torch.equal(plain, again)
    # Packed GQA: a tile holds the 4 q heads of one kv head; its head is the kv head.
    expected = [(0, h, 0, s) for h in range(heads_kv) for s in range(splits)]
    check_tiles(launches[0], expected)


def test_varlen_mixed_batch_every_tile_once():
    lens, heads = [1, 17, 1000, 300], 4
    gen = torch.Generator(device="cuda").manual_seed(21)
    total = sum(lens)
    q, k, v = (
        torch.randn(total, heads, 128, device="cuda", dtype=BF16, generator=gen) for _ in range(3)
    )
    cu = cu_seqlens(lens)
    config = default_config(128, "bfloat16", True, max(lens))
    plain, again, launches = traced(
        lambda: flash_cute.flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            max(lens),
            cu_seqlens_k=cu,
            max_seqlen_k=max(lens),
            causal=True,
            config=config,
        )
    )
    assert torch.equal(plain, again)
    tile_m = config.tile_m
    expected = [
        (m, h, b, 0)
        for b, n in enumerate(lens)
        for m in range(math.ceil(n / tile_m))
        for h in range(heads)
    ]
    check_tiles(launches[0], expected, lambda tile: tile[0] * tile_m >= lens[tile[2]])


def test_combine_every_block_once():
    from flash_cute.kernels.flash_combine import FlashAttentionCombine

    splits, batch, seqlen, heads, d = 3, 2, 77, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(22)
    partial = torch.randn(splits, batch, seqlen, heads, d, device="cuda", generator=gen)
    lse = torch.randn(splits, batch, seqlen, heads, device="cuda", generator=gen)
    plain, again, launches = traced(
        lambda: flash_cute.flash_attn_combine(partial, lse, out_dtype=BF16)
    )
    assert torch.equal(plain, again)
    (launch,) = launches
    assert launch.label.startswith("combine d128 bfloat16")
    gx, gy, _ = FlashAttentionCombine.grid(batch, seqlen, heads, d)
    expected = [(x, 0, y, 0) for x in range(gx) for y in range(gy)]
    table = launch.table()
    assert sorted(tile_coords(launch)) == sorted(expected)
    assert (table["start"] <= table["end"]).all()


def test_mla_split_and_its_combine_launch_are_traced():
    """A wide split decode (absorbed MLA, 128 heads) merges its partials with the combine kernel
    after the launch: both launches are traced."""
    batch, keys, heads = 1, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(23)
    cache = torch.randn(batch, keys, 1, 576, device="cuda", dtype=BF16, generator=gen)
    q = torch.randn(batch, 1, heads, 576, device="cuda", dtype=BF16, generator=gen)
    plain, again, launches = traced(
        lambda: flash_cute.flash_attn_with_kvcache(q, cache, cache[..., :512], causal=True)
    )
    assert torch.equal(plain, again)
    forward, combine = launches
    assert "split" in forward.label and combine.label.startswith("combine d512")
    splits = forward.table()["split"].max() + 1
    # Packed GQA: each tile holds 64 of the kv head's 128 q heads; its head is the group.
    expected = [(0, g, 0, s) for g in range(heads // 64) for s in range(splits)]
    check_tiles(forward, expected)


@pytest.mark.parametrize("margin", [0, 100])
def test_sm_margin_caps_the_persistent_grid(margin):
    """FlashAttention-3's sm_margin: a persistent launch runs on at most (SMs - margin) x CTAs
    per SM CTAs, and its output is bit-identical to the whole GPU's (no split: each tile's
    math does not depend on the CTA that runs it)."""
    from flash_cute import flash_attn_interface as fa3

    gen = torch.Generator(device="cuda").manual_seed(margin)
    q, k, v = (
        torch.randn(2, 2000, 8, 128, device="cuda", dtype=BF16, generator=gen) for _ in range(3)
    )
    whole = fa3.flash_attn_func(q, k, v, causal=True)
    with trace.record() as rec:
        out = fa3.flash_attn_func(q, k, v, causal=True, sm_margin=margin)
    (launch,) = rec.launches
    assert launch.config.scheduler != "single_tile"
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    ctas = set(launch.table()["cta"].tolist())
    assert len(ctas) <= (sms - margin) * launch.config.ctas_per_sm
    assert torch.equal(out, whole)
