"""Host time of a cached call, split into its parts; wall and thread-CPU time, interleaved rounds."""

import gc
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks/host_h100_seventh")
from host_probe import compile_all

import flash_cute
from flash_cute import interface as I

q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
out = torch.empty_like(q)
qd = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
sl = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
flash_cute.flash_attn_func(q, k, v)
plan = next(iter(I._FUNC_PLANS.values()))
probe = compile_all()["1 tensor"]


class _Noop:
    def __init__(self, p):
        self.p = p


noop_plan = I._LaunchPlan(
    lambda *a: None,
    plan.device,
    plan.dtype,
    plan.out_shape,
    None,
    plan.scale_log2,
    plan.max_ctas,
    1,
    None,
    plan.extents,
    out_like_q=plan.out_like_q,
    short_signature=True,
)
scratch = torch.zeros(8, device="cuda")
calls = {
    "func": lambda: flash_cute.flash_attn_func(q, k, v),
    "func out=": lambda: flash_cute.flash_attn_func(q, k, v, out=out),
    "kvcache no split": lambda: flash_cute.flash_attn_with_kvcache(
        qd, kc, vc, cache_seqlens=sl, num_splits=1
    ),
    "kvcache auto split": lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl),
    "raw forward (out given)": lambda: plan.forward(
        q, k, v, out, plan.scale_log2, plan.max_ctas, 0
    ),
    "empty DSL kernel, 1 tensor": lambda: probe(q),
    "torch.empty_like(q)": lambda: torch.empty_like(q),
    "plan.launch with a no-op kernel": lambda: noop_plan.launch(q, k, v, None),
    "torch x.add_(0)": lambda: scratch.add_(0),
}
for fn in calls.values():
    for _ in range(200):
        fn()
torch.cuda.synchronize()
wall = {n: [] for n in calls}
cpu = {n: [] for n in calls}
names = list(calls)
N = 500
for r in range(21):
    for n in names[r % len(names) :] + names[: r % len(names)]:
        fn = calls[n]
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(N):
            fn()
        c1, t1 = time.thread_time(), time.perf_counter()
        wall[n].append((t1 - t0) / N * 1e6)
        cpu[n].append((c1 - c0) / N * 1e6)
        torch.cuda.synchronize()
gc.disable()
gcoff = []
for r in range(11):
    t0 = time.perf_counter()
    for _ in range(N):
        calls["func"]()
    gcoff.append((time.perf_counter() - t0) / N * 1e6)
    torch.cuda.synchronize()
gc.enable()
print(f"{'call':34s} {'wall med':>8s} {'best':>6s} {'cpu med':>8s} {'best':>6s}")
for n in names:
    print(
        f"{n:34s} {statistics.median(wall[n]):8.2f} {min(wall[n]):6.2f} {statistics.median(cpu[n]):8.2f} {min(cpu[n]):6.2f}"
    )
print(f"{'func, gc disabled':34s} {statistics.median(gcoff):8.2f} {min(gcoff):6.2f}")
