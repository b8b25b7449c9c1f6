"""Host cost per cached call of this package (PYTHONPATH picks old or new), tiny problems."""

import statistics
import time

import torch

import flash_cute

print("# package:", flash_cute.__file__)
q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
out = torch.empty_like(q)
qd = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
sl = torch.full((1,), 1000, dtype=torch.int32, device="cuda")
side = torch.cuda.Stream()
calls = {
    "func": lambda: flash_cute.flash_attn_func(q, k, v),
    "func out=": lambda: flash_cute.flash_attn_func(q, k, v, out=out),
    "func causal": lambda: flash_cute.flash_attn_func(q, k, v, causal=True),
    "kvcache tensor len, no split": lambda: flash_cute.flash_attn_with_kvcache(
        qd, kc, vc, sl, num_splits=1
    ),
    "kvcache int len, no split": lambda: flash_cute.flash_attn_with_kvcache(
        qd, kc, vc, 1000, num_splits=1
    ),
    "kvcache tensor len, auto split": lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, sl),
    "kvcache int len, auto split": lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, 1000),
    "torch x.add_(0)": lambda: q.add_(0),
}
for fn in calls.values():
    for _ in range(300):
        fn()
torch.cuda.synchronize()
res = {n: [] for n in calls}
names = list(calls)
for r in range(15):
    order = names[r % len(names) :] + names[: r % len(names)]
    for n in order:
        fn = calls[n]
        t = time.perf_counter()
        for _ in range(500):
            fn()
        res[n].append((time.perf_counter() - t) / 500 * 1e6)
        torch.cuda.synchronize()
for n, vals in res.items():
    print(f"{n:32s} median {statistics.median(vals):5.1f} us  best {min(vals):5.1f} us")
