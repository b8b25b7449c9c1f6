"""Kernel time A/B in one process: an older revision (`flash_cute_old`, exported by
old_package.py) against the working tree's `flash_cute`.

- prefill: flash_attn_func on the FlashAttention-3 paper's grid (batch x seqlen = 16k tokens,
  nheads x headdim = 2048; bf16, head dims 64/128/256, causal and not, 512-16k), the two taking
  turns (flash_cute.timing.time_interleaved) in each of --passes passes; per point the median
  over passes of new / old time.
- decode: CUDA-graph replays of 20 flash_attn_with_kvcache decode steps (32 q heads, 8 kv
  heads, hdim 128, bf16, a (batch,) int32 cache_seqlens, contiguous and paged caches), the two
  graphs replayed in turns.
- varlen: flash_attn_varlen_func over mixed-length batches (packed K/V, and a paged decode
  batch), the two taking turns.

Run from the repository root on a GPU (compiles both packages' kernels in parallel first):

    python benchmarks/old_package.py REV OLD_DIR
    python benchmarks/kernel_ab.py OLD_DIR [--passes 5] [--hdim 64 128 256] [--no-decode]
"""

import argparse
import concurrent.futures
import multiprocessing
import statistics
import sys

import torch

SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]


def _compile(job):
    """Worker: compile one kernel of the old or the new package into its disk cache."""
    side, variant = job
    if side == "old":
        from flash_cute_old.compile_cache import get_forward_kernel
    else:
        from flash_cute.compile_cache import get_forward_kernel
    get_forward_kernel(variant)


def precompile(old_dir, hdims, workers=16):
    import flash_cute_old.precompile as old_pre

    import flash_cute.precompile as new_pre

    jobs = [("old", k) for k in old_pre.table_variants(hdims, writes_lse=(False,))]
    jobs += [("new", v) for v in new_pre.table_variants(hdims, writes_lse=(False,))]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=sys.path.insert, initargs=(0, old_dir)
    ) as pool:
        list(pool.map(_compile, jobs))
    print(f"compiled {len(jobs)} kernels", flush=True)


def prefill(old, new, hdims, passes, reps):
    from flash_cute.bench import prefill_flops
    from flash_cute.timing import time_interleaved

    rows = []
    for hdim in hdims:
        for causal in (False, True):
            for seqlen in SEQLENS:
                nheads, batch = 2048 // hdim, max(1, 16384 // seqlen)
                gen = torch.Generator(device="cuda").manual_seed(seqlen + hdim)
                q, k, v = (
                    torch.randn(
                        batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16,
                        generator=gen,
                    )
                    for _ in range(3)
                )  # fmt: skip
                fns = {
                    "old": lambda q=q, k=k, v=v, c=causal: old.flash_attn_func(q, k, v, causal=c),
                    "new": lambda q=q, k=k, v=v, c=causal: new.flash_attn_func(q, k, v, causal=c),
                }
                diff = (fns["old"]().float() - fns["new"]().float()).abs().max().item()
                times = [time_interleaved(fns, warmup=3, reps=reps) for _ in range(passes)]
                ratio = statistics.median(t["new"] / t["old"] for t in times)
                flops = prefill_flops(batch, nheads, seqlen, hdim, causal)
                new_tflops = flops / statistics.median(t["new"] for t in times) / 1e9
                rows.append((hdim, causal, seqlen, new_tflops, ratio))
                print(
                    f"hdim {hdim:3d} causal {int(causal)} seqlen {seqlen:5d}: new {new_tflops:6.1f}"
                    f" TFLOP/s, new/old time {ratio:.4f} (passes "
                    + " ".join(f"{t['new'] / t['old']:.3f}" for t in times)
                    + f"), max |new - old| {diff:.2e}",
                    flush=True,
                )
    return rows


def decode(old, new, reps):
    from flash_cute.timing import time_interleaved

    rows = []
    for batch in (1, 8, 32):
        for seqlen_k in (8192, 65536):
            for page in (0, 64):
                gen = torch.Generator(device="cuda").manual_seed(batch + seqlen_k + page)
                bf16 = dict(device="cuda", dtype=torch.bfloat16)
                q = torch.randn(batch, 1, 32, 128, generator=gen, **bf16)
                lens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
                if page:
                    pages = batch * seqlen_k // page
                    kc, vc = (torch.randn(pages, page, 8, 128, generator=gen, **bf16) for _ in "kv")
                    perm = torch.randperm(pages, device="cuda", generator=gen)
                    table = perm.view(batch, -1).to(torch.int32)
                else:
                    kc, vc = (
                        torch.randn(batch, seqlen_k, 8, 128, generator=gen, **bf16) for _ in "kv"
                    )
                    table = None
                graphs = {}
                for name, m in (("old", old), ("new", new)):

                    def step(m=m):
                        return m.flash_attn_with_kvcache(q, kc, vc, lens, page_table=table)

                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.stream(stream):
                        step()
                        with torch.cuda.graph(graph, stream=stream):
                            for _ in range(20):
                                result = step()
                    torch.cuda.current_stream().wait_stream(stream)
                    graphs[name] = (graph, result)
                graphs["old"][0].replay()
                graphs["new"][0].replay()
                diff = (graphs["old"][1].float() - graphs["new"][1].float()).abs().max().item()
                times = time_interleaved({n: g.replay for n, (g, _) in graphs.items()}, 3, reps)
                us = times["new"] / 20 * 1e3
                ratio = times["new"] / times["old"]
                layout = f"page {page}" if page else "contiguous"
                rows.append((batch, seqlen_k, layout, us, ratio))
                print(
                    f"decode batch {batch:2d} seqlen_k {seqlen_k:6d} {layout:10s}: new {us:7.1f} us"
                    f" per step, new/old {ratio:.4f}, max |new - old| {diff:.2e}",
                    flush=True,
                )
    return rows


def varlen(old, new, reps):
    """Mixed-length batches through flash_attn_varlen_func: new / old time per case."""
    from flash_cute.timing import time_interleaved

    rows = []
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for label, lengths, hdim, causal in (
        ("16 x 100-2000, causal", [100 + 127 * i for i in range(16)], 128, True),
        ("16 x 100-2000", [100 + 127 * i for i in range(16)], 128, False),
        ("64 x 50-600, causal", [50 + 9 * i for i in range(64)], 128, True),
        ("8 x 500-4000, hdim 64, causal", [500 + 500 * i for i in range(8)], 64, True),
    ):
        gen = torch.Generator(device="cuda").manual_seed(len(lengths) + hdim)
        total = sum(lengths)
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(total, 2048 // hdim, hdim, generator=gen, **bf16) for _ in "qkv")
        fns = {
            name: (
                lambda m=m: m.flash_attn_varlen_func(
                    q, k, v, cu, max(lengths), cu_seqlens_k=cu, max_seqlen_k=max(lengths),
                    causal=causal,
                )
            )
            for name, m in (("old", old), ("new", new))
        }  # fmt: skip
        diff = (fns["old"]().float() - fns["new"]().float()).abs().max().item()
        times = time_interleaved(fns, warmup=3, reps=reps)
        ratio = times["new"] / times["old"]
        rows.append((label, times["new"], ratio))
        print(f"varlen {label:32s}: new {times['new'] * 1e3:8.1f} us, new/old {ratio:.4f}, "
              f"max |new - old| {diff:.2e}", flush=True)  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("old_dir")
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-varlen", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, args.old_dir)
    import flash_cute_old as old

    import flash_cute as new

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if not args.no_prefill:
        precompile(args.old_dir, args.hdim)
        rows = prefill(old, new, args.hdim, args.passes, args.reps)
        print("\n| hdim | causal | " + " | ".join(map(str, SEQLENS)) + " |")
        print("|---|---|" + "---|" * len(SEQLENS))
        for hdim in args.hdim:
            for causal in (False, True):
                cells = [f"{r[4]:.3f}" for r in rows if r[:2] == (hdim, causal)]
                print(f"| {hdim} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
        hdim, causal, seqlen, _, ratio = max(rows, key=lambda r: abs(r[4] - 1))
        low, high = min(r[4] for r in rows), max(r[4] for r in rows)
        print(f"new/old time: {low:.3f}-{high:.3f} (furthest from 1: {ratio:.3f} at hdim {hdim}, "
              f"causal {int(causal)}, seqlen {seqlen})")  # fmt: skip
    if not args.no_varlen:
        rows = varlen(old, new, args.reps)
        print(f"varlen, new/old: {min(r[2] for r in rows):.3f}-{max(r[2] for r in rows):.3f}")
    if not args.no_decode:
        rows = decode(old, new, args.reps)
        print(f"decode graph replays, new/old: {min(r[4] for r in rows):.3f}"
              f"-{max(r[4] for r in rows):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
