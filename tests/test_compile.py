"""Compile-only checks of every kernel variant for sm_90a (CPU; marker: compile).

Each variant of the config table must compile, and its PTX must hold WGMMA
(wgmma.mma_async), TMA loads (cp.async.bulk.tensor) and register reallocation (setmaxnreg),
with ptxas reporting zero spill bytes and not ignoring setmaxnreg.
"""

import dataclasses

import pytest

from flash_cute import AttentionConfig, decode_config
from flash_cute.compile_cache import (
    AppendKernelKey,
    CombineKernelKey,
    compile_append,
    compile_combine,
    compile_forward,
)
from flash_cute.config import FORWARD_CONFIGS, SHORT_WINDOW_CONFIGS, seesaw_config
from flash_cute.plan import ForwardVariant, Problem, plan_forward
from flash_cute.precompile import (
    compile_with_ptx_report,
    decode_variants,
    table_variants,
    wgmma_serializations,
)

pytestmark = pytest.mark.compile


def ragged(dtype, head_dim, causal, config, writes_lse, **flags) -> ForwardVariant:
    """A split or varlen variant, whose rows are ragged: its O goes from registers (the plan
    step's rule, which ForwardVariant enforces)."""
    config = config.replace(store_o_from_registers=True)
    return ForwardVariant(dtype, head_dim, causal, config=config, writes_lse=writes_lse, **flags)


# Every (head_dim, dtype, causal) row (and short-sequence row), writing the LSE (the larger
# variant), and every decode row as the KV-cache path launches it (split, GQA packed by 8).
# The static twins of dynamic rows (what single-wave problems launch) in bf16 only: the same
# code as the fp16 rows' and the static hdim-64 row.
TABLE_KEYS = [
    k
    for k in table_variants(writes_lse=(True,))
    if k.dtype == "bfloat16"
    or k.config.scheduler != "static_persistent"
    or k.config == FORWARD_CONFIGS[(k.head_dim, k.dtype, k.causal)]
] + [k for k in decode_variants(gqa_ratios=(8,), int_lengths=(False,)) if k.split and k.causal]

# Knobs off the table's path, and the no-LSE variant.
KNOB_KEYS = [
    ForwardVariant("bfloat16", 128, False, config=AttentionConfig(128, 128), writes_lse=False),
    ForwardVariant(
        "bfloat16",
        128,
        True,
        config=AttentionConfig(128, 128, intra_wg_overlap=False),
        writes_lse=True,
    ),
    ForwardVariant(
        "float16",
        128,
        False,
        config=AttentionConfig(128, 128, pv_from_registers=False, pingpong=False),
        writes_lse=True,
    ),
    ForwardVariant(
        "bfloat16", 128, True, config=AttentionConfig(128, 64, num_stages=3), writes_lse=True
    ),
    ForwardVariant(
        "bfloat16", 64, False, config=AttentionConfig(64, 128, pingpong=False), writes_lse=True
    ),
    ForwardVariant(
        "bfloat16",
        64,
        True,
        config=AttentionConfig(192, 96, intra_wg_overlap=False),
        writes_lse=True,
    ),
    ragged(
        "bfloat16",
        128,
        False,
        AttentionConfig(64, 64, num_stages=3, pingpong=False, ctas_per_sm=2),
        True,
        seqused_k=True,
        split=True,
        pack_gqa_ratio=4,
    ),
    # Persistent scheduler: O in its own smem, O over Q's tile, packed GQA on a paged cache.
    ForwardVariant(
        "bfloat16",
        128,
        True,
        config=AttentionConfig(128, 128, scheduler="dynamic_persistent"),
        writes_lse=True,
    ),
    ForwardVariant(
        "float16",
        256,
        False,
        config=AttentionConfig(
            128, 80, pingpong=False, rescale_o_before_pv=True, scheduler="static_persistent"
        ),
        writes_lse=False,
    ),
    ForwardVariant(
        "bfloat16",
        64,
        True,
        config=AttentionConfig(192, 128, intra_wg_overlap=False, scheduler="dynamic_persistent"),
        writes_lse=True,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=64,
        pack_gqa_ratio=4,
    ),
    ForwardVariant(
        "bfloat16",
        128,
        False,
        config=AttentionConfig(
            64,
            64,
            num_stages=3,
            pingpong=False,
            ctas_per_sm=2,
            scheduler="dynamic_persistent",
            mbarrier_probe=True,
        ),
        writes_lse=True,
    ),
    # An int cache_seqlens (the kernel's kv_length scalar): the decode row split on a paged cache,
    # and a padded prefill-like call on persistent CTAs.
    ragged(
        "bfloat16",
        128,
        True,
        decode_config(128, "bfloat16"),
        False,
        kv_layout="paged",
        scalar_kv_length=True,
        page_box_rows=64,
        split=True,
        pack_gqa_ratio=4,
    ),
    ForwardVariant(
        "float16",
        64,
        True,
        config=AttentionConfig(192, 128, scheduler="static_persistent"),
        writes_lse=True,
        scalar_kv_length=True,
    ),
    # Exponentials on the FMA pipe: a few (hdim 64 row) and all of them.
    ForwardVariant(
        "bfloat16",
        64,
        False,
        config=AttentionConfig(192, 128, mbarrier_probe=True, exp2_on_fma=2),
        writes_lse=False,
    ),
    ForwardVariant(
        "float16",
        128,
        True,
        config=AttentionConfig(128, 128, scheduler="dynamic_persistent", exp2_on_fma=16),
        writes_lse=True,
    ),
    # O stored from registers on a padded problem, one CTA per tile (the table's hdim-64 row is
    # static persistent).
    ForwardVariant(
        "float16",
        128,
        True,
        config=AttentionConfig(128, 128, store_o_from_registers=True),
        writes_lse=False,
    ),
    # Persistent varlen: packed, paged (GQA packed) and padded K/V; O from registers.
    ragged(
        "bfloat16",
        128,
        True,
        AttentionConfig(128, 128, scheduler="dynamic_persistent"),
        True,
        varlen_q=True,
        kv_layout="packed",
    ),
    ragged(
        "bfloat16",
        64,
        False,
        AttentionConfig(192, 128, scheduler="static_persistent"),
        True,
        varlen_q=True,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=64,
        pack_gqa_ratio=4,
    ),
    ragged(
        "float16",
        256,
        True,
        AttentionConfig(
            128, 80, pingpong=False, rescale_o_before_pv=True, scheduler="dynamic_persistent"
        ),
        True,
        varlen_q=True,
        kv_layout="padded",
        seqused_k=True,
    ),
    # FlashAttention-3's cache options: cache rows picked by index and left-padded (split decode
    # with an int length), a paged cache's table rows picked by index, and varlen queries
    # shortened by seqused_q over packed keys shortened by seqused_k.
    ragged(
        "bfloat16",
        128,
        True,
        decode_config(128, "bfloat16"),
        True,
        scalar_kv_length=True,
        kv_batch_idx=True,
        leftpad_k=True,
        split=True,
        pack_gqa_ratio=4,
    ),
    ragged(
        "float16",
        128,
        False,
        decode_config(128, "float16"),
        False,
        kv_layout="paged",
        seqused_k=True,
        kv_batch_idx=True,
        page_box_rows=16,
        pack_gqa_ratio=8,
    ),
    ragged(
        "bfloat16",
        64,
        True,
        AttentionConfig(192, 128, scheduler="dynamic_persistent"),
        True,
        varlen_q=True,
        seqused_q=True,
        kv_layout="packed",
        seqused_k=True,
    ),
    # Paged K/V gathered with cp.async (pages no TMA box follows, left-padded pages): the
    # split decode row at page size 1, and a prefill row over left-padded pages of 24.
    ragged(
        "bfloat16",
        128,
        True,
        decode_config(128, "bfloat16"),
        True,
        kv_layout="paged",
        seqused_k=True,
        gather_page_size=1,
        split=True,
        pack_gqa_ratio=4,
    ),
    ForwardVariant(
        "float16",
        96,
        True,
        config=AttentionConfig(128, 128),
        writes_lse=True,
        kv_layout="paged",
        seqused_k=True,
        leftpad_k=True,
        gather_page_size=24,
    ),
    # Varlen queries over cache rows picked by index and left-padded pages (FlashAttention-3's
    # kvcache with cu_seqlens_q, cache_batch_idx and cache_leftpad), split.
    ragged(
        "bfloat16",
        128,
        True,
        decode_config(128, "bfloat16"),
        True,
        varlen_q=True,
        kv_layout="paged",
        seqused_k=True,
        kv_batch_idx=True,
        leftpad_k=True,
        gather_page_size=64,
        split=True,
        pack_gqa_ratio=4,
    ),
]


# The split-KV, paged, varlen and packed-GQA variants (decode configs and prefill configs).
_DECODE_128 = decode_config(128, "bfloat16")
SPLITKV_KEYS = [
    ragged("bfloat16", 128, False, _DECODE_128, True, seqused_k=True, split=True, pack_gqa_ratio=4),
    ragged(
        "bfloat16",
        128,
        True,
        _DECODE_128,
        True,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=16,
        split=True,
        pack_gqa_ratio=8,
    ),
    ForwardVariant(
        "float16",
        64,
        True,
        config=decode_config(64, "float16"),
        writes_lse=True,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=64,
        pack_gqa_ratio=16,
    ),
    ragged(
        "bfloat16", 256, False, decode_config(256, "bfloat16"), True, seqused_k=True, split=True
    ),
    ragged(
        "bfloat16", 128, True, AttentionConfig(128, 128), True, varlen_q=True, kv_layout="packed"
    ),
    ragged(
        "bfloat16",
        128,
        True,
        AttentionConfig(128, 128),
        True,
        varlen_q=True,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=32,
        split=True,
    ),
    # The table's rows as varlen and KV-cache prefill calls run them (persistent schedulers).
    ragged(
        "bfloat16",
        96,
        False,
        FORWARD_CONFIGS[(96, "bfloat16", False)],
        False,
        varlen_q=True,
        kv_layout="padded",
        seqused_k=True,
        pack_gqa_ratio=4,
    ),
    ragged(
        "float16",
        192,
        False,
        FORWARD_CONFIGS[(192, "float16", False)],
        True,
        varlen_q=True,
        kv_layout="packed",
    ),
    ForwardVariant(
        "bfloat16",
        64,
        False,
        config=FORWARD_CONFIGS[(64, "bfloat16", False)],
        writes_lse=False,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=64,
        pack_gqa_ratio=4,
    ),
]


# Local masks, softcap and sinks: the short-window row (3 CTAs per SM), the causal rows with
# a long window and a sink, softcap at hdim 256, P through smem with a window and a chunk, a
# windowed split decode with a sink, a chunked varlen call.
LOCAL_KEYS = [
    ForwardVariant(
        "bfloat16",
        64,
        False,
        config=SHORT_WINDOW_CONFIGS[(64, "bfloat16")][1],
        writes_lse=True,
        window_left=128,
        window_right=0,
    ),
    ForwardVariant(
        "bfloat16",
        64,
        False,
        config=FORWARD_CONFIGS[(64, "bfloat16", True)],
        writes_lse=True,
        window_left=4096,
        window_right=0,
        learnable_sink="float32",
    ),
    ForwardVariant(
        "float16",
        256,
        True,
        config=FORWARD_CONFIGS[(256, "float16", True)],
        writes_lse=True,
        softcap=50.0,
    ),
    ForwardVariant(
        "bfloat16",
        96,
        False,
        config=FORWARD_CONFIGS[(96, "bfloat16", True)],
        writes_lse=True,
        window_left=3,
        window_right=3,
        attention_chunk=128,
    ),
    ragged(
        "bfloat16",
        128,
        False,
        _DECODE_128,
        True,
        kv_layout="paged",
        seqused_k=True,
        page_box_rows=16,
        split=True,
        pack_gqa_ratio=8,
        window_left=4096,
        learnable_sink="bfloat16",
        softcap=30.0,
    ),
    ragged(
        "bfloat16",
        128,
        False,
        FORWARD_CONFIGS[(128, "bfloat16", True)],
        True,
        varlen_q=True,
        kv_layout="packed",
        window_right=0,
        attention_chunk=8192,
    ),
]


# V head dims other than q's (MLA prefill 192 / 128, and wider V than Q), as the plan step
# builds them: the prefill rows of each pair (O through its own smem tile, or from registers),
# split decode over a paged cache (TMA boxes, and rows gathered at page size 1) with packed
# GQA, and varlen queries over packed keys.
def _mla(head_dim, head_dim_v, causal=True, **problem):
    kind = problem.pop("kind", "prefill")
    base = dict(
        batch=2,
        nheads=16,
        nheads_kv=16,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=problem.pop("dtype", "bfloat16"),
        max_seqlen_q=4096,
        max_seqlen_k=4096,
        kv_capacity=4096,
        causal=causal,
        writes_lse=True,
    )
    if kind == "decode":
        base.update(nheads_kv=1, max_seqlen_q=1, max_seqlen_k=8192, kv_capacity=8192)
        base.update(seqused_k=True, kv_layout="paged")
    base.update(problem)
    plan = plan_forward(Problem(**base), 132, None, 0 if kind == "decode" else 1, None)
    return plan.variant


MLA_KEYS = [
    _mla(192, 128),
    _mla(192, 128, False, dtype="float16"),
    _mla(64, 256),
    _mla(256, 128, False, max_seqlen_q=8192, max_seqlen_k=8192, kv_capacity=8192),
    _mla(192, 128, False, kind="decode", page_size=64),
    _mla(64, 256, False, kind="decode", page_size=1),
    _mla(128, 64, varlen_q=True, total_q=4096, kv_layout="packed", seqused_k=True),
    # FlashAttention-3's qv at its other pairs (q's head dim <= 64, v's 256-512): prefill and
    # paged decode, the kernels' head dim d + dv.
    _mla(64 + 256, 256, qv=True, nheads_kv=4),
    _mla(64 + 384, 384, False, kind="decode", page_size=64, qv=True),
    _mla(64 + 256, 256, kind="decode", page_size=1, qv=True, dtype="float16"),
]


# O split across two warpgroups along V's head dim (o_split=2): V head dims above 256 (absorbed
# MLA's 512, Gemma 4's 512 / 512).
_O_SPLIT = dict(pingpong=False, o_split=2, store_o_from_registers=True)
_SPLIT_SCORES = dict(_O_SPLIT, pv_from_registers=False, split_scores=True)


def _latent(dtype, causal, knobs, ratio=64, **flags) -> ForwardVariant:
    """An absorbed-MLA decode variant over a paged latent cache (64-key blocks, LSE written)."""
    config = AttentionConfig(64, 64, **knobs)
    return ragged(
        dtype, 576, causal, config, True, kv_layout="paged", seqused_k=True,
        pack_gqa_ratio=ratio, head_dim_v=512, v_in_k=True, **flags,
    )  # fmt: skip


O_SPLIT_KEYS = [
    ForwardVariant(
        "bfloat16",
        64,
        True,
        config=AttentionConfig(64, 64, **_O_SPLIT),
        writes_lse=True,
        head_dim_v=512,
    ),
    ForwardVariant(
        "float16",
        512,
        True,
        config=AttentionConfig(64, 32, **_O_SPLIT),
        writes_lse=True,
        head_dim_v=512,
    ),
    ragged(
        "bfloat16",
        128,
        False,
        AttentionConfig(64, 128, **_O_SPLIT),
        True,
        kv_layout="paged",
        seqused_k=True,
        gather_page_size=1,
        split=True,
        pack_gqa_ratio=16,
        head_dim_v=256,
    ),
    # Absorbed MLA decode: q and a latent cache 576 wide, V its first 512 columns read from
    # K's stages (v_in_k); FlashMLA's form, or FlashAttention-3's qv form (Q's tile is qv then
    # q, K's v_cache then k_cache). 64 of a kv head's q heads per tile, split (batch 1's merged
    # by the combine kernel), over pages of 64 (TMA) or gathered rows (varlen, left-padded).
    _latent("bfloat16", False, _O_SPLIT, split=True, combine_launch=True, page_box_rows=64),
    _latent("float16", True, _O_SPLIT, split=True, leftpad_k=True, gather_page_size=1, ratio=32),
    _latent(
        "bfloat16", False, _O_SPLIT, split=True, combine_launch=True, page_box_rows=64, qv=True
    ),
    _latent("float16", True, _O_SPLIT, varlen_q=True, gather_page_size=1, ratio=16, qv=True),
    # split_scores: each warpgroup the scores of half of each key block, P through smem.
    ForwardVariant(
        "float16",
        512,
        True,
        config=AttentionConfig(64, 32, **_SPLIT_SCORES),
        writes_lse=True,
        head_dim_v=512,
    ),
    ForwardVariant(
        "bfloat16",
        64,
        False,
        config=AttentionConfig(64, 64, **_SPLIT_SCORES),
        writes_lse=True,
        head_dim_v=512,
    ),
    _latent("bfloat16", True, _SPLIT_SCORES, split=True, combine_launch=True, page_box_rows=64),
    _latent("float16", True, _SPLIT_SCORES, varlen_q=True, gather_page_size=1, ratio=16, qv=True),
    # Without the intra-warpgroup overlap (the latent rows' default: the next load starts
    # under this block's Q K^T instead of after its P V), split and repeated scores.
    _latent(
        "bfloat16",
        True,
        dict(_SPLIT_SCORES, intra_wg_overlap=False),
        split=True,
        combine_launch=True,
        page_box_rows=64,
    ),
    _latent(
        "float16",
        True,
        dict(_O_SPLIT, intra_wg_overlap=False),
        varlen_q=True,
        gather_page_size=1,
        ratio=16,
        qv=True,
    ),
    # V in K's columns at a served pair (256 / 128): the K ring alone.
    ForwardVariant(
        "bfloat16",
        256,
        True,
        config=AttentionConfig(
            128, 64, pingpong=False, rescale_o_before_pv=True, store_o_from_registers=True
        ),
        writes_lse=True,
        head_dim_v=128,
        v_in_k=True,
    ),
]


# The absorbed-MLA decode kernel (config.seesaw, kernels/mla_decode/): both call forms, padded
# and paged, unsplit, split with the merge in the kernel and with the combine kernel, padded
# and varlen queries.
def _seesaw(dtype, causal, kv_layout="paged", **flags) -> ForwardVariant:
    return ragged(
        dtype, 576, causal, seesaw_config(), True, kv_layout=kv_layout, seqused_k=True,
        pack_gqa_ratio=64, head_dim_v=512, v_in_k=True, **flags,
    )  # fmt: skip


SEESAW_KEYS = [
    _seesaw("bfloat16", True, page_box_rows=64),
    _seesaw("float16", False, kv_layout="padded", split=True),
    _seesaw("bfloat16", True, page_box_rows=64, split=True, combine_launch=True, qv=True),
    _seesaw("bfloat16", True, page_box_rows=64, split=True, varlen_q=True),
]


# ... and on an FP8 latent cache (kernels/mla_decode/fp8_loads.py): the non-causal variant
# compiles clean; in the causal one the MMA warps (232 registers, converting the halves they
# read first) spill a little, held to FP8_SEESAW_SPILL_BYTES (PERF_NOTES "Wide heads
# and MLA").
def _fp8_seesaw(dtype, causal, kv_layout="paged", config=None, **flags) -> ForwardVariant:
    return ragged(
        dtype, 576, causal, config or seesaw_config(kv_fp8=True), True, kv_layout=kv_layout,
        seqused_k=True, pack_gqa_ratio=16, head_dim_v=512, v_in_k=True,
        kv_dtype="float8_e4m3fn", **flags,
    )  # fmt: skip


FP8_SEESAW_KEYS = [
    _fp8_seesaw("bfloat16", False, page_box_rows=64, split=True, combine_launch=True),
    # A caller's 16-bit split (24 / 240), which the plan takes for an FP8 cache too.
    _fp8_seesaw("float16", True, kv_layout="padded", config=seesaw_config()),
]
# ... and its transposed form (seesaw_rows 16 or 32: kernels/mla_decode/transposed.py) for tiles of
# at most 32 rows: these bf16 and fp16 q, unsplit and split variants compile clean; the rest
# of its (causal, layout, split, q dtype) grid spills a little at 240 registers (0-40 bytes,
# which variant moving with any change), held to the same bound.
TRANSPOSED_KEYS = [
    _fp8_seesaw("bfloat16", False, kv_layout="padded", config=seesaw_config(True, rows=32)),
    _fp8_seesaw(
        "bfloat16", False, page_box_rows=64, split=True, combine_launch=True,
        config=seesaw_config(True, rows=32),
    ),
    _fp8_seesaw("float16", False, kv_layout="padded", config=seesaw_config(True, rows=32)),
    # Tiles of 16 rows (plan.transposed_rows): the WGMMAs' N 16; 8 heads of two tokens a tile.
    _fp8_seesaw(
        "bfloat16", True, kv_layout="padded", split=True, combine_launch=True,
        config=seesaw_config(True, rows=16),
    ),
    dataclasses.replace(
        _fp8_seesaw(
            "bfloat16", True, page_box_rows=64, varlen_q=True, split=True,
            config=seesaw_config(True, rows=16),
        ),
        pack_gqa_ratio=8,
    ),
]  # fmt: skip
TRANSPOSED_GRID_KEYS = [
    key
    for key in (
        _fp8_seesaw(
            dtype,
            causal,
            config=seesaw_config(True, rows=32),
            **(dict(page_box_rows=64) if paged else dict(kv_layout="padded")),
            **(dict(split=True, combine_launch=True) if split else {}),
        )
        for causal in (False, True)
        for paged in (False, True)
        for split in (False, True)
        for dtype in ("bfloat16", "float16")
    )
    if key not in TRANSPOSED_KEYS
]
# Varlen queries: the seesaw, and the transposed kernel (tiles of 32 rows, config.tile_rows)
# with the split merge in the kernel.
VARLEN_FP8_KEYS = [
    _fp8_seesaw("bfloat16", False, page_box_rows=64, varlen_q=True, split=True),
    _fp8_seesaw(
        "bfloat16", True, page_box_rows=64, varlen_q=True, split=True,
        config=seesaw_config(True, rows=32),
    ),
]  # fmt: skip
FP8_SEESAW_CAUSAL_KEYS = [_fp8_seesaw("float16", True, kv_layout="padded")]
FP8_SEESAW_SPILL_BYTES = 64  # stores and loads (measured 16; the transposed grid 0-40)


# Traced variants (AttentionConfig.trace): one CTA per tile, persistent, split with the merge
# in the kernel, varlen.
TRACE_KEYS = [
    ForwardVariant(
        "bfloat16", 128, True, config=AttentionConfig(128, 128, trace=True), writes_lse=True
    ),
    ForwardVariant(
        "bfloat16", 128, True, writes_lse=True,
        config=AttentionConfig(128, 128, scheduler="dynamic_persistent", trace=True),
    ),
    ragged(
        "bfloat16", 128, True, _DECODE_128.replace(trace=True), True, seqused_k=True,
        split=True, pack_gqa_ratio=4,
    ),
    ragged("bfloat16", 128, True, AttentionConfig(128, 128, trace=True), True, varlen_q=True),
]  # fmt: skip


def _id(variant):
    c = variant.config
    knobs = (
        f"st{c.num_stages}-rs{int(c.pv_from_registers)}-ov{int(c.intra_wg_overlap)}"
        f"-pp{int(c.pingpong)}"
        + (f"-fmaexp{c.exp2_on_fma}" if c.exp2_on_fma else "")
        + ("-oregs" if c.store_o_from_registers else "")
        + ("-probe" if c.mbarrier_probe else "")
        + (f"-osplit{c.o_split}" if c.o_split > 1 else "")
        + ("-trace" if c.trace else "")
        + ("-splitscores" if c.split_scores else "")
        + (f"-rows{c.seesaw_rows}" if c.seesaw_rows != 64 else "")
    )
    return variant.describe().replace(" ", "-") + "-" + knobs


def _planned(head_dim, dtype="bfloat16", seqlen_q=1, keys=4096, nheads=8, nheads_kv=8, **kw):
    """The variant the plan step picks (table rows, heuristics) for one call's problem."""
    problem = Problem(
        batch=kw.pop("batch", 2), nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, max_seqlen_q=seqlen_q, max_seqlen_k=keys, kv_capacity=keys, **kw,
    )  # fmt: skip
    return plan_forward(problem, 132, None, 0, None, True).variant


# Head dims without a table row of their own (multiples of 16 up to 256), on the rows of the
# next larger ones: prefill, paged decode (TMA boxes and gathered rows), varlen, pairs.
ODD_HEAD_DIM_KEYS = [
    _planned(80, seqlen_q=4096, causal=True),
    _planned(16, "float16", seqlen_q=2048, keys=2048),
    _planned(144, "float16", seqlen_q=4096, causal=True, writes_lse=True),
    _planned(112, nheads=32, kv_layout="paged", page_size=16, seqused_k=True, causal=True),
    _planned(80, nheads=32, kv_layout="paged", page_size=1, seqused_k=True, writes_lse=True),
    _planned(48, seqlen_q=300, varlen_q=True, total_q=500, causal=True),
    _planned(208, seqlen_q=4096, head_dim_v=128, causal=True),
    _planned(256, "float16", seqlen_q=4096, head_dim_v=80),
]


# FP8 caches (kernels/kv_dequant.py), as the plan step picks them: split paged decode, fp16
# prefill, varlen over small pages with the masks, a V head dim of its own, an odd head dim.
FP8_KEYS = [
    _planned(128, nheads=32, kv_layout="paged", page_size=64, seqused_k=True, causal=True,
             kv_dtype="float8_e4m3fn"),
    _planned(64, "float16", seqlen_q=1000, keys=1000, causal=True, kv_dtype="float8_e4m3fn"),
    _planned(256, nheads=16, nheads_kv=4, seqlen_q=17, keys=512, varlen_q=True, total_q=40,
             kv_layout="paged", page_size=16, seqused_k=True, softcap=30.0, window_left=100,
             learnable_sink="bfloat16", causal=True, kv_dtype="float8_e4m3fn"),
    _planned(192, nheads=16, nheads_kv=16, head_dim_v=128, kv_dtype="float8_e4m3fn"),
    _planned(80, nheads=32, kv_dtype="float8_e4m3fn", writes_lse=True),
    # Gathered pages: SGLang's page size 1 in a split decode, left-padded pages of 24 in a
    # prefill at the widest head dim.
    _planned(128, nheads=32, kv_layout="paged", page_size=1, seqused_k=True, causal=True,
             keys=32768, kv_dtype="float8_e4m3fn"),
    _planned(256, nheads=16, nheads_kv=4, seqlen_q=300, keys=2048, kv_layout="paged",
             page_size=24, seqused_k=True, leftpad_k=True, causal=True,
             kv_dtype="float8_e4m3fn"),
]  # fmt: skip


# FP8 math (FP8 q, k and v in e4m3 GEMMs, V transposed in smem: kernels/v_transpose.py), as
# the plan step picks it: each key block width (128, and 64 above head dim 128), masks,
# sinks and softcap over packed keys, the split the heuristic picks, GQA packing.
_FP8 = dict(kv_dtype="float8_e4m3fn", q_dtype="float8_e4m3fn")
FP8_MATH_KEYS = [
    _planned(128, seqlen_q=8192, keys=8192, writes_lse=True, **_FP8),
    _planned(64, "float16", seqlen_q=1000, keys=1000, causal=True, **_FP8),
    _planned(256, nheads=16, nheads_kv=4, seqlen_q=4096, keys=4096, causal=True, **_FP8),
    _planned(96, nheads=16, nheads_kv=2, seqlen_q=300, varlen_q=True, total_q=600,
             kv_layout="packed", softcap=30.0, window_left=100, learnable_sink="bfloat16",
             writes_lse=True, **_FP8),
    _planned(192, nheads=8, nheads_kv=8, seqlen_q=256, keys=16384, causal=True, **_FP8),
    # Decode steps (one MMA warpgroup, 64-key blocks): split over a padded cache; speculative
    # tokens over TMA pages with the masks and sinks; the widest head dim with the LSE.
    _planned(128, nheads=32, keys=32768, causal=True, **_FP8),
    _planned(64, nheads=16, nheads_kv=2, seqlen_q=4, keys=8192, varlen_q=True, total_q=40,
             kv_layout="paged", page_size=128, seqused_k=True, causal=True,
             learnable_sink="bfloat16", softcap=30.0, window_left=500, **_FP8),
    _planned(256, nheads=8, nheads_kv=1, keys=8192, writes_lse=True, **_FP8),
    # Gathered pages: SGLang's page 1 in a split decode, a prefill over left-padded pages of
    # 16 (two MMA warpgroups beside the gathering warps).
    _planned(128, nheads=32, kv_layout="paged", page_size=1, seqused_k=True, causal=True,
             keys=32768, **_FP8),
    _planned(128, nheads=8, nheads_kv=2, seqlen_q=300, keys=2048, kv_layout="paged",
             page_size=16, seqused_k=True, leftpad_k=True, causal=True, **_FP8),
]  # fmt: skip


def test_fp8_math_keys_are_fp8_math():
    """(The plan gives each of these shapes the FP8-math kernel, a split to the long ones, and
    the decode rows one MMA warpgroup.)"""
    assert all(key.q_dtype == "float8_e4m3fn" for key in FP8_MATH_KEYS)
    assert FP8_MATH_KEYS[4].split and FP8_MATH_KEYS[5].split
    assert [key.config.tile_m for key in FP8_MATH_KEYS[5:]] == [64] * 4 + [128]
    # Prefill tiles by head dim (config.fp8_math_config): 64, up to 128, above.
    tiles = [(key.head_dim, key.config.tile_m, key.config.tile_n) for key in FP8_MATH_KEYS[:5]]
    assert tiles == [
        (128, 128, 192),
        (64, 192, 128),
        (256, 128, 96),
        (96, 128, 192),
        (192, 128, 96),
    ]
    assert all(key.gather_page_size for key in FP8_MATH_KEYS[8:])


@pytest.mark.parametrize(
    "key",
    TABLE_KEYS
    + KNOB_KEYS
    + SPLITKV_KEYS
    + LOCAL_KEYS
    + MLA_KEYS
    + O_SPLIT_KEYS
    + ODD_HEAD_DIM_KEYS
    + TRACE_KEYS
    + FP8_KEYS
    + FP8_MATH_KEYS
    + SEESAW_KEYS
    + FP8_SEESAW_KEYS
    + TRANSPOSED_KEYS,
    ids=_id,
)
def test_variant_compiles_clean(key):
    report = compile_with_ptx_report(key)
    assert not report.problems(), report.problems()
    assert report.target == "sm_90a" and report.instruction_counts["wgmma.mma_async"] > 0


def test_ptx_report_names_serialized_wgmmas():
    """ptxas 13's notes (as a compile with WGMMAs in flight across a loop's turn printed them)
    reach problems(): a serialized mainloop compiles and runs correctly, only slower."""
    report = (
        "ptxas info    : (C7517) wgmma.wait_group is injected in around line 4196 by compiler to"
        " allow use of registers defined by GMMA in function 'kernel_x'\n"
        "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are"
        " serialized due to non wgmma instructions defining input registers of a wgmma between"
        " start and end of the pipeline stage in the function 'kernel_x' in line 0\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
    )
    notes = wgmma_serializations(report)
    assert [note.split()[0] for note in notes] == ["C7513", "C7517"], notes
    assert "defining input registers" in notes[0] and "kernel_x" not in notes[0]
    assert wgmma_serializations("ptxas info    : Used 168 registers, used 16 barriers") == ()
    # A note without the function's name ends at its line.
    assert wgmma_serializations("(C7599) wgmma.mma_async foo\nptxas info : Used 168") == (
        "C7599 wgmma.mma_async foo",
    )


@pytest.mark.parametrize(
    "key", FP8_SEESAW_CAUSAL_KEYS + TRANSPOSED_GRID_KEYS + VARLEN_FP8_KEYS, ids=_id
)
def test_fp8_latent_variants_compile_within_their_spills(key):
    report = compile_with_ptx_report(key)
    assert report.spill_bytes <= FP8_SEESAW_SPILL_BYTES, report.problems()
    others = [p for p in report.problems() if "spill" not in p]
    assert not others and report.instruction_counts["wgmma.mma_async"] > 0, others


@pytest.mark.parametrize(
    "key",
    [
        CombineKernelKey("bfloat16", 128, True),
        CombineKernelKey("float32", 96, False),
        CombineKernelKey("float16", 256, True),
        CombineKernelKey("bfloat16", 512, False),
        CombineKernelKey("bfloat16", 512, True, trace=True),
    ],
    ids=str,
)
def test_combine_compiles(key, tmp_path):
    compile_combine(key, options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ".target sm_90a" in ptx
    assert "ld.global.v4" in ptx, "partial O is not read with 16-byte loads"


@pytest.mark.parametrize(
    "key",
    [
        AppendKernelKey("bfloat16", 128, 128),
        AppendKernelKey("bfloat16", 128, 128, "bfloat16", 128, per_row=True,
                        rotary_dtype="bfloat16", paged=True),
        AppendKernelKey("float16", 64, 64, "float16", 32, True, rotary_dtype="float32",
                        lengths=False, varlen_new=True, batch_idx=True, varlen_q=True,
                        rotary_seqlens=True),
        # An FP8 cache; the latent cache's wide rows.
        AppendKernelKey("float8_e4m3fn", 128, 128, paged=True),
        # Behind a dependent attention launch: no lengths written.
        AppendKernelKey("bfloat16", 128, 128, "bfloat16", 128, rotary_dtype="bfloat16",
                        new_lengths=False),
        # FP8 rotation: FlashAttention-3's FP8 forms (FP8 cache, queries or tables).
        AppendKernelKey("float8_e4m3fn", 128, 128, "float8_e4m3fn", 128, per_row=True,
                        rotary_dtype="float8_e4m3fn"),
        AppendKernelKey("bfloat16", 64, 64, "float8_e4m3fn", 32, True, rotary_dtype="bfloat16"),
        AppendKernelKey("bfloat16", 64, 512, paged=True),
    ],
    ids=str,
)  # fmt: skip
def test_append_compiles(key, tmp_path):
    compile_append(key, options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ".target sm_90a" in ptx
    # (the attention launch behind it may start at once: an after_append variant)
    assert "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize(
    "layout, batch, keys, waits",
    [("padded", 1, 8192, 3), ("paged", 1, 8192, 3), ("padded", 16, 65536, 0)],
)
def test_after_append_variants_wait_for_the_append(layout, batch, keys, waits, tmp_path):
    """The decode variants behind an append (kv_append's kernel) compile clean; a split one
    (a programmatically dependent launch) waits for the append's writes before the tail
    block, before Q and at the end, one of a tile per (batch, kv head) nowhere."""
    problem = Problem(
        batch=batch, nheads=32, nheads_kv=8, head_dim=128, dtype="bfloat16", max_seqlen_q=1,
        max_seqlen_k=keys, kv_capacity=keys, seqused_k=True, kv_layout=layout,
        page_size=64 if layout == "paged" else None, causal=True, after_append=True,
    )  # fmt: skip
    variant = plan_forward(problem, 132, None, 0, None, True).variant
    assert variant.after_append and variant.split == (waits > 0)
    report = compile_with_ptx_report(variant)
    assert not report.problems(), report.problems()
    compile_forward(variant, options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ptx.count("griddepcontrol.wait") == waits


@pytest.mark.parametrize(
    "batch, keys, rotary_dim, interleaved, per_row, page_size",
    [
        (1, 8192, 128, False, True, None),
        (16, 65536, 64, True, False, None),
        (1, 8192, 0, False, False, None),
        (1, 8192, 128, True, True, 64),  # TMA boxes of pages
        (8, 4096, 128, False, True, 1),  # gathered rows
        # Few producer registers: rows written a piece at a time (no spills).
        (2, 4096, 128, False, True, "d256 prefill"),
    ],
)
def test_fused_append_variants_compile(
    batch, keys, rotary_dim, interleaved, per_row, page_size, tmp_path
):
    """The decode variants that append themselves (kv_append.fuses) compile clean: their
    loading warp's stores reach its TMA loads through a proxy fence, and nothing waits for a
    launch before them."""
    rotary = dict(rotary_dim=rotary_dim, rotary_interleaved=interleaved, rotary_per_row=per_row)
    prefill = page_size == "d256 prefill"
    page_size = None if prefill else page_size
    problem = Problem(
        batch=batch, nheads=32, nheads_kv=8, head_dim=256 if prefill else 128,
        dtype="bfloat16", max_seqlen_q=512 if prefill else 1, max_seqlen_k=keys,
        kv_capacity=keys, seqused_k=True, causal=True, after_append=True, fused_append=True,
        rotary_dtype="bfloat16" if rotary_dim else None, **rotary,
        kv_layout="paged" if page_size else "padded", page_size=page_size,
    )  # fmt: skip
    variant = plan_forward(problem, 132, None, 0, None, True).variant
    assert variant.fused_append and variant.rotary_dim == rotary_dim
    report = compile_with_ptx_report(variant)
    assert not report.problems(), report.problems()
    compile_forward(variant, options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert "fence.proxy.async.global" in ptx and "griddepcontrol" not in ptx
