"""Graph-replay decode time: the decode config against the same with the lazy rescale."""

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import flash_cute
from flash_cute import decode_config
from flash_cute.bench import time_graph

base = decode_config(128, "bfloat16")
variants = {
    "base": base,
    "lazy8": base.replace(lazy_rescale=True, rescale_threshold=8),
    "lazy0": base.replace(lazy_rescale=True),
}
for b, sk in ((1, 1024), (1, 8192), (1, 32768), (4, 8192), (8, 8192), (32, 8192), (128, 1024)):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    sl = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    res = {
        "sdpa": min(time_graph(lambda: sdpa(qt, kt, vt, enable_gqa=True)) for _ in range(2)) * 1e3
    }
    for r in range(2):
        for n, c in variants.items():
            t = (
                min(
                    time_graph(
                        lambda: flash_cute.flash_attn_with_kvcache(
                            q, k, v, cache_seqlens=sl, config=c
                        )
                    )
                    for _ in range(2)
                )
                * 1e3
            )
            res[n] = min(res.get(n, 1e9), t)
    print(f"b={b:3d} sk={sk:6d} " + " ".join(f"{n} {t:7.1f}" for n, t in res.items()), flush=True)
