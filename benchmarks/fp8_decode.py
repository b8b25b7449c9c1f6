"""FP8 decode: FP8 q over an FP8 cache (SGLang's and vLLM's FP8 call; FP8 math), CUDA-graph
replays of STEPS steps, against a copy of the same bytes; beside it, in the same process and
rounds interleaved: the same cache read through page tables (random page order; pages of 64
load as TMA boxes, pages of 16 as rows gathered with cp.async), bf16 q over the FP8 cache
(16-bit math: the FP8-cache kernels' conversion), FlashAttention-3's FP8 (fa3_fwd_interface;
contiguous). GQA 32 / 8, head dim 128, descales per (batch, kv head), causal, one new token.
Prints, per point, each peer's median of ROUNDS rounds: us, FP8 K+V TB/s, and that over the
copy's TB/s (read + write). Run from the repository root on a GPU:

    python benchmarks/fp8_decode.py        (env: PAGES=64,16, ROUNDS=5, POINTS=0,2 to pick)

Config sweeps: EXP=ov0+n64+st4,... adds the FP8-math kernel with those knobs
(bench.fp8_math_knobs; bN the transposer's batch) beside the plan's.
"""

import functools
import os

import torch

import flash_cute
from flash_cute import bench, timing

fa3 = timing.optional_fa3()

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
ROUNDS = int(os.environ.get("ROUNDS", "5"))
PAGES = [int(p) for p in os.environ.get("PAGES", "64,16").split(",")]
STEPS = 10  # decode calls per graph
HEADS, HEADS_KV, D = 32, 8, 128
POINTS = [(1, 131072), (4, 131072), (8, 32768), (32, 8192), (64, 16384), (128, 8192), (16, 65536)]
EXPS = [e for e in os.environ.get("EXP", "").split(",") if e]


def swept(name, fn):
    """fn with the FP8-math config changed by name's knobs (bench.fp8_math_knobs); the plan's
    own config back after each call."""
    changes = bench.fp8_math_knobs(name)
    plans = flash_cute.flash_attn_with_kvcache.entry_point.plans

    def run():
        bench.set_fp8_math_changes(changes, plans)
        try:
            return fn()
        finally:
            bench.set_fp8_math_changes({}, plans)

    return run


def graphed(fn):
    """The replay of a CUDA graph of STEPS calls of fn."""
    return timing.captured(fn, STEPS)


def copy_tbs(nbytes):
    src = torch.randn(nbytes // 2, device="cuda").to(BF16)
    dst = torch.empty_like(src)
    copy = {"copy": graphed(lambda: dst.copy_(src))}
    return 2 * nbytes / timing.graph_step_rounds_us(copy, STEPS, 1)["copy"] / 1e6


def peers(batch, keys):
    """{name: decode step} over one random FP8 cache, contiguous and paged."""
    kc, vc = (torch.randn(batch, keys, HEADS_KV, D, device="cuda").to(FP8) for _ in range(2))
    paged = {}  # page size: (k pages, v pages, page table)
    for page in PAGES:
        pages = keys // page
        table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
        kp, vp = (
            torch.empty(batch * pages, page, HEADS_KV, D, device="cuda", dtype=FP8) for _ in "kv"
        )
        for dst, cache in ((kp, kc), (vp, vc)):  # (uint8 views: float8 indexing is not everywhere)
            dst.view(torch.uint8)[table.long()] = cache.view(torch.uint8).view(
                batch, pages, page, HEADS_KV, D
            )
        paged[page] = kp, vp, table
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    q8 = torch.randn(batch, 1, HEADS, D, device="cuda").to(FP8)
    qd, kd, vd = (torch.rand(batch, HEADS_KV, device="cuda") + 0.5 for _ in range(3))
    ds = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    kvcache = flash_cute.flash_attn_with_kvcache
    out = {
        "fp8": lambda: kvcache(q8, kc, vc, cache_seqlens=lens, **ds),
        "bf16 q": lambda: kvcache(
            q8.to(BF16), kc, vc, cache_seqlens=lens, causal=True, k_descale=qd * kd, v_descale=vd
        ),
    }
    for page, (kp, vp, table) in paged.items():
        out[f"fp8 p{page}"] = functools.partial(
            kvcache, q8, kp, vp, cache_seqlens=lens, page_table=table, **ds
        )
    for name in EXPS:
        out[f"fp8 {name}"] = swept(name, out["fp8"])
    if fa3 is not None:
        out["FA3 fp8"] = lambda: fa3.flash_attn_with_kvcache(q8, kc, vc, cache_seqlens=lens, **ds)
    return out


def main():
    points = timing.env_points(POINTS)
    print(torch.cuda.get_device_name(), f"{STEPS} steps per graph", flush=True)
    for batch, keys in points:
        torch.cuda.empty_cache()
        nbytes = 2 * batch * keys * HEADS_KV * D
        steps = peers(batch, keys)
        reference = steps["bf16 q"]().float()  # (16-bit math: the FP8-math outputs' distance)
        for name, fn in steps.items():
            diff = (fn().float() - reference).abs().max().item()
            print(f"  {batch} x {keys}: {name} max |diff| vs bf16 q {diff:.2e}", flush=True)
        replays = {name: graphed(fn) for name, fn in steps.items()}
        copy = copy_tbs(nbytes)
        cells = []
        for name, us in timing.graph_step_rounds_us(replays, STEPS, ROUNDS).items():
            tbs = nbytes / us / 1e6
            cells.append(f"{name} {us:.1f} us {tbs:.2f} TB/s {tbs / copy:.2f}x")
        head = f"{batch} x {keys} ({nbytes / 2**20:.0f} MB, copy {copy:.2f} TB/s)"
        print(head, " | ".join(cells), sep=": ", flush=True)


if __name__ == "__main__":
    main()
