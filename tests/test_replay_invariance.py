"""Replay invariance on the CPU: over random call sequences through every entry point (native
and FlashAttention-3's), each call's launch (replayed or first) equals the launch a fresh
process makes for that call: the same variant, launch constants and kernel arguments.

Sequences mix windows, chunks, int and tensor key counts that grow and shrink across the
window (a decode loop), padded and paged caches of several page sizes, split counts, dtypes,
GQA, FP8 caches and qv. The kernels are recorders (the conftest's fake_gpu): what a launch
would compute is the GPU tests' business; which launch a call gets is this test's."""

import random

import pytest
import torch

import flash_cute
from flash_cute import entry, runtime
from flash_cute import flash_attn_interface as fa3

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
WINDOWS = [(-1, -1), (0, 0), (40, 0), (100, 0), (127, 0), (200, 3), (-1, 20), (255, 0)]
CHUNKS = [0, 0, 0, 64, 100]


@pytest.fixture
def launches(fake_gpu, monkeypatch):
    """Every LaunchPlan.launch that ran: (plan, kernel arguments) of each, in order."""
    seen = []
    real = runtime.LaunchPlan.launch

    def launch(self, q, k, v, out, call_args):
        result = real(self, q, k, v, out, call_args)  # (a launch the kernel refused: none)
        seen.append((self, (q, k, v, out, call_args)))
        return result

    monkeypatch.setattr(runtime.LaunchPlan, "launch", launch)
    return seen


def plan_of(launch_plan) -> tuple:
    """What a launch plan decided (everything but the buffers it last used)."""
    names = [n for n in runtime.LaunchPlan.__slots__ if n not in ("buffers", "kernel", "merge")]
    return tuple(getattr(launch_plan, n) for n in names)


def same_arguments(a, b) -> bool:
    """Kernel arguments equal: the same tensors (out aside, which a call may allocate) and
    values."""
    (qa, ka, va, _, args_a), (qb, kb, vb, _, args_b) = a, b
    return (qa, ka, va) == (qb, kb, vb) and all(
        x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(args_a, args_b)
    )


def fresh(call, launches):
    """The launch a fresh process makes for call(): the plan caches emptied, then restored."""
    saved = [(p.plans, dict(p.plans)) for p in entry.ENTRY_POINTS]
    for plans, _ in saved:
        plans.clear()
    try:
        before = len(launches)
        call()
        return launches[before:]
    finally:
        for plans, kept in saved:
            plans.clear()
            plans.update(kept)


def tensor(rng, *shape, dtype=BF16):
    del rng  # (torch's generator, seeded per test)
    return torch.randn(*shape).to(dtype)


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


class Scenario:
    """One call site (an entry point and fixed tensors) whose key counts, and some options, vary
    from call to call as an engine's decode loop would vary them."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        r = rng
        self.kind = r.choice(["kvcache", "kvcache", "fa3_kvcache", "func", "fa3_func", "varlen"])
        self.dtype = r.choice([BF16, FP16])
        self.batch = r.choice([1, 2, 3])
        self.nheads_kv = r.choice([1, 2])
        self.nheads = self.nheads_kv * r.choice([1, 4, 8])
        self.d = r.choice([64, 128])
        self.seqlen_q = r.choice([1, 1, 2, 5, 17])
        self.capacity = r.choice([160, 256, 300])
        self.window = r.choice(WINDOWS)
        self.chunk = r.choice(CHUNKS)
        self.causal = r.random() < 0.7
        self.int_lengths = r.random() < 0.6
        self.page_size = r.choice([None, None, 1, 8, 16, 64])
        self.fp8 = self.kind in ("kvcache", "fa3_kvcache") and r.random() < 0.2
        self.qv = self.kind in ("kvcache", "func") and not self.fp8 and r.random() < 0.1
        self.splits = r.choice([0, 0, 1, 3])
        self.pack_gqa = r.choice([None, None, True, False])
        self.lse = r.random() < 0.3
        self.sink = r.random() < 0.2
        self.softcap = r.choice([0.0, 0.0, 30.0])
        self._tensors()

    def _tensors(self):
        r, b, hkv, d = self.rng, self.batch, self.nheads_kv, self.d
        dv = d
        if self.qv:  # absorbed MLA: rope part 64, latent 512, one kv head
            self.d, d, dv, hkv = 64, 64, 512, 1
            self.nheads_kv = 1
        self.q = tensor(r, b, self.seqlen_q, self.nheads, d, dtype=self.dtype)
        self.qv_t = (
            tensor(r, b, self.seqlen_q, self.nheads, dv, dtype=self.dtype) if self.qv else None
        )
        kv_dtype = FP8 if self.fp8 else self.dtype
        if self.page_size:
            pages_per_seq = -(-self.capacity // self.page_size)
            self.capacity = pages_per_seq * self.page_size
            num_pages = b * pages_per_seq + 3
            self.k = tensor(r, num_pages, self.page_size, hkv, d, dtype=kv_dtype)
            self.v = tensor(r, num_pages, self.page_size, hkv, dv, dtype=kv_dtype)
            perm = torch.randperm(num_pages)[: b * pages_per_seq]
            self.page_table = perm.view(b, pages_per_seq).to(torch.int32)
        else:
            self.k = tensor(r, b, self.capacity, hkv, d, dtype=kv_dtype)
            self.v = tensor(r, b, self.capacity, hkv, dv, dtype=kv_dtype)
            self.page_table = None
        self.descale = torch.full((b, hkv), 0.5) if self.fp8 and r.random() < 0.5 else None
        self.sink_t = torch.randn(self.nheads) if self.sink else None
        self.length = r.randint(0, self.capacity)

    def next_length(self) -> int:
        """A decode loop's next length: mostly one more, at times a jump either way."""
        r = self.rng
        step = r.choice([1, 1, 1, 1, -1, r.randint(-80, 80)])
        self.length = max(0, min(self.capacity, self.length + step))
        return self.length

    def make_call(self):
        """A call (a thunk) with this scenario's next key counts."""
        n = self.next_length()
        margin = self.rng.choice([0, 0, 16, 100])  # (FlashAttention-3's sm_margin, per call)
        if self.kind in ("func", "fa3_func"):
            k, v = self.k, self.v
            if self.page_table is not None or self.fp8:
                k = tensor(
                    self.rng, self.batch, self.capacity, self.nheads_kv, self.d, dtype=self.dtype
                )
                v = k if not self.qv else self.v
            if self.kind == "func":
                return lambda: flash_cute.flash_attn_func(
                    self.q, k, v, causal=self.causal, return_lse=self.lse,
                    window_size=self.window, attention_chunk=self.chunk, softcap=self.softcap,
                    learnable_sink=self.sink_t, qv=self.qv_t,
                )  # fmt: skip
            return lambda: fa3.flash_attn_func(
                self.q, k, v, causal=self.causal, window_size=list(self.window),
                attention_chunk=self.chunk, softcap=self.softcap, num_splits=self.splits or 1,
                pack_gqa=self.pack_gqa, return_attn_probs=self.lse, learnable_sink=self.sink_t,
                sm_margin=margin,
            )  # fmt: skip
        lengths = n if self.int_lengths else int32([max(0, n - i) for i in range(self.batch)])
        if self.kind == "varlen":
            q = self.q.reshape(-1, self.nheads, self.d)
            cu = int32([i * self.seqlen_q for i in range(self.batch + 1)])
            return lambda: flash_cute.flash_attn_varlen_func(
                q, self.k, self.v, cu, self.seqlen_q, seqused_k=lengths,
                page_table=self.page_table, causal=self.causal, num_splits=self.splits,
                pack_gqa=self.pack_gqa, return_softmax_lse=self.lse, window_size=self.window,
                attention_chunk=self.chunk, softcap=self.softcap, learnable_sink=self.sink_t,
            )  # fmt: skip
        if self.kind == "fa3_kvcache":
            return lambda: fa3.flash_attn_with_kvcache(
                self.q, self.k, self.v, cache_seqlens=lengths, page_table=self.page_table,
                k_descale=self.descale, v_descale=self.descale, causal=self.causal,
                window_size=self.window, attention_chunk=self.chunk, softcap=self.softcap,
                num_splits=self.splits, pack_gqa=self.pack_gqa,
                return_softmax_lse=self.lse, learnable_sink=self.sink_t, sm_margin=margin,
            )  # fmt: skip
        v = self.k[..., : self.v.shape[-1]] if self.qv and self.rng.random() < 0.5 else self.v
        return lambda: flash_cute.flash_attn_with_kvcache(
            self.q, self.k, v, lengths, self.page_table, causal=self.causal,
            num_splits=self.splits, pack_gqa=self.pack_gqa, return_softmax_lse=self.lse,
            window_size=self.window, attention_chunk=self.chunk, softcap=self.softcap,
            learnable_sink=self.sink_t, qv=self.qv_t, k_descale=self.descale,
            v_descale=self.descale,
        )  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_replays_equal_fresh_plans(launches, seed):
    """Each call of interleaved random scenarios launches what a fresh process launches."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    scenarios = [Scenario(rng) for _ in range(4)]
    replays = 0
    for step in range(60):
        scenario = rng.choice(scenarios)
        call = scenario.make_call()
        before, plans = len(launches), sum(len(p.plans) for p in entry.ENTRY_POINTS)
        try:
            call()
        except (ValueError, TypeError, NotImplementedError) as err:
            # A call the checks refuse (a config no table row serves, say) is refused afresh.
            with pytest.raises(type(err)):
                fresh(call, launches)
            continue
        got = launches[before:]
        replays += sum(len(p.plans) for p in entry.ENTRY_POINTS) == plans and bool(got)
        want = fresh(call, launches)
        assert [plan_of(p) for p, _ in got] == [plan_of(p) for p, _ in want], (
            f"seed {seed} step {step}: {scenario.kind} length {scenario.length} "
            f"window {scenario.window} chunk {scenario.chunk}"
        )
        assert all(same_arguments(a, b) for (_, a), (_, b) in zip(got, want))
    assert replays > 0  # (the sequences do replay)


def test_window_decode_loop_replays_keep_the_window(launches):
    """The issue's case: a window of 1000 keys behind each query, an int length growing from 600
    and then one key at a time through 1010. Every launch of more than 1001 keys is windowed:
    the plan made at 600 is made for its whole length class (512 .. 1023), which it then
    serves."""
    q = tensor(None, 1, 1, 8, 64)
    cache = tensor(None, 1, 2048, 2, 64)
    for length in (600, *range(990, 1030)):
        flash_cute.flash_attn_with_kvcache(
            q, cache, cache, cache_seqlens=length, causal=True, window_size=(1000, 0)
        )
    lengths = [args[4][-1] for _, args in launches]
    assert lengths == [600, *range(990, 1030)]
    assert all(p.variant.window_left == 1000 for p, _ in launches)
    assert len({id(p) for p, _ in launches}) == 2  # one plan per length class (512, 1024)


def test_what_the_key_leaves_out_the_compiled_function_refuses(launches):
    """The key holds no dtype of k and v nor v's head dim: calls alike in everything else
    (a 16-bit and an FP8 cache of one shape; v of head dim 128 and 64) share a key, and a plan
    made for one is refused by the other's compiled function, so each call still launches
    what a fresh process would."""
    q = tensor(None, 2, 1, 8, 128)
    cache = tensor(None, 2, 300, 2, 128)
    cache8 = cache.to(FP8)
    qp, kp = tensor(None, 1, 64, 4, 128), tensor(None, 1, 64, 4, 128)
    v128, v64 = tensor(None, 1, 64, 4, 128), tensor(None, 1, 64, 4, 64)
    calls = [
        lambda: flash_cute.flash_attn_with_kvcache(q, cache, cache, 200),
        lambda: flash_cute.flash_attn_with_kvcache(q, cache8, cache8, 200),
        lambda: flash_cute.flash_attn_func(qp, kp, v128, causal=True),
        lambda: flash_cute.flash_attn_func(qp, kp, v64, causal=True),
    ]
    for call in calls * 3:
        before = len(launches)
        call()
        got = launches[before:]
        want = fresh(call, launches)
        assert [plan_of(p) for p, _ in got] == [plan_of(p) for p, _ in want]
    kv_dtypes = {p.variant.kv_dtype for p, _ in launches}
    head_dims_v = {p.variant.head_dim_v for p, _ in launches}
    assert kv_dtypes == {None, "float8_e4m3fn"} and head_dims_v == {64, 128}


def test_a_replayed_call_keeps_its_appended_keys(launches):
    """Call.appended_keys (rows an append wrote past seqused_k's counts) is the kernel's scalar
    on a replay through the Call entry point too, as on the first call."""
    from flash_cute.interface import _FORWARD_CALL

    q, k = torch.randn(2, 1, 8, 64).to(BF16), torch.randn(2, 64, 2, 64).to(BF16)
    lengths = int32([5, 9])
    for appended in (1, 1, 3, None, 2):
        _FORWARD_CALL(q, k, k, seqused_k=lengths, appended_keys=appended)
        replayed = launches[-1]
        first = fresh(lambda: _FORWARD_CALL(q, k, k, seqused_k=lengths, appended_keys=appended),
                      launches)[-1]  # fmt: skip
        assert replayed[0].variant == first[0].variant
        assert replayed[0].variant.after_append == (appended is not None)
        assert same_arguments(replayed[1], first[1])
        assert replayed[1][4][-1] == (appended or 0)
