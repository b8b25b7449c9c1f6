"""The config table and the override check (CPU)."""

import pytest

from flash_cute import (
    DECODE_CONFIGS,
    FORWARD_CONFIGS,
    SHORT_SEQUENCE_CONFIGS,
    AttentionConfig,
    decode_config,
    default_config,
)
from flash_cute.config import (
    MAX_SMEM_BYTES_PER_BLOCK,
    PAIR_CONFIGS,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    fp8_math_config,
)


def test_table_covers_every_problem():
    for head_dim in SUPPORTED_HEAD_DIMS:
        for dtype in SUPPORTED_DTYPES:
            for causal in (False, True):
                assert (head_dim, dtype, causal) in FORWARD_CONFIGS


@pytest.mark.parametrize("key", sorted(FORWARD_CONFIGS, key=str), ids=str)
def test_table_entries_are_valid(key):
    head_dim, dtype, causal = key
    config = FORWARD_CONFIGS[key]
    assert config.validate(head_dim, dtype) is config
    assert config.smem_bytes(head_dim) <= MAX_SMEM_BYTES_PER_BLOCK
    assert default_config(head_dim, dtype, causal) is config


@pytest.mark.parametrize("head_dim_v", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_head_dim_pair_has_a_valid_row(head_dim, head_dim_v):
    """V's head dim may differ from q's (MLA): every pair's prefill, short-sequence and decode
    rows fit it (shared memory for Q, K by head_dim and V, O by head_dim_v; O's registers)."""
    for dtype in SUPPORTED_DTYPES:
        for causal in (False, True):
            for seqlen_q in (None, 512):
                config = default_config(head_dim, dtype, causal, seqlen_q, head_dim_v=head_dim_v)
                assert config.validate(head_dim, dtype, head_dim_v) is config
        config = decode_config(head_dim, dtype, head_dim_v)
        assert config.validate(head_dim, dtype, head_dim_v) is config


def test_pair_rows_and_pair_model():
    # DeepSeek V3 prefill (192 / 128): its own row, FlashAttention-3's 128 x 128 tile.
    assert (
        default_config(192, "bfloat16", True, head_dim_v=128)
        == PAIR_CONFIGS[(192, 128, "bfloat16", True)]
    )
    assert default_config(192, "bfloat16", True, head_dim_v=128).tile_n == 128
    # Shared memory: Q and K by head_dim, V by head_dim_v; O's registers by head_dim_v.
    c = AttentionConfig(128, 128, store_o_from_registers=True)
    assert c.smem_bytes(192, 2, 128) == (48 + 96 + 64 + 1) * 1024
    assert c.accumulator_registers(192, 128) == 64 + 64 + 32
    with pytest.raises(ValueError, match=r"head_dim_v \(v's head dim\) must be a multiple of 16"):
        c.validate(128, "bfloat16", 72)


def test_register_split_defaults_follow_warpgroups():
    assert (
        AttentionConfig(64, 128).producer_registers,
        AttentionConfig(64, 128).mma_registers,
    ) == (56, 256)
    assert (
        AttentionConfig(128, 128).producer_registers,
        AttentionConfig(128, 128).mma_registers,
    ) == (24, 240)
    assert (
        AttentionConfig(192, 128).producer_registers,
        AttentionConfig(192, 128).mma_registers,
    ) == (32, 160)
    assert AttentionConfig(128, 128).num_threads == 384
    changed = AttentionConfig(128, 128).replace(tile_m=192)
    assert (changed.producer_registers, changed.mma_registers) == (32, 160)


def test_smem_estimate_matches_layout():
    # hdim 128, 128 x 128, 2 stages: Q 32 KB + K 64 KB + V 64 KB + one 1 KB barrier block.
    assert AttentionConfig(128, 128).smem_bytes(128) == (32 + 64 + 64 + 1) * 1024
    # P through smem adds tile_m x tile_n x 2 bytes.
    assert (
        AttentionConfig(128, 128, pv_from_registers=False).smem_bytes(128)
        == (32 + 64 + 64 + 32 + 1) * 1024
    )
    # Persistent CTAs give O its own tile when it fits, unless O is stored from registers.
    persistent = AttentionConfig(128, 128, scheduler="static_persistent")
    assert (
        persistent.separate_o_smem(128)
        and persistent.smem_bytes(128) == (32 + 32 + 64 + 64 + 1) * 1024
    )
    from_registers = persistent.replace(store_o_from_registers=True)
    assert (
        not from_registers.separate_o_smem(128)
        and from_registers.smem_bytes(128) == (32 + 64 + 64 + 1) * 1024
    )


@pytest.mark.parametrize(
    "kwargs, head_dim, message",
    [
        (dict(tile_m=128, tile_n=72), 128, "multiple of 16"),
        (dict(tile_m=128, tile_n=272), 128, "multiple of 16"),
        (dict(tile_m=128, tile_n=128, num_stages=1), 128, "num_stages"),
        (dict(tile_m=128, tile_n=128, num_stages=4), 128, "shared memory"),
        (dict(tile_m=128, tile_n=128), 256, "shared memory"),
        (dict(tile_m=128, tile_n=256), 128, "accumulators"),
        (dict(tile_m=64, tile_n=128), 128, "pingpong"),
        (
            dict(tile_m=128, tile_n=128, intra_wg_overlap=False, rescale_o_before_pv=True),
            128,
            "rescale_o_before_pv",
        ),
        (dict(tile_m=128, tile_n=128, mma_registers=244), 128, "multiple of 8"),
        (
            dict(tile_m=128, tile_n=128, mma_registers=256, producer_registers=40),
            128,
            "registers per CTA",
        ),
        (dict(tile_m=64, tile_n=128, pingpong=False, gather_lookahead=0), 128, r"\[1, 32\]"),
        (dict(tile_m=64, tile_n=128, pingpong=False, gather_lookahead=33), 128, r"\[1, 32\]"),
        (dict(tile_m=128, tile_n=128, gather_lookahead=16), 128, "producer_registers >= 128"),
        (dict(tile_m=128, tile_n=128, transpose_batch=0), 128, r"transpose_batch=0 .*\[1, 4\]"),
        (dict(tile_m=128, tile_n=128, transpose_batch=5), 128, r"\[1, 4\]"),
    ],
)
def test_invalid_configs_are_refused(kwargs, head_dim, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**kwargs).validate(head_dim)


def test_seesaw_config_serves_the_latent_only():
    from flash_cute.config import seesaw_config

    config = seesaw_config()
    assert config.seesaw and (config.producer_registers, config.mma_registers) == (24, 240)
    assert config.validate(576, "bfloat16", 512, v_in_k=True) is config
    with pytest.raises(ValueError, match="seesaw serves absorbed MLA only"):
        config.validate(576, "bfloat16", 512)
    with pytest.raises(ValueError, match="seesaw needs the wide latent config"):
        config.replace(tile_n=32).validate(576, "bfloat16", 512, v_in_k=True)
    with pytest.raises(TypeError, match="seesaw must be a bool"):
        AttentionConfig(64, 64, seesaw=1)


def test_bad_tile_m_and_types():
    with pytest.raises(ValueError, match="tile_m"):
        AttentionConfig(tile_m=100, tile_n=128)
    with pytest.raises(TypeError, match="tile_n"):
        AttentionConfig(tile_m=128, tile_n=128.0)
    with pytest.raises(ValueError, match="head_dim"):
        AttentionConfig(128, 128).validate(72)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        AttentionConfig(128, 128, scheduler="persistent")
    with pytest.raises(TypeError, match="pingpong must be a bool"):
        AttentionConfig(128, 128, pingpong=1)
    with pytest.raises(TypeError, match="store_o_from_registers must be a bool"):
        AttentionConfig(128, 128, store_o_from_registers="yes")
    with pytest.raises(ValueError, match=r"exp2_on_fma must be in \[0, 16\]"):
        AttentionConfig(128, 128, exp2_on_fma=17)
    with pytest.raises(TypeError, match="exp2_on_fma must be an int"):
        AttentionConfig(128, 128, exp2_on_fma=0.5)


def test_head_dims_without_a_row_take_the_next_larger_rows():
    """Any multiple of 16 up to 256 runs on the row of the next larger table head dim."""
    from flash_cute.config import table_head_dim

    assert [table_head_dim(d) for d in (16, 64, 80, 96, 112, 144, 208, 256)] == [
        64, 64, 96, 96, 128, 192, 256, 256,
    ]  # fmt: skip
    for d, dv in [(80, 80), (16, 16), (112, 48), (48, 240), (208, 208)]:
        for causal in (False, True):
            row = default_config(d, "bfloat16", causal, head_dim_v=dv)
            assert row is default_config(table_head_dim(max(d, dv)), "bfloat16", causal)
            assert row.validate(d, "bfloat16", dv) is row
        assert decode_config(d, "float16", dv).validate(d, "float16", dv)


def test_unsupported_lookup():
    with pytest.raises(ValueError, match="multiple of 16"):
        default_config(72, "bfloat16", False)
    with pytest.raises(ValueError, match="float32"):
        default_config(128, "float32", False)


@pytest.mark.parametrize("key", sorted(SHORT_SEQUENCE_CONFIGS, key=str), ids=str)
def test_short_sequence_rows(key):
    head_dim, dtype, causal = key
    longest, config = SHORT_SEQUENCE_CONFIGS[key]
    config.validate(head_dim, dtype)
    assert default_config(head_dim, dtype, causal, longest) is config
    assert default_config(head_dim, dtype, causal, longest + 1) is FORWARD_CONFIGS[key]
    assert default_config(head_dim, dtype, causal) is FORWARD_CONFIGS[key]


@pytest.mark.parametrize("key", sorted(DECODE_CONFIGS, key=str), ids=str)
def test_decode_rows(key):
    head_dim, dtype = key
    config = DECODE_CONFIGS[key].validate(head_dim, dtype)
    assert config.tile_m == 64  # one query tile covers the packed heads of a decode step


def test_ctas_per_sm_budget():
    config = AttentionConfig(64, 64, num_stages=3, pingpong=False, ctas_per_sm=2)
    assert config.entry_registers == 128
    assert config.producer_registers + config.mma_registers == 256
    config.validate(128)
    with pytest.raises(ValueError, match="2 CTA"):
        AttentionConfig(64, 128, num_stages=3, pingpong=False, ctas_per_sm=2).validate(128)
    three = AttentionConfig(64, 64, num_stages=3, pingpong=False, ctas_per_sm=3)
    assert three.entry_registers == 80  # 65536 / (3 x 256), rounded down to 8
    assert three.producer_registers + three.mma_registers <= 2 * 80
    three.validate(64)
    with pytest.raises(ValueError, match="3 CTA"):
        three.replace(tile_n=128).validate(64)  # its K/V ring needs more smem than a third
    with pytest.raises(ValueError, match="ctas_per_sm must be 1, 2, 3 or 4"):
        AttentionConfig(64, 64, ctas_per_sm=5)


def test_config_pickles_with_a_fresh_hash():
    """A config's hash is cached per process; an unpickled one rebuilds it (so configs sent to
    compile workers still find equal ones in dicts there)."""
    import pickle

    cfg = AttentionConfig(128, 128, scheduler="dynamic_persistent")
    state = cfg.__getstate__()
    assert "_hash" not in state
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone == cfg and hash(clone) == hash(cfg) and {cfg: 1}[clone] == 1
    assert hash(cfg.replace(tile_n=64)) != hash(cfg)


def test_o_split_shares_rows_and_halves_o_registers():
    c = AttentionConfig(64, 64, pingpong=False, o_split=2, store_o_from_registers=True)
    assert c.num_mma_warpgroups == 2 and c.num_threads == 384
    assert (c.producer_registers, c.mma_registers) == (40, 232)
    # O of 512 columns: 128 registers per thread in each warpgroup, S 32, P 16.
    assert c.accumulator_registers(64, 512) == 32 + 128 + 16
    with pytest.raises(ValueError, match="o_split must be 1 or 2"):
        AttentionConfig(64, 64, o_split=3)
    with pytest.raises(ValueError, match="o_split=2 needs tile_m 64"):
        AttentionConfig(128, 64, o_split=2)
    bad = AttentionConfig(64, 64, o_split=2, pv_from_registers=False, pingpong=False)
    with pytest.raises(ValueError, match="o_split needs P from registers"):
        bad.validate(128, "bfloat16")


def test_new_head_dims():
    """The kernels take V head dims other than q's and V's 512 (with q/k's 512 or 576). Wide
    heads take wide_config: 64 rows, O
    split over two warpgroups, the longest key block that fits (V read from K's columns leaves
    room for 64 keys at 576)."""
    from flash_cute import config as configs

    for dims in [(576, 512), (512, None), (192, 128), (64, 512), (128, 128)]:
        configs.check_head_dims(*dims)
    with pytest.raises(ValueError, match="head_dim 576 goes with head_dim_v 512"):
        configs.check_head_dims(576, 128)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 up to 256"):
        configs.check_head_dims(72, 72)
    for head_dim, v_in_k, tile_n in [(576, True, 64), (576, False, 32), (512, False, 32)]:
        config = default_config(head_dim, "bfloat16", True, head_dim_v=512, v_in_k=v_in_k)
        assert (config.tile_m, config.tile_n, config.o_split) == (64, tile_n, 2)
        assert config.split_scores == v_in_k  # (the latent cache's scores split by key halves)
        assert config.validate(head_dim, "bfloat16", 512, v_in_k) is config
        assert decode_config(head_dim, "bfloat16", 512, v_in_k) == config
    assert default_config(64, "float16", False, head_dim_v=512).tile_n == 64


def test_register_split_beyond_the_launch_pool_is_refused_by_config_and_kernel():
    """setmaxnreg.inc waits forever for registers the CTA never got (a sweep's 32 / 240 over
    two MMA warpgroups hung the GPU): validate refuses it, and so does the ForwardVariant a
    kernel is built from (configs a plan or a sweep changed after validation)."""
    from flash_cute.kernels.forward.kernel import FlashAttentionForwardSm90

    from flash_cute.plan import ForwardVariant

    good = fp8_math_config(default_config(128, "bfloat16", False), 128, 128)
    assert good.register_split_problem() is None
    bad = good.replace(producer_registers=32, mma_registers=240)
    assert "65536 registers per CTA" in bad.register_split_problem()
    with pytest.raises(ValueError, match="register split"):
        bad.validate(128)
    with pytest.raises(ValueError, match="register split"):
        FlashAttentionForwardSm90(ForwardVariant("bfloat16", 128, False, config=bad))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_math_exponentials_on_fma_only_unmasked_up_to_128(head_dim, causal):
    """Unmasked FP8 rows of head dim 96-128 put 3 of every 16 exponentials on the FMA pipe
    (measured faster there only); decode rows never do."""
    row = default_config(head_dim, "bfloat16", causal)
    fp8 = fp8_math_config(row, head_dim, head_dim, causal=causal)
    assert fp8.exp2_on_fma == (3 if 64 < head_dim <= 128 and not causal else 0)
    assert fp8_math_config(row, head_dim, head_dim, decode_like=True).exp2_on_fma == 0
