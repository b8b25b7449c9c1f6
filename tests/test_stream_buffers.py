"""Host logic of the buffers kept per (device, stream) between calls (split partials scratch,
zeroed counters, int-length tensors), on CPU tensors with the stream queries stubbed: what is
reused, what grows, what a CUDA-graph capture gets instead, and what empty_cache() drops."""

import pytest
import torch

import flash_cute
from flash_cute import interface


@pytest.fixture
def streams(monkeypatch):
    """A fake current stream (settable) and capture flag; the caches start empty."""
    state = {"stream": 7, "capturing": False}
    monkeypatch.setattr(interface, "_current_raw_stream", lambda index: state["stream"])
    monkeypatch.setattr(interface, "_stream_capturing", lambda: state["capturing"])
    flash_cute.empty_cache()
    yield state
    flash_cute.empty_cache()


CPU = torch.device("cpu")


def stream():
    """The per-stream buffers' key, as a call queries it once for all of them."""
    return interface._stream_key(CPU)


def partials(num_splits, out_shape=(2, 3, 4, 64), lse_shape=(2, 4, 3)):
    return interface._SplitPartials.for_shapes(num_splits, out_shape, lse_shape)


def test_split_scratch_reused_per_stream_and_layout(streams):
    small = partials(2)
    o1, l1 = interface._split_scratch(CPU, small, stream())
    o2, l2 = interface._split_scratch(CPU, small, stream())
    assert o1 is o2 and l1 is l2, "the same layout on the same stream reuses its views"
    assert o1.shape == (2, 2, 3, 4, 64) and l1.shape == (2, 2, 4, 3)
    assert l1.data_ptr() == o1.data_ptr() + 4 * o1.numel(), "the LSE follows O in one buffer"
    # A larger layout grows the stream's buffer; the smaller one then gets views of the new one.
    big = partials(8)
    ob, _ = interface._split_scratch(CPU, big, stream())
    o3, _ = interface._split_scratch(CPU, small, stream())
    assert o3.data_ptr() == ob.data_ptr() and o3 is not o1
    # Another stream has its own buffer.
    streams["stream"] = 9
    o4, _ = interface._split_scratch(CPU, small, stream())
    assert o4.data_ptr() != o3.data_ptr()
    assert len(interface._SCRATCH) == 2


def test_split_scratch_capture_and_large_layouts_allocate(streams):
    small = partials(2)
    cached, _ = interface._split_scratch(CPU, small, stream())
    streams["capturing"] = True
    captured, _ = interface._split_scratch(CPU, small, stream())
    assert captured.data_ptr() != cached.data_ptr(), "a capture must not take the shared scratch"
    streams["capturing"] = False
    huge = partials(2, out_shape=(1, 1 << 12, 8, 128), lse_shape=(1, 8, 1 << 12))
    assert huge.numel > interface._SCRATCH_MAX_FLOATS
    first, _ = interface._split_scratch(CPU, huge, stream())
    assert first.shape == huge.o_shape
    assert all(huge not in views for _, views in interface._SCRATCH.values()), (
        "a large layout was cached"
    )
    assert all(
        buffer.numel() <= interface._SCRATCH_MAX_FLOATS for buffer, _ in interface._SCRATCH.values()
    )


def test_zeroed_counters_grow_and_stay_zeroed(streams):
    c2 = interface._zeroed_counters(CPU, 2, stream())
    assert c2.dtype == torch.int32 and c2.numel() == 2 and not c2.any()
    assert interface._zeroed_counters(CPU, 1, stream()) is c2, "a smaller need reuses the buffer"
    c40 = interface._zeroed_counters(CPU, 40, stream())
    assert c40.numel() >= 40 and not c40.any() and c40 is not c2
    assert interface._zeroed_counters(CPU, 2, stream()) is c40
    streams["capturing"] = True
    assert interface._zeroed_counters(CPU, 2, stream()) is not c40, (
        "a capture gets its own counters"
    )


def test_empty_cache_drops_everything(streams):
    interface._split_scratch(CPU, partials(2), stream())
    interface._zeroed_counters(CPU, 2, stream())
    assert interface._SCRATCH and interface._COUNTERS
    flash_cute.empty_cache()
    assert not interface._SCRATCH and not interface._COUNTERS


def _split_plan(num_counters=8, layout=None, calls=None):
    """A split launch plan on the CPU whose kernel records the buffers it was given (split
    kernels take the counters' and the partials' addresses: FlashAttentionForwardSm90.call_split)."""
    layout = layout or partials(2, out_shape=(1, 1, 4, 64), lse_shape=(1, 4, 1))

    def forward(
        q,
        k,
        v,
        out,
        lse,
        partials_address,
        scale,
        cu_q,
        cu_k,
        seqused_k,
        table,
        counters_address,
        max_ctas,
        num_splits,
        kv_length,
    ):
        calls.append((counters_address, partials_address, kv_length))

    return interface._LaunchPlan(
        forward=forward,
        device=CPU,
        dtype=torch.float32,
        out_shape=(1, 1, 4, 64),
        lse_shape=None,
        scale_log2=1.0,
        max_ctas=132,
        num_splits=2,
        partials=layout,
        extents=(0, 0, 0, 0),
        num_counters=num_counters,
    )


def test_launch_plans_memo_their_stream_buffers(streams):
    """A plan reuses its last launch's per-stream buffers while the stream and the caches'
    version match: the same buffers the caches would hand out, without looking them up;
    another stream, a capture, a grown buffer or empty_cache() make it look again."""
    calls = []
    plan = _split_plan(calls=calls)
    q = torch.zeros(1, 1, 4, 64)

    def launch(int_length=None):
        plan.launch(q, q, q, None, int_length=int_length)
        return calls[-1]

    first = launch()
    assert first[0] == interface._zeroed_counters(CPU, 8, stream()).data_ptr()
    out_partial, lse_partial = interface._split_scratch(CPU, plan.partials, stream())
    assert first[1] == out_partial.data_ptr()
    # The kernel finds the LSE partial right after the O partial (call_split).
    assert (
        lse_partial.data_ptr() == first[1] + 4 * out_partial.numel() and lse_partial.is_contiguous()
    )
    lookups = []
    real = interface._zeroed_counters
    interface._zeroed_counters = lambda *a: lookups.append(a) or real(*a)
    try:
        assert launch()[:2] == first[:2] and not lookups, (
            "the same stream looked its buffers up again"
        )
        streams["stream"] = 9
        other = launch()
        assert other[0] != first[0] and len(lookups) == 1
        streams["capturing"] = True
        captured = launch()
        assert captured[0] != other[0] and captured[1] != other[1]
        streams["capturing"] = False
        assert launch()[0] == other[0], "a capture replaced the memo"
        grown = real(CPU, 100, stream())  # another plan needs more counters on this stream
        assert launch()[0] == grown.data_ptr(), "the memo outlived the buffer it names"
        assert launch(int_length=7)[2] == 7 and launch()[2] == 0, (
            "an int length goes to the kernel as is"
        )
        interface._FUNC_PLANS[("test",)] = plan
        flash_cute.empty_cache()
        assert plan.buffers is None
        assert launch()[0] == interface._COUNTERS[stream()].data_ptr()
    finally:
        interface._zeroed_counters = real
        interface._FUNC_PLANS.pop(("test",), None)
    huge = partials(2, out_shape=(1, 1 << 12, 8, 128), lse_shape=(1, 8, 1 << 12))
    big_plan = _split_plan(layout=huge, calls=calls)
    big_plan.launch(q, q, q, None)
    assert big_plan.buffers is None, "a per-call scratch allocation was kept"


def test_single_wave_problems_use_the_static_twin(monkeypatch):
    """A dynamic persistent config runs static persistent CTAs when every tile fits in one
    wave (CTA i takes tile i under both, and the static one needs no tile counter); more
    tiles, split launches and varlen keep the dynamic scheduler; other schedulers are kept."""
    monkeypatch.setattr(interface, "num_sms", lambda index: 132)
    dynamic = flash_cute.AttentionConfig(128, 128, scheduler="dynamic_persistent")

    def problem(batch, seqlen_q, nheads, varlen_q=False):
        return interface._Problem(
            batch=batch,
            nheads=nheads,
            nheads_kv=nheads,
            head_dim=128,
            dtype=torch.bfloat16,
            max_seqlen_q=seqlen_q,
            max_seqlen_k=4096,
            varlen_q=varlen_q,
        )

    one_wave = problem(2, 1000, 8)  # 8 query tiles x 8 heads x 2 = 128 tiles
    twin = interface.single_wave_config(dynamic, one_wave, 1, False, 0)
    assert twin == dynamic.replace(scheduler="static_persistent")
    assert (
        interface.single_wave_config(dynamic, problem(2, 1100, 8), 1, False, 0) is dynamic
    )  # 144 tiles
    assert (
        interface.single_wave_config(dynamic, problem(1, 1000, 16), 8, False, 0) == twin
    )  # packed: 63 x 2
    assert (
        interface.single_wave_config(dynamic, problem(1, 1100, 16), 8, False, 0) is dynamic
    )  # 69 x 2
    assert interface.single_wave_config(dynamic, one_wave, 1, True, 0) is dynamic  # split
    assert (
        interface.single_wave_config(dynamic, problem(2, 1000, 8, varlen_q=True), 1, False, 0)
        is dynamic
    )
    two_ctas = dynamic.replace(tile_m=64, ctas_per_sm=2, pingpong=False)
    # 16 query tiles of 64 rows x 8 heads x 2 = 256 tiles: one wave of 2 x 132 CTAs
    assert (
        interface.single_wave_config(two_ctas, problem(2, 1000, 8), 1, False, 0).scheduler
        == "static_persistent"
    )
    for scheduler in ("single_tile", "static_persistent"):
        config = dynamic.replace(scheduler=scheduler)
        assert interface.single_wave_config(config, one_wave, 1, False, 0) is config


def test_only_variants_without_optional_tensors_take_the_short_signature():
    """ForwardKernelKey.takes_optionals: a variant that uses any optional tensor (LSE, varlen
    offsets, packed or paged K/V, seqused_k, split scratch, tile counter) is compiled with
    __call__'s whole signature; the others take (q, k, v, out, scale_log2, max_ctas, kv_length)."""
    from dataclasses import replace

    from flash_cute.compile_cache import ForwardKernelKey

    base = ForwardKernelKey("bfloat16", 128, False, flash_cute.AttentionConfig(128, 128), False)
    static = base.config.replace(scheduler="static_persistent")
    assert not base.takes_optionals
    assert not replace(
        base, config=static, scalar_kv_length=True, pack_gqa_ratio=4, causal=True
    ).takes_optionals
    for changed in (
        {"writes_lse": True},
        {"varlen_q": True},
        {"kv_layout": "packed"},
        {"kv_layout": "paged", "page_box_rows": 64},
        {"seqused_k": True},
        {"split": True},
        {"config": base.config.replace(scheduler="dynamic_persistent")},
    ):
        assert replace(base, **changed).takes_optionals, changed


def test_short_signature_plans_pass_only_what_the_kernel_takes():
    calls = []
    plan = interface._LaunchPlan(
        forward=lambda *args: calls.append(args),
        device=CPU,
        dtype=torch.float32,
        out_shape=(1, 1, 4, 64),
        lse_shape=None,
        scale_log2=0.5,
        max_ctas=132,
        num_splits=1,
        partials=None,
        extents=(0, 0, 0, 0),
        out_like_q=True,
        short_signature=True,
    )
    q = torch.zeros(1, 1, 4, 64)
    out = plan.launch(q, q, q, None, int_length=9)
    assert out.shape == q.shape and out is not q
    assert (
        len(calls) == 1
        and calls[0][:3] == (q, q, q)
        and calls[0][3] is out
        and calls[0][4:] == (0.5, 132, 9)
    )
    given = torch.empty_like(q)
    assert plan.launch(q, q, q, given) is given and calls[1][3] is given and calls[1][6] == 0


def test_default_stream_skips_the_capture_query(streams, monkeypatch):
    """The legacy default stream (raw handle 0) cannot be captured, so calls on it do not ask
    whether a capture is under way; any other stream does."""
    asked = []
    monkeypatch.setattr(
        interface, "_stream_capturing", lambda: asked.append(1) or streams["capturing"]
    )
    streams["stream"] = 0
    assert stream() == (None, 0) and not asked
    streams["stream"], streams["capturing"] = 5, True
    assert stream() is None and asked
