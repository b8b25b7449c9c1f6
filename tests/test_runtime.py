"""The launch runtime on the CPU, with the stream queries stubbed: the buffers kept per
(device, stream) between calls (what is reused, what grows, what a CUDA-graph capture gets
instead, what empty_cache() drops), and what a launch plan passes its kernel."""

import dataclasses

import pytest
import torch
from conftest import Recorder

import flash_cute
from flash_cute import AttentionConfig, runtime
from flash_cute import flash_attn_interface as fa3
from flash_cute.call import Call
from flash_cute.compile_cache import FULL, SHORT
from flash_cute.forward import kernel_call_args
from flash_cute.plan import ForwardPlan, ForwardVariant

CPU = torch.device("cpu")
BUFFERS = runtime.BUFFERS


def stream():
    """The per-stream buffers' key, as a call queries it once for all of them."""
    return runtime.stream_key(CPU.index)


def layout(num_splits, out_shape=(2, 3, 4, 64), lse_shape=(2, 4, 3)):
    return runtime.SplitScratchLayout.for_shapes(num_splits, out_shape, lse_shape)


def test_split_scratch_reused_per_stream_and_layout(streams):
    small = layout(2)
    o1, l1 = BUFFERS.split_scratch(CPU, small, stream())
    o2, l2 = BUFFERS.split_scratch(CPU, small, stream())
    assert o1 is o2 and l1 is l2, "the same layout on the same stream reuses its views"
    assert o1.shape == (2, 2, 3, 4, 64) and l1.shape == (2, 2, 4, 3)
    assert l1.data_ptr() == o1.data_ptr() + 4 * o1.numel(), "the LSE follows O in one buffer"
    # A larger layout grows the stream's buffer; the smaller one then gets views of the new one.
    big = layout(8)
    ob, _ = BUFFERS.split_scratch(CPU, big, stream())
    o3, _ = BUFFERS.split_scratch(CPU, small, stream())
    assert o3.data_ptr() == ob.data_ptr() and o3 is not o1
    # Another stream has its own buffer.
    streams["stream"] = 9
    o4, _ = BUFFERS.split_scratch(CPU, small, stream())
    assert o4.data_ptr() != o3.data_ptr()
    assert len(BUFFERS.scratch) == 2


def test_split_scratch_capture_and_large_layouts_allocate(streams):
    small = layout(2)
    cached, _ = BUFFERS.split_scratch(CPU, small, stream())
    streams["capturing"] = True
    captured, _ = BUFFERS.split_scratch(CPU, small, stream())
    assert captured.data_ptr() != cached.data_ptr(), "a capture must not take the shared scratch"
    streams["capturing"] = False
    huge = layout(2, out_shape=(1, 1 << 12, 8, 128), lse_shape=(1, 8, 1 << 12))
    assert huge.numel > runtime.SCRATCH_MAX_FLOATS
    first, _ = BUFFERS.split_scratch(CPU, huge, stream())
    assert first.shape == huge.o_shape
    assert all(huge not in views for _, views in BUFFERS.scratch.values()), "a large one cached"
    assert all(buf.numel() <= runtime.SCRATCH_MAX_FLOATS for buf, _ in BUFFERS.scratch.values())


@pytest.fixture
def graph_counters(monkeypatch):
    """An empty pool of pre-zeroed graph counters, small chunks."""
    pool = runtime.GraphCounters()
    pool.CHUNK = 64
    monkeypatch.setattr(runtime, "GRAPH_COUNTERS", pool)
    return pool


def test_zeroed_counters_grow_and_stay_zeroed(streams, graph_counters):
    c2 = BUFFERS.zeroed_counters(CPU, 2, stream())
    assert c2.dtype == torch.int32 and c2.numel() == 2 and not c2.any()
    assert BUFFERS.zeroed_counters(CPU, 1, stream()) is c2, "a smaller need reuses the buffer"
    c40 = BUFFERS.zeroed_counters(CPU, 40, stream())
    assert c40.numel() >= 40 and not c40.any() and c40 is not c2
    assert BUFFERS.zeroed_counters(CPU, 2, stream()) is c40
    graph_counters.refill(CPU)
    streams["capturing"] = True
    assert BUFFERS.zeroed_counters(CPU, 2, stream()) is not c40, "a capture gets its own"


def test_captures_take_disjoint_prezeroed_counters(streams, graph_counters):
    graph_counters.refill(CPU)
    assert not graph_counters.low
    streams["capturing"] = True
    a = BUFFERS.zeroed_counters(CPU, 10, stream())
    b = BUFFERS.zeroed_counters(CPU, 30, stream())
    assert not a.any() and not b.any() and a.numel() == 10 and b.numel() == 30
    pool = graph_counters.pools[CPU.index][0]
    assert a.data_ptr() == pool.data_ptr() and b.data_ptr() == a.data_ptr() + 4 * 10
    assert graph_counters.low, "under half a chunk left: the next eager launch refills"
    streams["capturing"] = False
    graph_counters.refill(CPU)
    assert graph_counters.pools[CPU.index][0] is not pool and graph_counters.retired == [pool]
    assert not graph_counters.low


def test_capture_without_a_pool_warns_and_zeroes_its_own(streams, graph_counters):
    streams["capturing"] = True
    with pytest.warns(UserWarning, match="one eager call on this device before capturing"):
        c = BUFFERS.zeroed_counters(CPU, 100, stream())
    assert c.numel() == 100 and not c.any() and graph_counters.low


def test_empty_cache_drops_everything(streams):
    BUFFERS.split_scratch(CPU, layout(2), stream())
    BUFFERS.zeroed_counters(CPU, 2, stream())
    assert BUFFERS.scratch and BUFFERS.counters
    flash_cute.empty_cache()
    assert not BUFFERS.scratch and not BUFFERS.counters


SPLIT = ForwardVariant(
    "bfloat16",
    64,
    False,
    config=AttentionConfig(64, 64, pingpong=False, store_o_from_registers=True),
    seqused_k=True,
    split=True,
)


def split_plan(kernel, num_counters=8, out_shape=(1, 1, 4, 64), lse_shape=(1, 4, 1), lse=False):
    variant = dataclasses.replace(SPLIT, writes_lse=lse)
    plan = ForwardPlan(variant, num_splits=2, max_ctas=132, num_counters=num_counters)
    return runtime.LaunchPlan(plan, kernel, CPU, torch.float32, out_shape, lse_shape, 1.0)


def short_plan(kernel):
    """A launch plan of a variant that takes the short signature (no optional argument)."""
    variant = ForwardVariant("bfloat16", 64, False, config=AttentionConfig(64, 64, pingpong=False))
    plan = ForwardPlan(variant, num_splits=1, max_ctas=132, num_counters=0)
    return runtime.LaunchPlan(plan, kernel, CPU, torch.float32, (1, 1, 4, 64), (1, 4, 1), 0.5)


def call_args(q, **fields):
    """The kernel call arguments of a call of q with these Call fields."""
    return kernel_call_args(Call(q, q, q, **fields))


def test_launch_passes_arguments_in_the_signature_order(streams):
    """LaunchPlan.launch passes its values positionally: in the order of the compiled entry
    point (compile_cache.SHORT / FULL, read off the kernel's methods)."""
    kernel = Recorder()
    q, k, v, out = (torch.zeros(1, 1, 4, 64) for _ in range(4))
    short_plan(kernel).launch(q, k, v, out, call_args(q, kv_length=9))
    sent = dict(zip(SHORT.args, kernel.calls[-1]))
    assert len(kernel.calls[-1]) == len(SHORT.args)
    assert [sent[n] for n in ("q", "k", "v", "out")] == [q, k, v, out]
    assert (sent["kv_length"], sent["scale_log2"], sent["max_ctas"]) == (9, 0.5, 132)

    plan = split_plan(kernel, lse=True)
    seqused, table, cu_q, cu_k, used_q, idx, pad = (
        torch.zeros(3, dtype=torch.int32) for _ in range(7)
    )
    args = call_args(
        q, seqused_k=seqused, page_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        kv_length=5, seqused_q=used_q, kv_batch_idx=idx, leftpad_k=pad,
    )  # fmt: skip
    out, lse = plan.launch(q, k, v, None, args)
    sent = dict(zip(FULL.args, kernel.calls[-1]))
    assert len(kernel.calls[-1]) == len(FULL.args)
    assert sent["out"] is out and sent["lse"] is lse and lse.shape == (1, 4, 1)
    assert [sent[n] for n in ("seqused_k", "page_table", "cu_seqlens_q", "cu_seqlens_k")] == [
        seqused,
        table,
        cu_q,
        cu_k,
    ]
    assert [sent[n] for n in ("seqused_q", "kv_batch_idx", "leftpad_k")] == [used_q, idx, pad]
    assert (sent["kv_length"], sent["num_splits"], sent["max_ctas"]) == (5, 2, 132)
    assert sent["counters"] == BUFFERS.counters[stream()].data_ptr()
    assert sent["partials"] == BUFFERS.scratch[stream()][0].data_ptr()


def test_launch_plans_memo_their_stream_buffers(streams):
    """A plan reuses its last launch's per-stream buffers while the stream and the caches'
    version match: the same buffers the caches would hand out, without looking them up;
    another stream, a capture, a grown buffer or empty_cache() make it look again."""
    kernel = Recorder()
    plan = split_plan(kernel)
    q = torch.zeros(1, 1, 4, 64)

    def launch(kv_length=0):
        plan.launch(q, q, q, None, call_args(q, kv_length=kv_length))
        sent = dict(zip(FULL.args, kernel.calls[-1]))
        return sent["counters"], sent["partials"], sent["kv_length"]

    first = launch()
    assert first[0] == BUFFERS.zeroed_counters(CPU, 8, stream()).data_ptr()
    out_partial, lse_partial = BUFFERS.split_scratch(CPU, plan.scratch, stream())
    assert first[1] == out_partial.data_ptr()
    # The kernel finds the LSE partial right after the O partial (its __call__).
    assert lse_partial.data_ptr() == first[1] + 4 * out_partial.numel()
    assert lse_partial.is_contiguous()
    lookups = []
    real = BUFFERS.zeroed_counters
    BUFFERS.zeroed_counters = lambda *a: lookups.append(a) or real(*a)
    try:
        assert launch()[:2] == first[:2] and not lookups, "the same stream looked again"
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
        assert launch(kv_length=7)[2] == 7 and launch()[2] == 0, "an int length goes as is"
        runtime.FUNC_PLANS[("test",)] = plan
        fa3_plans = fa3.flash_attn_with_kvcache.entry_point.plans
        fa3_plan = split_plan(kernel)
        fa3_plan.buffers = plan.buffers
        fa3_plans[("test",)] = fa3_plan
        flash_cute.empty_cache()
        assert plan.buffers is None
        assert fa3_plan.buffers is None  # (every entry point's memos hold buffers)
        assert launch()[0] == BUFFERS.counters[stream()].data_ptr()
    finally:
        del BUFFERS.zeroed_counters
        runtime.FUNC_PLANS.pop(("test",), None)
        fa3.flash_attn_with_kvcache.entry_point.plans.pop(("test",), None)
    big_plan = split_plan(kernel, out_shape=(1, 1 << 12, 8, 128), lse_shape=(1, 8, 1 << 12))
    assert big_plan.scratch.numel > runtime.SCRATCH_MAX_FLOATS
    big_plan.launch(q, q, q, None, call_args(q))
    assert big_plan.buffers is None, "a per-call scratch allocation was kept"


def test_combine_launch_merges_after_the_kernel(streams, monkeypatch):
    """A combine_launch plan takes no counters and, after the forward kernel, launches the
    combine kernel on its partials: (K, B, S, H, D) and (K, B, S, H) views of the scratch the
    kernel wrote, into out and the LSE viewed the same way, every call."""
    merges = Recorder()
    monkeypatch.setattr(runtime, "get_combine_kernel", lambda key: merges)
    kernel = Recorder()
    variant = dataclasses.replace(SPLIT, writes_lse=True, combine_launch=True)
    out_shape, lse_shape = (2, 3, 4, 64), (2, 4, 3)
    plan = runtime.LaunchPlan(
        ForwardPlan(variant, num_splits=3, max_ctas=132, num_counters=0),
        kernel, CPU, torch.float32, out_shape, lse_shape, 1.0,
    )  # fmt: skip
    q = torch.zeros(1, 1, 4, 64)
    for _ in range(2):
        out, lse = plan.launch(q, q, q, None, call_args(q))
        sent = dict(zip(FULL.args, kernel.calls[-1]))
        assert sent["counters"] is None
        o_part, lse_part, o_view, lse_view, records = merges.calls[-1]
        assert records is None  # (an untraced variant)
        scratch_o, scratch_lse = BUFFERS.split_scratch(CPU, plan.scratch, stream())
        assert o_part.data_ptr() == scratch_o.data_ptr() == sent["partials"]
        assert tuple(o_part.shape) == (3, *out_shape) and o_view is out
        assert tuple(lse_part.shape) == (3, 2, 3, 4) and tuple(lse_view.shape) == (2, 3, 4)
        # (B, S, H) indexing of the LSE views reaches the kernel's (B, H, S) element.
        assert lse_view[1, 2, 3].data_ptr() == lse[1, 3, 2].data_ptr()
        assert lse_part[2, 1, 2, 3].data_ptr() == scratch_lse[2, 1, 3, 2].data_ptr()
    assert len(merges.calls) == 2 and plan.buffers is None


def test_short_signature_plans_allocate_out_like_q():
    kernel = Recorder()
    launch = short_plan(kernel)
    launch.out_like_q = True
    q = torch.zeros(1, 1, 4, 64)
    out = launch.launch(q, q, q, None, call_args(q))
    assert out.shape == q.shape and out is not q and kernel.calls[-1][3] is out
    given = torch.empty_like(q)
    assert launch.launch(q, q, q, given, call_args(q)) is given and kernel.calls[-1][3] is given


def test_default_stream_skips_the_capture_query(streams, monkeypatch):
    """The legacy default stream (raw handle 0) cannot be captured, so calls on it do not ask
    whether a capture is under way; any other stream does."""
    asked = []
    monkeypatch.setattr(
        runtime, "stream_capturing", lambda: asked.append(1) or streams["capturing"]
    )
    streams["stream"] = 0
    assert stream() == (None, 0) and not asked
    streams["stream"], streams["capturing"] = 5, True
    assert stream() is None and asked


def test_calls_launch_through_the_plans_they_build(fake_gpu, monkeypatch):
    """A first call builds a launch plan and launches through it; the same call again replays
    it without building another; an int cache_seqlens of the same bit length replays too."""
    builds = []
    real_build = runtime.LaunchPlan.build
    monkeypatch.setattr(
        runtime.LaunchPlan, "build", staticmethod(lambda *a: builds.append(1) or real_build(*a))
    )
    bf16 = torch.bfloat16
    q = torch.randn(2, 100, 8, 128, dtype=bf16)
    k, v = torch.randn(2, 300, 2, 128, dtype=bf16), torch.randn(2, 300, 2, 128, dtype=bf16)
    for _ in range(3):
        out, lse = flash_cute.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert len(builds) == 1 and len(runtime.FUNC_PLANS) == 1
    (variant, kernel), *_ = fake_gpu.items()
    assert variant.causal and variant.writes_lse and len(kernel.calls) == 3
    sent = dict(zip(FULL.args, kernel.calls[-1]))
    assert sent["q"] is q and sent["out"] is out and sent["lse"] is lse
    assert out.shape == q.shape and lse.shape == (2, 8, 100)

    qd = torch.randn(3, 1, 32, 128, dtype=bf16)
    cache = torch.randn(3, 4096, 8, 128, dtype=bf16)
    for length in (1000, 1023, 600):  # bit length 10: one plan
        flash_cute.flash_attn_with_kvcache(qd, cache, cache, length)
    assert len(builds) == 2 and len(runtime.KVCACHE_PLANS) == 1
    decode = next(v for v in fake_gpu if v.scalar_kv_length)
    assert decode.split and decode.pack_gqa_ratio == 4
    assert [dict(zip(FULL.args, c))["kv_length"] for c in fake_gpu[decode].calls] == [
        1000,
        1023,
        600,
    ]
    with pytest.raises(ValueError, match="exceeds the cache's capacity"):
        flash_cute.flash_attn_with_kvcache(qd, cache, cache, 5000)


def test_sm_margin_sizes_persistent_grids_from_the_sms_left(fake_gpu):
    """FlashAttention-3's sm_margin: a launch plans for the SMs it leaves (its persistent grid
    caps at that many CTAs per SM's share); each margin replays a plan of its own, and the
    margin is checked."""
    from flash_cute import flash_attn_interface as fa3

    bf16 = torch.bfloat16
    q, k = torch.randn(2, 1000, 8, 128, dtype=bf16), torch.randn(2, 1000, 8, 128, dtype=bf16)
    sms = []  # per call: the persistent grid's cap over CTAs per SM
    for margin in (0, 32, 0, 131, 32):
        before = {v: len(kernel.calls) for v, kernel in fake_gpu.items()}
        fa3.flash_attn_func(q, k, k, causal=True, sm_margin=margin)
        ((variant, kernel),) = [
            (v, kern) for v, kern in fake_gpu.items() if len(kern.calls) > before.get(v, 0)
        ]
        assert variant.config.scheduler != "single_tile"
        sent = kernel.calls[-1]
        names = SHORT.args if len(sent) == len(SHORT.args) else FULL.args
        sms.append(dict(zip(names, sent))["max_ctas"] / variant.config.ctas_per_sm)
    assert sms == [132, 100, 132, 1, 100]
    assert len(fa3.flash_attn_func.entry_point.plans) == 3
    with pytest.raises(ValueError, match="sm_margin must leave at least one"):
        fa3.flash_attn_func(q, k, k, sm_margin=132)
    with pytest.raises(TypeError, match="sm_margin must be a Python int"):
        fa3.flash_attn_func(q, k, k, sm_margin=2.0)


def test_calls_with_nothing_to_compute_launch_nothing(fake_gpu):
    bf16 = torch.bfloat16
    qd = torch.randn(3, 1, 32, 128, dtype=bf16)
    cache = torch.randn(3, 4096, 8, 128, dtype=bf16)
    out, lse = flash_cute.flash_attn_with_kvcache(
        qd, cache, cache, 0, out=torch.full_like(qd, float("nan")), return_softmax_lse=True
    )
    assert not fake_gpu and not out.any() and bool((lse == float("-inf")).all())
    empty = flash_cute.flash_attn_func(qd[:0], cache[:0], cache[:0])
    assert empty.shape == (0, 1, 32, 128) and not fake_gpu


def test_first_call_copies_what_tma_cannot_take(fake_gpu):
    """An out whose address TMA cannot take gets the kernel's result by a copy, and such a
    call is not kept for replay."""
    bf16 = torch.bfloat16
    q = torch.randn(1, 64, 4, 64, dtype=bf16)
    k = v = torch.randn(1, 64, 4, 64, dtype=bf16)
    misaligned = torch.empty(q.numel() + 1, dtype=bf16)[1:].view(q.shape)
    assert flash_cute.flash_attn_func(q, k, v, out=misaligned) is misaligned
    (kernel,) = fake_gpu.values()
    sent = dict(zip(SHORT.args, kernel.calls[-1]))
    assert sent["out"].data_ptr() % 16 == 0 and not runtime.FUNC_PLANS


def test_traced_plans_pass_zeroed_records_and_collect_them(streams):
    """A traced variant's launch gets fresh zeroed (tiles, RECORD_WORDS) int64 records as its
    last argument and leaves them in TRACED_LAUNCHES; under graph capture it refuses."""
    from flash_cute.kernels.trace_records import RECORD_WORDS

    kernel = Recorder()
    config = AttentionConfig(128, 128, trace=True)
    variant = ForwardVariant("bfloat16", 64, False, config=config, writes_lse=True)
    plan = runtime.LaunchPlan(
        ForwardPlan(variant, num_splits=1, max_ctas=132, num_counters=0, trace_slots=6),
        kernel, CPU, torch.float32, (2, 3, 4, 64), (2, 4, 3), 1.0,
    )  # fmt: skip
    runtime.TRACED_LAUNCHES.clear()
    q = torch.zeros(2, 3, 4, 64)
    plan.launch(q, q, q, None, call_args(q))
    sent = dict(zip(FULL.args, kernel.calls[-1]))
    records = sent["trace"]
    assert records.shape == (6, RECORD_WORDS) and records.dtype == torch.int64
    assert not records.any()
    (traced,) = runtime.TRACED_LAUNCHES
    assert traced.records is records and traced.config == config
    assert traced.label == variant.describe()
    runtime.TRACED_LAUNCHES.clear()
    streams["capturing"] = True
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        plan.launch(q, q, q, None, call_args(q))


def test_untraced_full_signature_plans_pass_no_records(streams):
    kernel = Recorder()
    plan = runtime.LaunchPlan(
        ForwardPlan(SPLIT, num_splits=3, max_ctas=132, num_counters=4),
        kernel, CPU, torch.float32, (2, 3, 4, 64), (2, 4, 3), 1.0,
    )  # fmt: skip
    q = torch.zeros(1, 1, 4, 64)
    plan.launch(q, q, q, None, call_args(q))
    assert dict(zip(FULL.args, kernel.calls[-1]))["trace"] is None


def test_threads_capturing_at_once_take_disjoint_counters(graph_counters):
    """Captures on several threads take pre-zeroed counters from one pool: no two slices may
    overlap (the pool's offset is advanced under a lock)."""
    import threading
    import time

    counters = runtime.GRAPH_COUNTERS
    counters.CHUNK = 1 << 16  # room for every slice: none falls back to a fresh fill
    counters.refill(CPU)

    class Yielding(list):
        """The pool's [tensor, offset], yielding the thread whenever the offset is read: a race
        between reading and advancing it then shows at once."""

        def __getitem__(self, index):
            if index == 1:
                time.sleep(0)
            return super().__getitem__(index)

    counters.pools[CPU.index] = Yielding(counters.pools[CPU.index])
    taken, barrier = [], threading.Barrier(8)

    def capture():
        barrier.wait()
        taken.extend(counters.take(CPU, 3) for _ in range(300))

    threads = [threading.Thread(target=capture) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts = sorted(t.data_ptr() for t in taken)
    assert len(starts) == 8 * 300 and all(b - a >= 3 * 4 for a, b in zip(starts, starts[1:]))
    assert all(t._base is not None for t in taken)  # slices of the pool


def test_replays_let_errors_other_than_refusals_through(fake_gpu):
    """A replay whose launch fails for another reason than a refused argument (a CUDA error,
    out of memory) raises it: it is not retried through the checks as a refusal would be."""
    bf16 = torch.bfloat16
    q, k = torch.randn(1, 64, 4, 64, dtype=bf16), torch.randn(1, 64, 4, 64, dtype=bf16)
    flash_cute.flash_attn_func(q, k, k)
    (kernel,) = fake_gpu.values()

    def fail(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kernel.__class__ = type("Failing", (Recorder,), {"__call__": lambda self, *a: fail()})
    with pytest.raises(RuntimeError, match="illegal memory access"):
        flash_cute.flash_attn_func(q, k, k)
    assert len(runtime.FUNC_PLANS) == 1  # (no second plan: the checks never ran)


def test_refused_replays_take_the_checks(fake_gpu, monkeypatch):
    """A replay the compiled function refuses (TypeError / ValueError from its argument checks)
    takes the full checks, which plan the call afresh."""
    bf16 = torch.bfloat16
    q, k = torch.randn(1, 64, 4, 64, dtype=bf16), torch.randn(1, 64, 4, 64, dtype=bf16)
    flash_cute.flash_attn_func(q, k, k)
    (kernel,) = fake_gpu.values()
    refused = []

    def refuse_once(self, *args):
        if not refused:
            refused.append(1)
            raise ValueError("Mismatched stride on argument q")
        self.calls.append(args)

    kernel.__class__ = type("RefusingOnce", (Recorder,), {"__call__": refuse_once})
    before = len(kernel.calls)
    flash_cute.flash_attn_func(q, k, k)
    assert refused and len(kernel.calls) == before + 1
