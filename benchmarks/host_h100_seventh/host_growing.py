"""Host cost of kvcache calls with an int cache_seqlens growing by one per call, old vs new package."""

import statistics
import time

import torch

import flash_cute

print("# package:", flash_cute.__file__)
qd = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
g = iter(range(1 << 40))
calls = {
    "int +1 per call, auto split": lambda: flash_cute.flash_attn_with_kvcache(
        qd, kc, vc, cache_seqlens=512 + next(g) % 512
    ),
    "int 1000, auto split": lambda: flash_cute.flash_attn_with_kvcache(
        qd, kc, vc, cache_seqlens=1000
    ),
    "int +1 per call, no split": lambda: flash_cute.flash_attn_with_kvcache(
        qd, kc, vc, cache_seqlens=512 + next(g) % 512, num_splits=1
    ),
}
for fn in calls.values():
    for _ in range(600):
        fn()
torch.cuda.synchronize()
res = {n: [] for n in calls}
for r in range(11):
    for n, fn in calls.items():
        t = time.perf_counter()
        for _ in range(500):
            fn()
        res[n].append((time.perf_counter() - t) / 500 * 1e6)
        torch.cuda.synchronize()
for n, v in res.items():
    print(f"{n}: median {statistics.median(v):.1f} us, best {min(v):.1f} us")
