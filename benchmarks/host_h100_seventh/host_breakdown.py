"""Where the host time of a cached call goes (tiny problems, back-to-back calls)."""

import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import flash_cute
from flash_cute import interface as I


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    torch.cuda.synchronize()
    return best


q = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
out = torch.empty_like(q)
flash_cute.flash_attn_func(q, k, v)
plan = next(iter(I._FUNC_PLANS.values()))
qd = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
sl = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
qt = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
kt = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
res = {}
flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl)
kp = [p for p in I._KVCACHE_PLANS.values() if p.num_splits > 1]
kp = kp[0] if kp else None
od = torch.empty_like(qd)
ctr = (
    I._zeroed_counters(q.device, plan.num_counters, I._stream_key(q.device))
    if plan.num_counters
    else None
)
print("plan counters", plan.num_counters)
for rnd in range(3):
    r = {}
    r["func"] = per_call_us(lambda: flash_cute.flash_attn_func(q, k, v))
    r["func out="] = per_call_us(lambda: flash_cute.flash_attn_func(q, k, v, out=out))
    r["  key tuple"] = per_call_us(
        lambda: (
            q.shape,
            q.stride(),
            q.dtype,
            q.get_device(),
            k.shape,
            k.stride(),
            k.dtype,
            k.get_device(),
            v.shape,
            v.stride(),
            v.dtype,
            v.get_device(),
            None,
            None,
            False,
            False,
            None,
        )
    )
    r["  dict get"] = per_call_us(
        lambda: I._FUNC_PLANS.get(
            (
                q.shape,
                q.stride(),
                q.dtype,
                q.get_device(),
                k.shape,
                k.stride(),
                k.dtype,
                k.get_device(),
                v.shape,
                v.stride(),
                v.dtype,
                v.get_device(),
                None,
                None,
                False,
                False,
                None,
                type(None),
                bool,
                bool,
            )
        )
    )
    r["  usable"] = per_call_us(lambda: plan.usable(q, k, v, None))
    r["  empty_like(q)"] = per_call_us(lambda: torch.empty_like(q))
    r["  raw forward (out given)"] = per_call_us(
        lambda: plan.forward(
            q,
            k,
            v,
            out,
            None,
            None,
            None,
            plan.scale_log2,
            None,
            None,
            None,
            None,
            ctr,
            plan.max_ctas,
            1,
            0,
        )
    )
    r["  _current_device"] = per_call_us(lambda: I._current_device())
    r["kvcache splits=1"] = per_call_us(
        lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl, num_splits=1)
    )
    r["kvcache splits=auto"] = per_call_us(
        lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=sl)
    )
    r["kvcache int len auto"] = per_call_us(
        lambda: flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=1000)
    )
    r["  _stream_key"] = per_call_us(lambda: I._stream_key(q.device))
    r["  _zeroed_counters"] = per_call_us(
        lambda: I._zeroed_counters(q.device, 8, I._stream_key(q.device))
    )
    if kp:
        r["  _split_scratch"] = per_call_us(
            lambda: I._split_scratch(q.device, kp.partials, I._stream_key(q.device))
        )
        sk = I._stream_key(q.device)
        c8 = I._zeroed_counters(q.device, kp.num_counters, sk)
        op, lp = I._split_scratch(q.device, kp.partials, sk)
        r["  raw split forward"] = per_call_us(
            lambda: kp.forward(
                qd,
                kc,
                vc,
                od,
                None,
                op,
                lp,
                kp.scale_log2,
                None,
                None,
                sl,
                None,
                c8,
                kp.max_ctas,
                kp.num_splits,
                0,
            )
        )
    r["sdpa tiny (1,8,1|256,128)"] = per_call_us(lambda: sdpa(qt, kt, kt))
    r["noop torch op (q.add_(0))"] = per_call_us(lambda: q.add_(0))
    r["torch.cuda.current_stream()"] = per_call_us(lambda: torch.cuda.current_stream())
    for name, us in r.items():
        res.setdefault(name, []).append(us)
kplan = [p for p in I._KVCACHE_PLANS.values() if p.num_splits > 1]
print("kvcache auto splits:", kplan[0].num_splits if kplan else None)
for name, us in res.items():
    print(f"host: {name:34s} " + "  ".join(f"{u:6.2f}" for u in us) + f"   min {min(us):6.2f} us")
