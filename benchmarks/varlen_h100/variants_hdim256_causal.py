"""Varlen hdim 256 causal batch (bench varlen case 5): the table row against variants, interleaved
(sixth session; output in PERF_NOTES). Needs flash-attn-4 for the peer."""

import torch
from flash_attn.cute import flash_attn_varlen_func as fa4

import flash_cute
from flash_cute.bench import VARLEN_PREFILL_CASES, time_interleaved, varlen_case_lengths
from flash_cute.config import default_config

for case in VARLEN_PREFILL_CASES[4:]:
    name, _, _, hdim, nh, nkv, causal = case
    lens = varlen_case_lengths(case, 0)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    total, longest = int(cu[-1]), max(lens)
    q = torch.randn(total, nh, hdim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, nkv, hdim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = sum(4 * n * n * hdim * nh / 2 for n in lens)
    t = default_config(hdim, "bfloat16", True, longest)
    variants = {
        "table": t,
        "lazy8": t.replace(lazy_rescale=True, rescale_threshold=8),
        "static": t.replace(scheduler="static_persistent"),
        "l2_24": t.replace(l2_section_mb=24),
        "l2_2": t.replace(l2_section_mb=2),
        "128x64": t.replace(tile_n=64),
        "probe": t.replace(mbarrier_probe=True),
    }
    fns = {
        n: (
            lambda c=c: flash_cute.flash_attn_varlen_func(
                q, k, v, cu, longest, cu_seqlens_k=cu, max_seqlen_k=longest, causal=True, config=c
            )
        )
        for n, c in variants.items()
    }
    fns["fa4"] = lambda: fa4(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        causal=True,
    )
    for r in range(2):
        times = time_interleaved(fns, warmup=5, reps=40, rounds=4)
        print(name, " ".join(f"{n}:{flops / times[n] / 1e9:.0f}" for n in fns), flush=True)
