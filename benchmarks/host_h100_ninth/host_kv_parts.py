"""Where a cached split flash_attn_with_kvcache call's Python time goes (device CPU)."""

import statistics
import time

import torch

import flash_cute
from flash_cute import interface as I

qd = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
sl = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
flash_cute.flash_attn_with_kvcache(qd, kc, vc, sl)
flash_cute.flash_attn_func(q, k, k)
plan = [p for p in I._KVCACHE_PLANS.values() if p.num_splits > 1][0]
print("splits", plan.num_splits)
real = plan.forward
noop = I._LaunchPlan(
    lambda *a: None,
    plan.device,
    plan.dtype,
    plan.out_shape,
    None,
    plan.scale_log2,
    plan.max_ctas,
    plan.num_splits,
    plan.partials,
    plan.extents,
    num_counters=plan.num_counters,
    out_like_q=plan.out_like_q,
)
out = torch.empty_like(qd)
pt = None


def kv_key():
    (
        cache_seqlens,
        page_table,
        softmax_scale,
        causal,
        num_splits,
        pack_gqa,
        return_softmax_lse,
        config,
    ) = sl, None, None, False, 0, None, False, None
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_meta = (cache_seqlens.shape, cache_seqlens.dtype)
    return (
        qd.shape,
        qd.dtype,
        qd.get_device(),
        kc.shape,
        seqlens_meta,
        None if page_table is None else (page_table.shape, page_table.dtype),
        qd.is_contiguous(),
        softmax_scale,
        causal,
        num_splits,
        pack_gqa,
        return_softmax_lse,
        config,
        type(softmax_scale),
        type(causal),
        type(num_splits),
        type(pack_gqa),
        type(return_softmax_lse),
    )


def func_key():
    softmax_scale, causal, return_lse, config = None, False, False, None
    return (
        q.shape,
        q.dtype,
        q.get_device(),
        k.shape,
        q.is_contiguous(),
        softmax_scale,
        causal,
        return_lse,
        config,
        type(softmax_scale),
        type(causal),
        type(return_lse),
    )


key = kv_key()
assert key in I._KVCACHE_PLANS, "key differs from interface's"
calls = {
    "kvcache split, whole call": lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, sl),
    "kvcache key build": kv_key,
    "func key build": func_key,
    "kvcache dict get": lambda: I._KVCACHE_PLANS.get(key),
    "_current_device()": I._current_device,
    "_stream_key": lambda: I._stream_key(plan.device),
    "launch, no-op kernel (memo hit)": lambda: noop.launch(qd, kc, vc, None, sl, None),
    "torch.empty_like(qd)": lambda: torch.empty_like(qd),
    "raw split forward (out, scratch ready)": None,
}
noop.launch(qd, kc, vc, None, sl, None)
ctr, scr = noop.buffers[2]
calls["raw split forward (out, scratch ready)"] = lambda: real(
    qd,
    kc,
    vc,
    out,
    None,
    scr,
    plan.scale_log2,
    None,
    None,
    sl,
    None,
    ctr,
    plan.max_ctas,
    plan.num_splits,
    0,
)
for fn in calls.values():
    for _ in range(200):
        fn()
torch.cuda.synchronize()
res = {n: [] for n in calls}
names = list(calls)
for r in range(15):
    for n in names[r % len(names) :] + names[: r % len(names)]:
        fn = calls[n]
        t = time.perf_counter()
        for _ in range(500):
            fn()
        res[n].append((time.perf_counter() - t) / 500 * 1e6)
        torch.cuda.synchronize()
for n in names:
    print(f"{n:42s} {statistics.median(res[n]):6.2f} {min(res[n]):6.2f}")
