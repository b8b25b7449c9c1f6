"""Forward kernel against the float32 reference on a Hopper GPU (marker: gpu).

Bar: max |out - ref| <= 2 x max |out_lowp - ref| + a rounding floor, where out_lowp is the
same math done by PyTorch in the input dtype. Outputs are poisoned (NaN) before each call so
unwritten elements fail.
"""

import math

import pytest
import torch

import flash_cute
from flash_cute import AttentionConfig
from flash_cute.reference import attention_ref, error_bound, stable_seed

pytestmark = pytest.mark.gpu

HEAD_DIMS = [64, 96, 128, 192, 256]
DTYPES = [torch.bfloat16, torch.float16]
SEQLENS = [
    (1, 1),
    (17, 17),
    (113, 203),
    (128, 128),
    (1000, 1000),
    (1, 1000),
    (1000, 17),
    (239, 1),
    (4097, 4097),
]
GQA = [(8, 8), (8, 2), (8, 1)]  # ratios 1, 4, 8


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype):
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_kv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_kv, head_dim, device="cuda", dtype=dtype)
    return q, k, v


def check_against_reference(q, k, v, out, lse, causal, softmax_scale=None):
    ref, lse_ref = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal)
    lowp, _ = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=False)
    assert not out.isnan().any(), "output has NaN: some elements were not written"
    err = (out.float() - ref).abs().max().item()
    bound = error_bound(lowp, ref)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    if lse is not None:
        assert lse.shape == lse_ref.shape
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), "lse is finite where the reference is not"
        assert (lse[~finite] == float("-inf")).all()
        if finite.any():
            lse_err = (lse[finite] - lse_ref[finite]).abs().max().item()
            assert lse_err < 1e-3 * max(1.0, lse_ref[finite].abs().max().item()), (
                f"lse error {lse_err}"
            )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_forward(head_dim, dtype, causal, seqlens, heads):
    seqlen_q, seqlen_k = seqlens
    if max(seqlens) > 4000 and heads != (8, 1):
        pytest.skip("long sequences: one GQA ratio is enough")
    torch.manual_seed(stable_seed(head_dim, causal, seqlens, heads))
    batch = 2
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, *heads, head_dim, dtype)
    out = torch.full_like(q, float("nan"))
    out_ret, lse = flash_cute.flash_attn_func(q, k, v, causal=causal, return_lse=True, out=out)
    assert out_ret is out
    check_against_reference(q, k, v, out, lse, causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_strided_inputs(head_dim):
    """q, k, v sliced out of packed buffers; out a slice too."""
    torch.manual_seed(1)
    batch, seqlen, nheads, nheads_kv = 2, 300, 4, 2
    qkv = torch.randn(
        batch, seqlen, nheads + 2 * nheads_kv + 1, head_dim, device="cuda", dtype=torch.bfloat16
    )
    q = qkv[:, :, :nheads]
    k = qkv[:, :, nheads : nheads + nheads_kv]
    v = qkv[:, :, nheads + nheads_kv : nheads + 2 * nheads_kv]
    big_out = torch.full(
        (batch, seqlen, nheads + 3, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16
    )
    out = big_out[:, :, 1 : nheads + 1]
    for causal in (False, True):
        out.fill_(float("nan"))
        flash_cute.flash_attn_func(q, k, v, causal=causal, out=out)
        check_against_reference(q, k, v, out, None, causal)
    assert big_out[:, :, 0].isnan().all() and big_out[:, :, nheads + 1 :].isnan().all(), (
        "wrote outside out"
    )


def test_odd_strides_are_copied():
    """Strides that are not multiples of 16 bytes still give the right answer (via a copy)."""
    torch.manual_seed(2)
    base = torch.randn(2, 100, 3, 136, device="cuda", dtype=torch.float16)
    q = base[:, :, 0:1, :128]  # row stride 3*136 elements = 816 bytes: TMA reads it in place
    odd = torch.randn(2, 100, 2, 129, device="cuda", dtype=torch.float16)[..., :128]
    k, v = odd[:, :, :1], odd[:, :, 1:]  # head stride 129 elements = 258 bytes: copied
    out, lse = flash_cute.flash_attn_func(q, k, v, return_lse=True)
    check_against_reference(q, k, v, out, lse, False)


def test_softmax_scale_and_default():
    torch.manual_seed(3)
    q, k, v = make_qkv(1, 257, 300, 4, 4, 128, torch.bfloat16)
    out = flash_cute.flash_attn_func(q, k, v, softmax_scale=0.3)
    check_against_reference(q, k, v, out, None, False, softmax_scale=0.3)
    default = flash_cute.flash_attn_func(q, k, v)
    explicit = flash_cute.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(128))
    assert torch.equal(default, explicit)


def test_empty_inputs():
    q, k, v = make_qkv(2, 5, 0, 4, 2, 64, torch.bfloat16)
    out, lse = flash_cute.flash_attn_func(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    q, k, v = make_qkv(0, 5, 7, 4, 2, 64, torch.bfloat16)
    out, lse = flash_cute.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 4, 5)
    q, k, v = make_qkv(2, 0, 7, 4, 2, 64, torch.bfloat16)
    out = flash_cute.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 0, 4, 64)


def test_deterministic():
    """Same inputs, same bits: a moving result would mean a race."""
    torch.manual_seed(4)
    q, k, v = make_qkv(3, 1111, 1234, 8, 2, 128, torch.bfloat16)
    first = flash_cute.flash_attn_func(q, k, v, causal=True)
    for _ in range(3):
        assert torch.equal(flash_cute.flash_attn_func(q, k, v, causal=True), first)


CONFIG_VARIANTS = [
    AttentionConfig(tile_m=128, tile_n=128, intra_wg_overlap=False),
    AttentionConfig(tile_m=128, tile_n=128, pingpong=False),
    AttentionConfig(tile_m=128, tile_n=128, pv_from_registers=False),
    AttentionConfig(tile_m=128, tile_n=64, num_stages=3),
    AttentionConfig(tile_m=128, tile_n=176),
    AttentionConfig(tile_m=64, tile_n=128, pingpong=False),
    AttentionConfig(tile_m=192, tile_n=96, intra_wg_overlap=False),
    AttentionConfig(tile_m=128, tile_n=128, rescale_o_before_pv=True, pingpong=False),
    AttentionConfig(tile_m=64, tile_n=64, num_stages=3, pingpong=False, ctas_per_sm=2),
]


@pytest.mark.parametrize("config", CONFIG_VARIANTS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_explicit_configs(config, causal):
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 700, 555, 4, 2, 128, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_func(
        q, k, v, causal=causal, return_lse=True, out=out, config=config
    )
    check_against_reference(q, k, v, out, lse, causal)


# Softmax knobs off the table's defaults: exponentials on the FMA pipe (a few, and all, so every
# column of the polynomial path runs), the lazy O rescale and a stale row max. Causal 1000 x 17
# has query rows that see no keys (out 0, lse -inf: the polynomial must give exact zeros);
# scaled-up scores push exponents below -127; a ramp makes each key block's max (the last
# block goes first) a few log2 units above the previous one, so rows both keep and move
# their max under a threshold.
SOFTMAX_KNOBS = [
    dict(exp2_on_fma=2),
    dict(exp2_on_fma=16),
    dict(lazy_rescale=True),
    dict(lazy_rescale=True, rescale_threshold=8),
    dict(lazy_rescale=True, rescale_threshold=15, exp2_on_fma=4),
]


def _knob_id(knobs):
    return "-".join(f"{k}{int(v)}" for k, v in knobs.items())


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "seqlens", [(700, 555), (1000, 17), (17, 1000), (300, 2000)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("knobs", SOFTMAX_KNOBS, ids=_knob_id)
@pytest.mark.parametrize("scores", ["randn", "x8", "ramp"])
def test_softmax_knobs(head_dim, dtype, causal, seqlens, knobs, scores):
    torch.manual_seed(stable_seed(head_dim, causal, seqlens, _knob_id(knobs), scores))
    q, k, v = make_qkv(2, *seqlens, 4, 2, head_dim, dtype)
    if scores == "x8":
        q = (q * 8).to(dtype)
    elif scores == "ramp":  # +2.5 log2 units of score per 128 keys, growing toward key 0
        q[..., 0] = 4.0
        ramp = torch.arange(seqlens[1], 0, -1, device="cuda", dtype=torch.float32)
        k[..., 0] = (ramp * (2.5 / 128 / 4 * math.sqrt(head_dim) / math.log2(math.e)))[
            None, :, None
        ].to(dtype)
    config = flash_cute.default_config(
        head_dim, "bfloat16" if dtype == torch.bfloat16 else "float16", causal
    )
    config = config.replace(**knobs)
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_func(
        q, k, v, causal=causal, return_lse=True, out=out, config=config
    )
    check_against_reference(q, k, v, out, lse, causal)
    if causal and seqlens[0] > seqlens[1]:  # rows with no keys: exactly 0
        assert (out[:, : seqlens[0] - seqlens[1]] == 0).all()


# Persistent scheduler: O in its own smem (hdim 64, 128 RS) or over Q's tile (96, 192, 256,
# 128 SS); grids with fewer tiles than SMs and with several tiles per CTA; causal problems with
# seqlen_q > seqlen_k, whose top tiles see no keys (Q is still loaded and released per tile).
PERSISTENT_SHAPES = [
    (1, 17, 17, 2, 2),
    (3, 1000, 1000, 8, 2),
    (2, 4097, 4097, 4, 4),
    (2, 700, 300, 6, 3),
    (4, 113, 1000, 16, 16),
]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "b{}_{}x{}_h{}kv{}".format(*s))
@pytest.mark.parametrize("short_row", [False, True], ids=["table", "short"])
@pytest.mark.parametrize("scheduler", ["static_persistent", "dynamic_persistent"])
def test_persistent_scheduler(head_dim, causal, shape, short_row, scheduler):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    dtype = torch.bfloat16 if (head_dim + seqlen_q) % 2 else torch.float16
    seqlen_for_row = 512 if short_row else 1 << 20
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    config = flash_cute.default_config(head_dim, dtype_name, causal, seqlen_for_row)
    if short_row and config == flash_cute.default_config(head_dim, dtype_name, causal, 1 << 20):
        pytest.skip("no short-sequence row for this head dim")
    config = config.replace(scheduler=scheduler)
    torch.manual_seed(stable_seed(head_dim, causal, shape))
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype)
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_func(
        q, k, v, causal=causal, return_lse=True, out=out, config=config
    )
    check_against_reference(q, k, v, out, lse, causal)
    for _ in range(2):  # the dynamic scheduler's counter must be back at zero after each launch
        again = flash_cute.flash_attn_func(q, k, v, causal=causal, config=config)
        assert torch.equal(again, out), "persistent kernel is not deterministic"


# O stored straight from registers on padded problems (store_o_from_registers): every scheduler,
# so persistent CTAs free Q's tile after the mainloop; rows past seqlen_q must stay unwritten.
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=lambda s: "b{}_{}x{}_h{}kv{}".format(*s))
@pytest.mark.parametrize("scheduler", ["single_tile", "static_persistent", "dynamic_persistent"])
def test_o_stored_from_registers(head_dim, causal, shape, scheduler):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    dtype = torch.float16 if (head_dim + seqlen_q) % 2 else torch.bfloat16
    dtype_name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    config = flash_cute.default_config(head_dim, dtype_name, causal).replace(
        scheduler=scheduler, store_o_from_registers=True
    )
    torch.manual_seed(stable_seed(head_dim, causal, shape, scheduler))
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype)
    padded = torch.full(
        (batch, seqlen_q + 64, nheads, head_dim), float("nan"), device="cuda", dtype=dtype
    )
    out = padded[:, :seqlen_q]
    _, lse = flash_cute.flash_attn_func(
        q, k, v, causal=causal, return_lse=True, out=out, config=config
    )
    check_against_reference(q, k, v, out, lse, causal)
    assert padded[:, seqlen_q:].isnan().all(), "rows past seqlen_q were written"
    again = flash_cute.flash_attn_func(q, k, v, causal=causal, config=config)
    assert torch.equal(again, out), "not deterministic"


# Causal tile order with head sections of unequal sizes: 62 (batch, head) pairs of 8 query
# tiles, 132 SMs, so the last section takes 33 pairs (49 with 24 MB sections). l2_section_mb 1:
# sections of 2 pairs, the 29 before the last in 14 sections of 2 and one of 1; 3: sections
# of 6, the 29 in 4 of 6 and one of 5; 24: 13 pairs, then 49.
@pytest.mark.parametrize("scheduler", ["single_tile", "static_persistent", "dynamic_persistent"])
@pytest.mark.parametrize("l2_section_mb", [1, 3, 24])
def test_causal_order_with_head_sections(scheduler, l2_section_mb):
    torch.manual_seed(11)
    q, k, v = make_qkv(2, 1000, 1000, 31, 1, 128, torch.bfloat16)
    config = AttentionConfig(
        tile_m=128, tile_n=128, scheduler=scheduler, l2_section_mb=l2_section_mb
    )
    out = torch.full_like(q, float("nan"))
    _, lse = flash_cute.flash_attn_func(
        q, k, v, causal=True, return_lse=True, out=out, config=config
    )
    check_against_reference(q, k, v, out, lse, causal=True)


def test_dynamic_scheduler_streams_and_graphs():
    """Launches on two streams at once use different tile counters; a captured graph has its
    own counter and replays correctly, also beside eager calls."""
    torch.manual_seed(9)
    config = AttentionConfig(tile_m=128, tile_n=128, scheduler="dynamic_persistent")
    q, k, v = make_qkv(4, 1500, 1500, 8, 8, 128, torch.bfloat16)
    ref = flash_cute.flash_attn_func(q, k, v, causal=True, config=config)
    check_against_reference(q, k, v, ref, None, True)
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [torch.full_like(q, float("nan")) for _ in streams]
    torch.cuda.synchronize()
    for _ in range(3):
        for stream, out in zip(streams, outs):
            with torch.cuda.stream(stream):
                flash_cute.flash_attn_func(q, k, v, causal=True, out=out, config=config)
    torch.cuda.synchronize()
    for out in outs:
        assert torch.equal(out, ref)
    graph_out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_cute.flash_attn_func(q, k, v, causal=True, out=graph_out, config=config)
    for _ in range(3):
        graph_out.fill_(float("nan"))
        graph.replay()
        eager = flash_cute.flash_attn_func(q, k, v, causal=True, config=config)
        torch.cuda.synchronize()
        assert torch.equal(graph_out, ref) and torch.equal(eager, ref)


def test_launch_plan_keys_carry_flag_types():
    """A repeated call replays a cached launch plan; flags equal to a cached call's but of a
    type the checks reject (1.0 == True) must still be rejected, not replayed."""
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    for _ in range(2):  # the second call replays the plan
        flash_cute.flash_attn_func(q, k, v, softmax_scale=1, causal=True, return_lse=False)
    with pytest.raises(TypeError, match="causal"):
        flash_cute.flash_attn_func(q, k, v, softmax_scale=1, causal=1.0, return_lse=False)
    with pytest.raises(TypeError, match="return_lse"):
        flash_cute.flash_attn_func(q, k, v, softmax_scale=1, causal=True, return_lse=0.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_cute.flash_attn_func(q, k, v, softmax_scale=True, causal=True, return_lse=False)
    k_cache, v_cache = k.clone(), v.clone()
    seqlens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
    for _ in range(2):
        flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, causal=True, num_splits=1)
    with pytest.raises(TypeError, match="causal"):
        flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, causal=1.0, num_splits=1)
    with pytest.raises(TypeError, match="num_splits"):
        flash_cute.flash_attn_with_kvcache(
            q, k_cache, v_cache, seqlens, causal=True, num_splits=1.0
        )
    for _ in range(2):  # an int length: 64.0 and True must not replay the plan of 64 (or of 1)
        flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, 64, num_splits=1)
        flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, 1, num_splits=1)
    for bad in (64.0, True):
        with pytest.raises(TypeError, match="cache_seqlens"):
            flash_cute.flash_attn_with_kvcache(q, k_cache, v_cache, bad, num_splits=1)


def test_launch_plan_replay_leaves_checks_to_compiled_function():
    """Without out, a plan's key holds q's metadata and k's shape only: the compiled function
    checks k's and v's strides, dtypes, devices and alignment (and v's shape) and raises before
    launching, and the call then goes through the full checks: clear errors for bad inputs, a
    copy for strides TMA cannot read, and the plan still replays afterwards."""
    torch.manual_seed(13)
    q, k, v = make_qkv(2, 300, 300, 4, 2, 64, torch.bfloat16)
    for causal in (False, True):
        ref = flash_cute.flash_attn_func(q, k, v, causal=causal)
        check_against_reference(q, k, v, ref, None, causal)
        assert torch.equal(flash_cute.flash_attn_func(q, k, v, causal=causal), ref)  # replayed
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        flash_cute.flash_attn_func(q, k.half(), v)
    with pytest.raises(TypeError, match="v must have the same dtype as q"):
        flash_cute.flash_attn_func(q, k, v.half())
    with pytest.raises(ValueError, match="v must have the shape of k"):
        flash_cute.flash_attn_func(q, k, v[:, :299])
    with pytest.raises(ValueError, match="k must be on q's device"):
        flash_cute.flash_attn_func(q, k.cpu(), v)
    # Same shape, head stride 68 elements (136 bytes): TMA cannot read it, so it is copied.
    odd_k = torch.randn(2, 300, 2, 68, device="cuda", dtype=torch.bfloat16)[..., :64]
    odd_k.copy_(k)
    # Same shape and strides, base 8 bytes off 16-byte alignment: copied too.
    shifted_v = torch.randn(v.numel() + 4, device="cuda", dtype=torch.bfloat16)[4:].view(v.shape)
    shifted_v.copy_(v)
    for causal in (False, True):
        for kk, vv in ((odd_k, v), (k, shifted_v), (k, v)):
            out = flash_cute.flash_attn_func(q, kk, vv, causal=causal)
            check_against_reference(q, k, v, out, None, causal)
    # q's strides too (the key holds only whether q is contiguous): a plan made for a q with a
    # head stride of 72 elements meets one of 68, and the contiguous q's plan a q 8 bytes off
    # alignment; both are refused by the compiled function and copied. An odd stride on a
    # size-1 dim (never stepped over) replays the contiguous plan as it is.
    wide_q = torch.randn(2, 300, 4, 72, device="cuda", dtype=torch.bfloat16)[..., :64]
    odd_q = torch.randn(2, 300, 4, 68, device="cuda", dtype=torch.bfloat16)[..., :64]
    shifted_q = torch.randn(q.numel() + 4, device="cuda", dtype=torch.bfloat16)[4:].view(q.shape)
    for t in (wide_q, odd_q, shifted_q):
        t.copy_(q)
    q1, k1, v1 = q[:1].clone(), k[:1].clone(), v[:1].clone()
    q1_odd = q1.as_strided(q1.shape, (3, *q1.stride()[1:]))
    for causal in (False, True):
        for qq in (wide_q, odd_q, shifted_q, q):
            out = flash_cute.flash_attn_func(qq, k, v, causal=causal)
            check_against_reference(q, k, v, out, None, causal)
        ref1 = flash_cute.flash_attn_func(q1, k1, v1, causal=causal)
        assert torch.equal(flash_cute.flash_attn_func(q1_odd, k1, v1, causal=causal), ref1)
    seqlens = torch.full((2,), 250, dtype=torch.int32, device="cuda")
    k_cache, v_cache = k.clone(), v.clone()
    ref = flash_cute.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, seqlens, num_splits=1)
    assert torch.equal(
        flash_cute.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, seqlens, num_splits=1), ref
    )
    with pytest.raises(TypeError, match="cache_seqlens must be"):
        flash_cute.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, seqlens.long(), num_splits=1)
    with pytest.raises(ValueError, match="cache_seqlens must be on q's device"):
        flash_cute.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, seqlens.cpu(), num_splits=1)
    with pytest.raises(TypeError, match="k_cache must have the same dtype as q"):
        flash_cute.flash_attn_with_kvcache(q[:, :1], k_cache.half(), v_cache, seqlens, num_splits=1)
    # uint32 passes the compiled function's int32 check, so the key holds the int32 tensors' dtypes.
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        flash_cute.flash_attn_with_kvcache(
            q[:, :1], k_cache, v_cache, seqlens.to(torch.uint32), num_splits=1
        )
    assert torch.equal(
        flash_cute.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, seqlens, num_splits=1), ref
    )
    k_pages, v_pages = (
        t.reshape(2 * 300 // 20, 20, 2, 64)[:, :16] for t in (k_cache, v_cache)
    )  # 30 pages of 16
    k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
    table = torch.randperm(30, device="cuda", dtype=torch.int32).view(2, 15)
    paged = flash_cute.flash_attn_with_kvcache(
        q[:, :1], k_pages, v_pages, seqlens, page_table=table, num_splits=1
    )
    assert torch.equal(
        flash_cute.flash_attn_with_kvcache(
            q[:, :1], k_pages, v_pages, seqlens, page_table=table, num_splits=1
        ),
        paged,
    )
    with pytest.raises(TypeError, match="page_table must be int32"):
        flash_cute.flash_attn_with_kvcache(
            q[:, :1], k_pages, v_pages, seqlens, page_table=table.to(torch.uint32), num_splits=1
        )


def test_cuda_graph_replay():
    torch.manual_seed(6)
    q, k, v = make_qkv(2, 513, 513, 8, 8, 128, torch.bfloat16)
    flash_cute.flash_attn_func(q, k, v, causal=True)  # warm-up: compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            graph_out = flash_cute.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(q, k, v, graph_out, None, True)


def test_runs_on_current_stream():
    torch.manual_seed(7)
    q, k, v = make_qkv(2, 2048, 2048, 8, 8, 128, torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = flash_cute.flash_attn_func(q, k, v)
    stream.synchronize()
    check_against_reference(q, k, v, out, None, False)
