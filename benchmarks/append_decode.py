"""Decode with KV append and rotary: one new token a step (k, v, rotary_cos / rotary_sin into
the cache, then attention over it), against the same decode without the append, CUDA-graph
replays of STEPS steps. GQA 32 / 8, head dim 128, bf16, causal; contiguous caches and pages of
64 (random page order); FlashAttention-3 (fa3_fwd_interface: contiguous only) beside it, rounds
interleaved in one process. Prints each peer's median step time and the append's cost over the
plain step. Run from the repository root on a GPU:

    python benchmarks/append_decode.py        (env: ROUNDS=5, POINTS=0,2 to pick)
"""

import math
import os

import torch

from flash_cute import flash_attn_interface as ours
from flash_cute import timing

fa3 = timing.optional_fa3()

BF16 = torch.bfloat16
ROUNDS = int(os.environ.get("ROUNDS", "5"))
STEPS = 10  # decode calls per graph
HEADS, HEADS_KV, D, PAGE = 32, 8, 128, 64
POINTS = [(1, 8192), (1, 131072), (8, 32768), (32, 8192), (64, 8192), (128, 8192), (16, 65536)]


def peers(batch, keys):
    """{name: decode step}: plain (the lengths after the append) and appending, per layout."""
    kc, vc = (torch.randn(batch, keys, HEADS_KV, D, device="cuda", dtype=BF16) for _ in "kv")
    pages = keys // PAGE
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    kp, vp = (
        torch.empty(batch * pages, PAGE, HEADS_KV, D, device="cuda", dtype=BF16) for _ in "kv"
    )
    kp[table.long()] = kc.view(batch, pages, PAGE, HEADS_KV, D)
    vp[table.long()] = vc.view(batch, pages, PAGE, HEADS_KV, D)
    lens = torch.full((batch,), keys - 1, dtype=torch.int32, device="cuda")
    after = lens + 1
    q = torch.randn(batch, 1, HEADS, D, device="cuda", dtype=BF16)
    k, v = (torch.randn(batch, 1, HEADS_KV, D, device="cuda", dtype=BF16) for _ in "kv")
    angle = torch.rand(keys, D // 2, device="cuda") * 2 * math.pi
    cos, sin = angle.cos().to(BF16), angle.sin().to(BF16)
    rotary = dict(rotary_cos=cos, rotary_sin=sin, causal=True)
    kvcache = ours.flash_attn_with_kvcache  # (FlashAttention-3's signature: k, v append)
    out = {
        "plain": lambda: kvcache(q, kc, vc, cache_seqlens=after, causal=True),
        "append": lambda: kvcache(q, kc, vc, k, v, cache_seqlens=lens, **rotary),
        "plain p64": lambda: kvcache(q, kp, vp, cache_seqlens=after, page_table=table, causal=True),
        "append p64": lambda: kvcache(
            q, kp, vp, k, v, cache_seqlens=lens, page_table=table, **rotary
        ),
    }
    if fa3 is not None:
        kf, vf = kc.clone(), vc.clone()
        out["FA3 plain"] = lambda: fa3.flash_attn_with_kvcache(
            q, kf, vf, cache_seqlens=after, causal=True
        )
        out["FA3 append"] = lambda: fa3.flash_attn_with_kvcache(
            q, kf, vf, k, v, cache_seqlens=lens, **rotary
        )
    return out


def main():
    points = timing.env_points(POINTS)
    print(torch.cuda.get_device_name(), f"{STEPS} steps per graph", flush=True)
    for batch, keys in points:
        torch.cuda.empty_cache()
        steps = peers(batch, keys)
        outs = {name: fn().float() for name, fn in steps.items()}
        for name in ("append p64", "FA3 append"):
            if name in outs:
                diff = (outs[name] - outs["append"]).abs().max().item()
                print(f"  {batch} x {keys}: {name} max |diff| vs append {diff:.2e}", flush=True)
        replays = {name: timing.captured(fn, STEPS) for name, fn in steps.items()}
        us = timing.graph_step_rounds_us(replays, STEPS, ROUNDS)
        written = 2 * batch * HEADS_KV * D * 2  # bytes the append writes a step
        cells = [f"{name} {t:.1f}" for name, t in us.items()]
        ratios = [
            f"{a} / {p} {us[a] / us[p]:.3f}"
            for a, p in (
                ("append", "plain"),
                ("append p64", "plain p64"),
                ("FA3 append", "FA3 plain"),
            )
            if a in us
        ]
        print(
            f"{batch} x {keys} (writes {written} B): " + " | ".join(cells) + " us; "
            + ", ".join(ratios),
            flush=True,
        )  # fmt: skip


if __name__ == "__main__":
    main()
