"""The plan step (CPU): which kernel variant each call launches, with which launch constants."""

import dataclasses
import inspect
import math
import pickle

import pytest

from flash_cute import DECODE_CONFIGS, FORWARD_CONFIGS, SHORT_SEQUENCE_CONFIGS, AttentionConfig
from flash_cute.config import SHORT_WINDOW_CONFIGS
from flash_cute.plan import ForwardVariant, Problem, plan_forward, split_tiles

SMS = 132
BF16 = "bfloat16"


def prefill(batch=4, seqlen=4096, nheads=16, nheads_kv=None, head_dim=128, causal=True, **kw):
    """flash_attn_func's problem for q (batch, seqlen, nheads, head_dim) and keys as long
    (nheads_kv: nheads unless given)."""
    return Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=nheads_kv or nheads,
        head_dim=head_dim,
        dtype=kw.pop("dtype", BF16),
        max_seqlen_q=seqlen,
        max_seqlen_k=kw.pop("seqlen_k", seqlen),
        kv_capacity=kw.pop("kv_capacity", kw.get("seqlen_k", seqlen)),
        causal=causal,
        **kw,
    )


def func_plan(problem, config=None):
    """As flash_attn_func plans: the prefill table, no packed GQA, no split."""
    return plan_forward(problem, SMS, config, num_splits=1, pack_gqa=False, decode_rows=False)


def decode(batch=1, nheads=32, nheads_kv=8, head_dim=128, keys=8192, **kw):
    """flash_attn_with_kvcache's problem for one new token per sequence."""
    return Problem(
        batch=batch,
        nheads=nheads,
        nheads_kv=nheads_kv,
        head_dim=head_dim,
        dtype=BF16,
        max_seqlen_q=kw.pop("seqlen_q", 1),
        max_seqlen_k=keys,
        kv_capacity=kw.pop("kv_capacity", keys),
        **kw,
    )


# (call, plan_forward arguments) -> the variant's config and flags, and the launch constants.
CASES = {
    "prefill, many waves: the table's row as it is": (
        prefill(),
        dict(decode_rows=False, pack_gqa=False),
        dict(config=FORWARD_CONFIGS[(128, BF16, True)], split=False, pack_gqa_ratio=1),
        dict(num_splits=1, num_counters=2),
    ),
    "prefill, one wave of tiles: the dynamic row's static twin, no counter": (
        prefill(batch=1, seqlen=1000, nheads=8),  # 8 query tiles x 8 heads
        dict(decode_rows=False, pack_gqa=False),
        dict(config=FORWARD_CONFIGS[(128, BF16, True)].replace(scheduler="static_persistent")),
        dict(num_splits=1, num_counters=0),
    ),
    "prefill, short non-causal sequences: the short-sequence row": (
        prefill(seqlen=2048, causal=False),
        dict(decode_rows=False, pack_gqa=False),
        dict(config=SHORT_SEQUENCE_CONFIGS[(128, BF16, False)][1]),
        dict(num_counters=2),
    ),
    "flash_attn_func, one query row: still the prefill table, GQA not packed": (
        prefill(batch=1, seqlen=1, nheads=32, nheads_kv=8, causal=False, seqlen_k=4096),
        dict(decode_rows=False, pack_gqa=False),
        dict(
            config=SHORT_SEQUENCE_CONFIGS[(128, BF16, False)][1].replace(
                scheduler="static_persistent"
            ),
            pack_gqa_ratio=1,
        ),
        dict(num_splits=1),
    ),
    "decode step: the decode row, GQA packed, split for wave efficiency": (
        decode(seqused_k=True),  # 8 tiles of 64 rows over 64 key blocks
        dict(num_splits=0),
        dict(
            config=DECODE_CONFIGS[(128, BF16)].replace(store_o_from_registers=True),
            split=True,
            combine_launch=False,  # 16 splits x 4 rows x 128 fp32: merged in the kernel
            pack_gqa_ratio=4,
            seqused_k=True,
        ),
        dict(num_splits=16, num_counters=8, max_ctas=SMS),
    ),
    "decode step with an int length, not split": (
        decode(scalar_kv_length=True),
        dict(num_splits=1),
        dict(config=DECODE_CONFIGS[(128, BF16)], split=False, scalar_kv_length=True),
        dict(num_splits=1, num_counters=0),
    ),
    "decode step, q heads per kv head not dividing the tile: not packed": (
        decode(nheads=24, nheads_kv=8, seqlen_q=3),  # 3 x 3 rows; 64 % 3 != 0
        dict(num_splits=1),
        dict(config=DECODE_CONFIGS[(128, BF16)], pack_gqa_ratio=1),
        dict(),
    ),
    "more q heads per kv head than tile rows (MLA's 128): packed a tile's worth at a time": (
        decode(nheads=128, nheads_kv=1),
        dict(num_splits=1, config=AttentionConfig(64, 128, pingpong=False)),
        dict(pack_gqa_ratio=64),
        dict(),
    ),
    "absorbed MLA decode, batch 1: 128 heads in 2 tiles, split, merged by the combine kernel": (
        decode(nheads=128, nheads_kv=1, head_dim=576, head_dim_v=512, v_in_k=True, keys=4096),
        dict(num_splits=0),
        dict(split=True, combine_launch=True, pack_gqa_ratio=64, v_in_k=True),
        # The wave rule's 61 splits, capped at 2 sqrt(64 key blocks): 16 x 64 rows x 512 fp32.
        dict(num_splits=16, num_counters=0),
    ),
    "absorbed MLA, batch 8: 8 splits of 1 MiB of partials a tile, still the combine kernel's": (
        decode(
            batch=8,
            nheads=128,
            nheads_kv=1,
            head_dim=576,
            head_dim_v=512,
            v_in_k=True,
            keys=16384,
        ),  # fmt: skip
        dict(num_splits=0),
        dict(split=True, combine_launch=True, pack_gqa_ratio=64, v_in_k=True),
        dict(num_splits=8, num_counters=0),
    ),
    "head dim 512, 2 q heads per kv head: narrow partials (2 rows), merged in the kernel": (
        decode(batch=8, nheads=8, nheads_kv=4, head_dim=512, keys=8192),
        dict(num_splits=0),
        dict(split=True, combine_launch=False, pack_gqa_ratio=2),
        dict(num_splits=4),
    ),
    "the same, varlen: merged in the kernel, so split at most 1 MiB of partials per tile": (
        decode(
            nheads=128,
            nheads_kv=1,
            head_dim=576,
            head_dim_v=512,
            v_in_k=True,
            keys=4096,
            varlen_q=True,
            total_q=1,
        ),
        dict(num_splits=0),
        dict(split=True, combine_launch=False, varlen_q=True),
        dict(num_splits=8),  # 8 x 64 rows x 512 fp32
    ),
    "absorbed MLA at 64k keys: 1024 key blocks, the cap of 64 splits above the wave rule's 63": (
        decode(nheads=128, nheads_kv=1, head_dim=576, head_dim_v=512, v_in_k=True, keys=65536),
        dict(num_splits=0),
        dict(split=True, combine_launch=True),
        dict(num_splits=63),
    ),
    "head dim 128, 64 q heads on one kv head, batch 1: the wave rule's splits, uncapped": (
        decode(nheads=64, nheads_kv=1, keys=65536),
        dict(num_splits=0),
        dict(split=True, combine_launch=True, pack_gqa_ratio=64),
        dict(num_splits=122),  # (the 2 sqrt(blocks) cap is for V head dims above 256)
    ),
    "split prefill: one CTA per tile, O from registers, one arrival counter per tile": (
        prefill(batch=1, seqlen=256, nheads=4, seqlen_k=16384, causal=False),
        dict(num_splits=4, pack_gqa=False, decode_rows=False),
        dict(
            config=SHORT_SEQUENCE_CONFIGS[(128, BF16, False)][1].replace(
                scheduler="single_tile", store_o_from_registers=True
            ),
            split=True,
        ),
        dict(num_splits=4, num_counters=2 * 4),  # 2 query tiles of 128 rows x 4 heads
    ),
    "varlen: O from registers, the dynamic scheduler kept (no one-wave twin)": (
        prefill(batch=2, seqlen=100, nheads=8, varlen_q=True, total_q=150),
        dict(num_splits=1),
        dict(
            config=FORWARD_CONFIGS[(128, BF16, True)].replace(store_o_from_registers=True),
            varlen_q=True,
        ),
        dict(num_counters=2),
    ),
    "paged cache: TMA boxes of gcd(page size, tile_n) rows": (
        decode(kv_layout="paged", page_size=48, seqused_k=True),
        dict(num_splits=1),
        dict(kv_layout="paged", page_box_rows=16),
        dict(),
    ),
    "paged cache, pages no TMA box follows (page size 1): rows gathered, one CTA per tile": (
        decode(kv_layout="paged", page_size=1, seqused_k=True),
        dict(num_splits=1),
        dict(kv_layout="paged", gather_page_size=1),
        dict(),
    ),
    "paged cache with left padding: rows gathered whatever the page size": (
        prefill(batch=1, seqlen=1000, nheads=8, kv_layout="paged", page_size=64, leftpad_k=True),
        dict(decode_rows=False, pack_gqa=False),
        dict(
            config=FORWARD_CONFIGS[(128, BF16, True)].replace(scheduler="single_tile"),
            kv_layout="paged",
            gather_page_size=64,
            leftpad_k=True,
        ),
        dict(num_splits=1, num_counters=0),
    ),
    "a config with one MMA warpgroup runs without ping-pong": (
        prefill(batch=1, seqlen=4096, nheads=64),
        dict(config=AttentionConfig(64, 128), decode_rows=False, pack_gqa=False),
        dict(config=AttentionConfig(64, 128, pingpong=False)),
        dict(),
    ),
    "the O rescale under Q K^T needs the overlap": (
        prefill(),
        dict(
            config=AttentionConfig(128, 128, intra_wg_overlap=False, rescale_o_before_pv=True),
            decode_rows=False,
            pack_gqa=False,
        ),
        dict(config=AttentionConfig(128, 128, intra_wg_overlap=False)),
        dict(),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_call_gets_variant(case):
    problem, arguments, variant_fields, plan_fields = CASES[case]
    plan = plan_forward(problem, SMS, **arguments)
    for name, want in variant_fields.items():
        assert getattr(plan.variant, name) == want, name
    for name, want in plan_fields.items():
        assert getattr(plan, name) == want, name
    assert plan.variant.dtype == problem.dtype and plan.variant.causal == problem.causal


@pytest.mark.parametrize(
    "problem, lookahead",
    [
        # One MMA warpgroup: the plan gives the producer 128 registers and reads ahead.
        (decode(kv_layout="paged", page_size=1, seqused_k=True), 16),
        (decode(kv_layout="paged", page_size=8, seqused_k=True, kv_dtype="float8_e4m3fn"), 16),
        # Two MMA warpgroups leave the producer 24 registers: one row at a time.
        (prefill(batch=1, seqlen=1000, kv_layout="paged", page_size=24, seqused_k=True), 1),
    ],
)
def test_gathered_pages_read_the_page_table_ahead_where_registers_allow(problem, lookahead):
    variant = plan_forward(problem, SMS).variant
    assert variant.gather_page_size == problem.page_size
    config = variant.config
    assert config.gather_lookahead == lookahead
    assert (config.producer_registers >= 128) == (lookahead > 1)
    config.validate(problem.head_dim)


def test_pages_in_tma_boxes_keep_the_default_lookahead():
    problem = decode(kv_layout="paged", page_size=64, seqused_k=True)
    assert plan_forward(problem, SMS).variant.config.gather_lookahead == 1


# Local masks, softcap and sinks: (problem, plan_forward arguments) -> the variant's fields.
GPT_OSS = dict(nheads=64, nheads_kv=8, head_dim=64)
LOCAL_CASES = {
    "a causal window covering every key is plain causal": (
        prefill(seqlen=4096, window_left=4095),
        dict(
            causal=True, window_left=-1, window_right=-1, config=FORWARD_CONFIGS[(128, BF16, True)]
        ),
    ),
    "a window past the keys on both sides is no mask": (
        prefill(seqlen=1000, causal=False, window_left=5000, window_right=999),
        dict(causal=False, window_left=-1, window_right=-1),
    ),
    "(-1, 0) without causal is causal": (
        prefill(seqlen=1000, causal=False, window_left=-1, window_right=0),
        dict(causal=True, window_left=-1, window_right=-1),
    ),
    "a causal window: the window with a right side of 0, the causal row": (
        prefill(seqlen=32768, batch=1, window_left=4096, window_right=7, **GPT_OSS),
        dict(
            causal=False, window_left=4096, window_right=0, config=FORWARD_CONFIGS[(64, BF16, True)]
        ),
    ),
    "a short window at hdim 64: the short-window row": (
        prefill(seqlen=8192, window_left=128, **GPT_OSS),
        dict(window_left=128, window_right=0, config=SHORT_WINDOW_CONFIGS[(64, BF16)][1]),
    ),
    "a short window at hdim 128: the causal row": (
        prefill(seqlen=8192, causal=False, window_left=3, window_right=3),
        dict(window_left=3, window_right=3, config=FORWARD_CONFIGS[(128, BF16, True)]),
    ),
    "a short chunk at hdim 64: the short-window row": (
        prefill(seqlen=8192, attention_chunk=256, **GPT_OSS),
        dict(window_left=-1, window_right=0, attention_chunk=256),
    ),
    "softcap and sink are the variant's": (
        prefill(softcap=30.0, learnable_sink="float16"),
        dict(causal=True, softcap=30.0, learnable_sink="float16"),
    ),
}


@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_local_call_gets_variant(case):
    problem, fields = LOCAL_CASES[case]
    variant = func_plan(problem).variant
    for name, want in fields.items():
        assert getattr(variant, name) == want, name
    if problem.learnable_sink is not None:
        assert variant.takes_optionals


def test_windowed_decode_splits_the_visible_keys():
    """A 512 window over a 128k cache: the split heuristic counts the keys a tile's rows see
    (512 + 1 + 16 tokens of a 64-row tile packing 4 heads each), not the cache."""
    windowed = plan_forward(decode(keys=131072, causal=True, window_left=512), SMS, num_splits=0)
    assert windowed.variant.window_left == 512
    visible = plan_forward(decode(keys=512 + 1 + 16, causal=True), SMS, num_splits=0)
    whole = plan_forward(decode(keys=131072, causal=True), SMS, num_splits=0)
    assert windowed.num_splits == visible.num_splits < whole.num_splits


def test_no_keys_launch_nothing():
    plan = plan_forward(decode(kv_capacity=0, keys=0), SMS, num_splits=0)
    assert plan.variant is None


@pytest.mark.parametrize(
    "nheads, pack_gqa, packed",
    [(24, None, 1), (24, True, 1), (48, None, 1), (48, True, 2), (32, None, 4), (32, True, 4)],
)
def test_pack_gqa_groups_divide_the_tile(nheads, pack_gqa, packed):
    """pack_gqa=True folds the largest group of a kv head's q heads that divides the tile rows
    (3 q heads per kv head: none; 6: 2); None folds all of them only when they divide."""
    plan = plan_forward(decode(nheads=nheads, nheads_kv=8), SMS, pack_gqa=pack_gqa)
    assert plan.variant.config.tile_m % packed == 0
    assert plan.variant.pack_gqa_ratio == packed


def test_single_wave_boundary():
    """The static twin exactly while the tiles fit in one wave of SMs x CTAs per SM."""
    dynamic = AttentionConfig(128, 128, scheduler="dynamic_persistent")

    def scheduler(problem, config=dynamic, **kw):
        return plan_forward(problem, SMS, config, pack_gqa=kw.pop("pack_gqa", False), **kw)

    one_wave = prefill(batch=2, seqlen=1000, nheads=8)  # 8 query tiles x 8 heads x 2 = 128
    assert scheduler(one_wave).variant.config.scheduler == "static_persistent"
    assert scheduler(prefill(batch=2, seqlen=1100, nheads=8)).variant.config == dynamic  # 144
    packed = dict(nheads=16, nheads_kv=2, batch=1)  # 8 q heads per kv head folded
    assert scheduler(prefill(seqlen=1000, **packed), pack_gqa=True).variant.config != dynamic
    assert scheduler(prefill(seqlen=1100, **packed), pack_gqa=True).variant.config == dynamic
    two_ctas = dynamic.replace(tile_m=64, ctas_per_sm=2, pingpong=False)
    # 16 query tiles of 64 rows x 8 heads x 2 = 256 tiles: one wave of 2 x 132 CTAs
    assert scheduler(one_wave, two_ctas).variant.config.scheduler == "static_persistent"
    for other in ("single_tile", "static_persistent"):
        config = dynamic.replace(scheduler=other)
        assert scheduler(one_wave, config).variant.config == config


def test_split_tile_counts_for_hand_counted_shapes():
    """The host's count of a split launch's tiles (one arrival counter each) on shapes counted
    by hand from the kernel's grid; test_kvcache_gpu checks it against the kernel itself."""
    padded = decode(batch=3, nheads=32, nheads_kv=8, seqlen_q=17, keys=900)
    assert split_tiles(padded, 64, 4) == 2 * 8 * 3  # ceil(17 * 4 / 64) m-blocks
    assert split_tiles(padded, 64, 1) == 1 * 32 * 3
    varlen = decode(batch=5, seqlen_q=400, keys=900, varlen_q=True, total_q=1000)
    # every sequence's tiles flattened: ceil(1000 * 4 / 64) + one spare per sequence, per kv head
    assert split_tiles(varlen, 64, 4) == (63 + 5) * 8


def variant(**changes) -> ForwardVariant:
    base = ForwardVariant(BF16, 128, False, config=AttentionConfig(128, 128), writes_lse=False)
    return dataclasses.replace(base, **changes)


def test_variants_that_cannot_run_are_refused():
    dynamic = AttentionConfig(128, 128, scheduler="dynamic_persistent")
    refused = {
        "scheduler 'single_tile'": dict(
            split=True, config=dynamic.replace(store_o_from_registers=True)
        ),
        "store O from registers": dict(varlen_q=True),
        "exactly one of page_box_rows and gather_page_size": dict(kv_layout="paged"),
        "gathered paged K/V runs one CTA per tile": dict(
            kv_layout="paged", gather_page_size=1, config=dynamic
        ),
        "leftpad_k offsets padded cache rows or gathered pages": dict(
            kv_layout="paged", page_box_rows=16, leftpad_k=True
        ),
        "seqused_q shortens packed": dict(seqused_q=True),
        "page_box_rows must divide tile_n": dict(kv_layout="paged", page_box_rows=48),
        "exclude each other": dict(seqused_k=True, scalar_kv_length=True),
        "pack_gqa_ratio must divide the tile's rows": dict(pack_gqa_ratio=3),
        "pingpong needs two MMA warpgroups": dict(config=AttentionConfig(64, 128)),
    }
    for message, changes in refused.items():
        with pytest.raises(ValueError, match=message):
            variant(**changes)


def test_only_variants_without_optional_arguments_take_the_short_signature():
    """takes_optionals: a variant that uses any optional argument (LSE, varlen offsets, packed
    or paged K/V, seqused_k, split scratch, tile counter) takes the whole signature."""
    base = variant()
    static = base.config.replace(scheduler="static_persistent")
    assert not base.takes_optionals
    assert not variant(config=static, scalar_kv_length=True, causal=True).takes_optionals
    ragged = base.config.replace(store_o_from_registers=True)
    for changes in (
        {"writes_lse": True},
        {"varlen_q": True, "config": ragged},
        {"kv_layout": "packed"},
        {"kv_layout": "paged", "page_box_rows": 64},
        {"seqused_k": True},
        {"split": True, "config": ragged},
        {"config": base.config.replace(scheduler="dynamic_persistent")},
    ):
        assert variant(**changes).takes_optionals, changes


def test_variant_pickles_with_a_fresh_hash():
    """Variants go to compile workers by pickle; the hash is cached per process."""
    v = variant(writes_lse=True)
    clone = pickle.loads(pickle.dumps(v))
    assert clone == v and hash(clone) == hash(v) and {v: 1}[clone] == 1


def test_each_signature_is_the_kernel_method_it_names():
    """compile_cache's SHORT and FULL are read off the kernel's entry points, and the fakes
    cover every argument (compile_forward builds them by name)."""
    from flash_cute.kernels import FlashAttentionForwardSm90

    from flash_cute.compile_cache import FULL, SHORT, fake_arguments, signature

    for sig in (SHORT, FULL):
        params = list(inspect.signature(getattr(FlashAttentionForwardSm90, sig.method)).parameters)
        assert params == ["self", *sig.args, "stream"]
        assert set(sig.args) <= set(fake_arguments(variant()))
    assert set(SHORT.args) < set(FULL.args)
    assert signature(variant()) is SHORT and signature(variant(writes_lse=True)) is FULL


def test_kernel_derives_its_o_store_from_the_variant():
    """The effective config's O store reaches the kernel: through smem and TMA (its own smem
    tile when a persistent config fits one, else over Q's tile), or from registers."""
    from flash_cute.kernels import FlashAttentionForwardSm90

    cfg = AttentionConfig(192, 128, scheduler="static_persistent")
    tma = FlashAttentionForwardSm90(ForwardVariant(BF16, 64, False, config=cfg))
    assert tma.tma_store_o and tma.separate_o_smem and not tma.o_overwrites_q
    over_q_cfg = AttentionConfig(
        128, 80, pingpong=False, rescale_o_before_pv=True, scheduler="static_persistent"
    )
    over_q = FlashAttentionForwardSm90(ForwardVariant(BF16, 256, False, config=over_q_cfg))
    assert over_q.tma_store_o and over_q.o_overwrites_q
    on = cfg.replace(store_o_from_registers=True)
    for flags in ({}, {"varlen_q": True}, {"split": True, "seqused_k": True}):
        config = on.replace(scheduler="single_tile") if "split" in flags else on
        kernel = FlashAttentionForwardSm90(ForwardVariant(BF16, 64, False, config=config, **flags))
        assert not (kernel.tma_store_o or kernel.separate_o_smem or kernel.o_overwrites_q)


def test_head_dim_v_takes_its_pair_row_and_an_o_store_that_fits():
    """V's head dim rides the problem into the variant; O goes through Q's smem tile only when
    the head dims agree, so a pair without an O tile of its own stores O from registers."""
    mla = func_plan(prefill(head_dim=192, head_dim_v=128))
    assert mla.variant.head_dim_v == 128 and mla.variant.config.tile_n == 128
    assert mla.variant.describe().startswith("d192v128 ")
    # The 256 row runs one CTA per tile (no O tile of its own): O from registers.
    wide = func_plan(prefill(head_dim=256, head_dim_v=128, causal=False, seqlen=8192))
    assert wide.variant.config.scheduler == "single_tile"
    assert wide.variant.config.store_o_from_registers
    same = func_plan(prefill(head_dim=256, causal=False, seqlen=8192))
    assert not same.variant.config.store_o_from_registers and same.variant.head_dim_v == 256
    decode_mla = plan_forward(
        decode(nheads=16, nheads_kv=1, head_dim=192, head_dim_v=128), SMS, num_splits=0
    )
    assert decode_mla.variant.head_dim_v == 128 and decode_mla.variant.pack_gqa_ratio == 16
    with pytest.raises(ValueError, match="O goes through Q's smem tile only"):
        dataclasses.replace(
            wide.variant, config=wide.variant.config.replace(store_o_from_registers=False)
        )


def test_v_in_k_reads_v_from_k_columns():
    """v_in_k (V = the first head_dim_v columns of K) needs head_dim_v <= head_dim, a multiple
    of 64, and leaves the V ring out of the shared memory model."""
    config = AttentionConfig(64, 64, pingpong=False, o_split=2, store_o_from_registers=True)
    variant = ForwardVariant(
        "bfloat16", 576, False, config=config, writes_lse=True, head_dim_v=512, v_in_k=True
    )
    assert "v_in_k" in variant.describe()
    assert config.smem_bytes(576, 2, 512, v_in_k=True) == (72 + 2 * 72 + 1) * 1024
    with pytest.raises(ValueError, match="v_in_k reads V from K's columns"):
        ForwardVariant(
            "bfloat16", 128, False, config=config, writes_lse=True, head_dim_v=96, v_in_k=True
        )


FP8 = "float8_e4m3fn"


@pytest.mark.parametrize(
    "problem, fp8_math",
    [
        (prefill(head_dim=128, kv_dtype=FP8, q_dtype=FP8), True),
        (prefill(head_dim=96, causal=False, kv_dtype=FP8, q_dtype=FP8), True),
        (prefill(head_dim=256, varlen_q=True, total_q=9000, kv_layout="packed", kv_dtype=FP8,
                 q_dtype=FP8), True),
        # 16-bit math: q converted on the host.
        (prefill(head_dim=80, kv_dtype=FP8, q_dtype=FP8), False),  # not a multiple of 32
        (prefill(head_dim=192, head_dim_v=128, kv_dtype=FP8, q_dtype=FP8), False),
        (prefill(kv_layout="paged", page_size=64, kv_dtype=FP8, q_dtype=FP8), True),  # TMA
        (prefill(seqlen=8, nheads=32, nheads_kv=8, kv_dtype=FP8, q_dtype=FP8), True),  # decode
        # Pages gathered with cp.async (16 rows: TMA boxes under MIN_TMA_BOX_BYTES), left padding.
        (prefill(seqlen=1, nheads=32, nheads_kv=8, kv_layout="paged", page_size=16,
                 kv_dtype=FP8, q_dtype=FP8), True),
        (prefill(kv_layout="paged", page_size=64, leftpad_k=True, kv_dtype=FP8, q_dtype=FP8),
         True),
        (prefill(kv_dtype=FP8), False),  # 16-bit q over an FP8 cache
    ],
)  # fmt: skip
def test_fp8_queries_take_fp8_math_where_it_serves(problem, fp8_math):
    """FP8 math for FP8 calls with equal head dims, multiples of 32, prefill or decode-like,
    on padded, packed or paged keys (TMA boxes or gathered rows); the others convert q. The variant
    is valid either way (its own checks), and a caller's config keeps 16-bit math."""
    decode_rows = problem.varlen_q or problem.kv_layout == "paged" or problem.max_seqlen_q < 64
    v = plan_forward(problem, SMS, None, 1, None, decode_rows).variant
    assert (v.q_dtype == FP8) == fp8_math, v.describe()
    if fp8_math:
        assert v.config.rescale_threshold == 0 and v.config.pv_from_registers
        config = AttentionConfig(64, 64, pingpong=False, store_o_from_registers=True)
        caller = plan_forward(problem, SMS, config, 1, None, decode_rows).variant
        assert caller.q_dtype is None


def test_fp8_math_variants_that_cannot_run_are_refused():
    fp8 = AttentionConfig(128, 128, store_o_from_registers=True)
    ok = dict(kv_dtype=FP8, q_dtype=FP8, config=fp8)
    variant(**ok)
    for changes in (
        dict(head_dim_v=80, head_dim=128),
        dict(config=fp8.replace(rescale_threshold=8)),
        dict(config=fp8.replace(pv_from_registers=False)),
        dict(config=fp8.replace(tile_n=80)),
        dict(kv_dtype=None),
    ):
        with pytest.raises(ValueError):
            variant(**{**ok, **changes})


def _latent_decode(batch, nheads, seqlen_q, keys, page_size=64, qv=False, **flags) -> Problem:
    flags = {"seqused_k": True, "causal": True, **flags}
    return Problem(
        dtype="bfloat16", head_dim=576, head_dim_v=512, v_in_k=not qv, qv=qv,
        batch=batch,
        nheads=nheads, nheads_kv=1, max_seqlen_q=seqlen_q, max_seqlen_k=keys, kv_capacity=keys,
        kv_layout="paged" if page_size else "padded", page_size=page_size, **flags,
    )  # fmt: skip


# (problem, whether the seesaw kernel takes it): one list for the 16-bit cache and the FP8 one.
LATENT_ROUTES = [
    # 8-128 heads (TP shards of 128 and 64 heads) and 1-4 tokens, split or not: the seesaw.
    (_latent_decode(64, 128, 1, 8192), True),
    (_latent_decode(128, 128, 2, 4096), True),
    (_latent_decode(132, 128, 1, 16384, page_size=None), True),
    (_latent_decode(64, 128, 1, 8192, qv=True), True),
    (_latent_decode(64, 128, 1, 8192, page_size=128), True),
    (_latent_decode(8, 128, 1, 16384), True),
    (_latent_decode(1, 128, 1, 8192), True),
    (_latent_decode(32, 128, 4, 4096), True),
    (_latent_decode(64, 16, 1, 8192), True),
    (_latent_decode(64, 16, 2, 8192), True),
    (_latent_decode(16, 64, 2, 8192), True),
    (_latent_decode(16, 64, 4, 8192, page_size=None), True),
    (_latent_decode(64, 32, 1, 8192), True),
    (_latent_decode(32, 32, 3, 8192), True),
    (_latent_decode(64, 8, 1, 8192), True),
    (_latent_decode(64, 8, 4, 8192), True),
    # Varlen queries (packed, 1-4 tokens a sequence).
    (_latent_decode(64, 16, 2, 8192, varlen_q=True, total_q=96), True),
    (_latent_decode(64, 128, 4, 8192, varlen_q=True, total_q=160), True),
    (_latent_decode(64, 8, 4, 8192, page_size=None, varlen_q=True, total_q=160), False),
    # Pages no whole-block TMA box follows, unserved forms.
    (_latent_decode(64, 128, 1, 8192, page_size=16), False),
    (_latent_decode(64, 128, 1, 8192, window_left=1024), False),
    (_latent_decode(64, 128, 1, 8192, seqused_k=False), False),
    # Heads and tokens its GPU tests do not cover: 96, 24 and 256 heads, 5 tokens.
    (_latent_decode(132, 96, 1, 8192), False),
    (_latent_decode(64, 24, 1, 8192), False),
    (_latent_decode(16, 256, 1, 8192), False),
    (_latent_decode(64, 16, 5, 8192), False),
    (_latent_decode(64, 128, 5, 8192), False),
]


@pytest.mark.parametrize("problem, seesaw", LATENT_ROUTES)
def test_absorbed_mla_decode_takes_the_seesaw_kernel_where_it_wins(problem, seesaw, monkeypatch):
    from flash_cute import plan as plan_module

    plan = plan_forward(problem, 132, num_splits=0)
    assert plan.variant.config.seesaw == seesaw
    # The switch off: the forward kernel's latent path, with the same split count.
    monkeypatch.setattr(plan_module, "SEESAW_ROUTING", False)
    off = plan_forward(problem, 132, num_splits=0)
    assert not off.variant.config.seesaw and off.num_splits == plan.num_splits
    # A caller's config is taken as it is.
    assert not plan_forward(problem, 132, AttentionConfig(64, 64, pingpong=False, o_split=2,
        store_o_from_registers=True, pv_from_registers=False, split_scores=True,
        intra_wg_overlap=False), num_splits=0).variant.config.seesaw  # fmt: skip


def test_seesaw_variants_that_cannot_run_are_refused():
    from flash_cute.config import seesaw_config

    def variant(causal=True, **flags):
        fields = dict(
            config=seesaw_config(), head_dim_v=512, v_in_k=True, seqused_k=True, writes_lse=True
        )
        return ForwardVariant("bfloat16", 576, causal, **{**fields, **flags})

    assert variant().config.seesaw and variant(kv_layout="paged", page_box_rows=64)
    assert variant(varlen_q=True, kv_layout="paged", page_box_rows=64)
    fp8 = dict(kv_dtype="float8_e4m3fn", varlen_q=True, kv_layout="padded")
    assert variant(config=seesaw_config(kv_fp8=True), **fp8)
    assert variant(config=seesaw_config(kv_fp8=True, rows=32), **fp8)
    for flags, message in [
        (dict(kv_layout="paged", page_box_rows=32), "multiple of 64"),
        (dict(kv_layout="paged", gather_page_size=16), "multiple of 64"),
        (dict(seqused_k=False), "per-sequence lengths"),
        (dict(v_in_k=False), "absorbed MLA only"),
        (dict(softcap=30.0), "softcap"),
        (dict(learnable_sink="bfloat16"), "learnable_sink"),
        (dict(causal=False, window_left=128, window_right=0), "local window"),
        (dict(config=seesaw_config().replace(trace=True)), "no trace"),
        (dict(config=seesaw_config(rows=32)), "seesaw_rows 32.*FP8 latent cache only"),
    ]:
        with pytest.raises(ValueError, match=message):
            variant(**flags)


def test_fp8_latent_varlen_queries_take_tiles_of_32_rows():
    """Varlen calls whose max_seqlen_q says at most 32 rows a sequence take the transposed
    kernel, whose tiles are 32 rows (config.tile_rows): max_seqlen_q is a hint, and a longer
    sequence takes more tiles. So the arrival counters count tiles of 32 rows (one spare a
    sequence), and more rows than 32 take the seesaw."""
    from flash_cute.config import seesaw_config

    for causal in (True, False):
        call = _latent_decode(
            64, 16, 2, 8192, varlen_q=True, total_q=96, kv_dtype="float8_e4m3fn", causal=causal
        )
        plan = plan_forward(call, 132, num_splits=3)
        config = plan.variant.config
        assert config == seesaw_config(kv_fp8=True, rows=32) and config.tile_rows == 32
        assert config.tile_m == 64 and plan.variant.split
        assert plan.num_counters == math.ceil(96 * 16 / 32) + 64
        # (64 heads would fill a 64-row layout but not a tile of 32 rows)
        with pytest.raises(ValueError, match="divide the tile's rows"):
            dataclasses.replace(plan.variant, pack_gqa_ratio=64)
        wide = dataclasses.replace(call, max_seqlen_q=4)  # 64 rows a sequence
        assert plan_forward(wide, 132, num_splits=0).variant.config == seesaw_config(kv_fp8=True)
        with pytest.raises(ValueError, match="seesaw_rows 32.*at most 32 rows"):
            plan_forward(wide, 132, seesaw_config(kv_fp8=True, rows=32), 0)
    assert seesaw_config(kv_fp8=True).tile_rows == 64 == AttentionConfig(64, 64).tile_rows


def test_fp8_latent_small_tiles_hold_a_sequences_rows():
    """The transposed kernel's tiles are the fewest of 16 or 32 rows that hold a sequence's
    (q heads x max_seqlen_q; a varlen hint of 0 counts as one token, whose q heads the tile's
    rows must still take whole: pack_gqa_ratio divides tile_rows)."""
    from flash_cute.config import seesaw_config

    for nheads, seqlen_q, varlen, rows in [
        (8, 1, False, 16),
        (8, 2, False, 16),
        (16, 1, False, 16),
        (8, 4, False, 32),
        (32, 1, False, 32),
        (8, 2, True, 16),
        (16, 0, True, 16),  # (the hint 0: the API allows it)
        (32, 0, True, 32),
    ]:
        flags = dict(varlen_q=True, total_q=64) if varlen else {}
        call = _latent_decode(64, nheads, seqlen_q, 8192, kv_dtype="float8_e4m3fn", **flags)
        for num_splits in (0, 1, 2):
            plan = plan_forward(call, 132, num_splits=num_splits)
            assert plan.variant.config == seesaw_config(kv_fp8=True, rows=rows), (nheads, rows)
            assert plan.variant.pack_gqa_ratio == nheads


@pytest.mark.parametrize("problem, routed", LATENT_ROUTES)
def test_fp8_latent_cache_takes_the_seesaw_kernel_or_is_refused(problem, routed, monkeypatch):
    from flash_cute import plan as plan_module
    from flash_cute.config import seesaw_config

    fp8 = dataclasses.replace(problem, kv_dtype="float8_e4m3fn")
    if not routed or problem.qv:  # (the qv form reads 16-bit caches only)
        # The forward kernel's FP8 path takes no latent: refused, naming why, not served
        # another way.
        with pytest.raises(NotImplementedError, match="FP8 latent cache") as refusal:
            plan_forward(fp8, 132, num_splits=0)
        assert plan_module.seesaw_route_problem(fp8) in str(refusal.value)
        return
    plan, bf16 = plan_forward(fp8, 132, num_splits=0), plan_forward(problem, 132, num_splits=0)
    # Tiles of at most 32 rows take the transposed kernel (seesaw_rows 16 where they fit, else
    # 32), the rest the seesaw.
    n = problem.nheads * problem.max_seqlen_q
    rows = 16 if n <= 16 else 32 if n <= 32 else 64
    assert plan.variant.config == seesaw_config(kv_fp8=True, rows=rows) != bf16.variant.config
    assert plan_module.transposed_problem(problem) is not None  # (16-bit: the seesaw)
    monkeypatch.setattr(plan_module, "SEESAW_TRANSPOSED", False)
    assert plan_forward(fp8, 132, num_splits=0).variant.config == seesaw_config(kv_fp8=True)
    monkeypatch.undo()
    for small in (16, 32):  # a caller's transposed config for a tile it cannot hold: refused
        if n > small:
            with pytest.raises(ValueError, match=f"seesaw_rows {small}.*at most {small} rows"):
                plan_forward(fp8, 132, seesaw_config(kv_fp8=True, rows=small), 0)
    assert plan.variant.kv_dtype == "float8_e4m3fn" and plan.num_splits == bf16.num_splits
    # (the seesaw's: the register split its GPU tests ran with, kernels/mla_decode/fp8_loads.py)
    more = plan.variant.config.producer_registers > bf16.variant.config.producer_registers
    assert more == (rows == 64)
    # A caller's config: the seesaw (either register split), or refused by name.
    assert plan_forward(fp8, 132, seesaw_config(kv_fp8=True), 0).variant.config.seesaw
    # (the MMA warpgroups convert: the 16-bit cache's register split takes an FP8 one too)
    assert plan_forward(fp8, 132, seesaw_config(), 0).variant.kv_dtype == "float8_e4m3fn"
    with pytest.raises(NotImplementedError, match="config: a caller's config without seesaw"):
        plan_forward(fp8, 132, bf16.variant.config.replace(seesaw=False), 0)
    # An empty cache: no kernel (as with bf16), not a refusal.
    assert plan_forward(dataclasses.replace(fp8, kv_capacity=0), 132, num_splits=0).variant is None
    monkeypatch.setattr(plan_module, "SEESAW_ROUTING", False)
    with pytest.raises(NotImplementedError, match="SEESAW_ROUTING is off"):
        plan_forward(fp8, 132, num_splits=0)
    # The qv form reads 16-bit caches only.
    qv = dataclasses.replace(fp8, v_in_k=False, qv=True)
    assert "qv form" in qv.seesaw_problem()
