"""Context-parallel scaling: ring prefill and sharded decode on N GPUs against one GPU.

    torchrun --nproc-per-node N benchmarks/context_parallel.py [--seqlen 131072 524288 ...]
        [--decode-tokens 1048576] [--json benchmarks/context_parallel.json]

Ring prefill: batch 1, GQA 32/8, hdim 128, bf16, causal, zigzag layout; one GPU runs
flash_attn_func on the whole sequence. Sharded decode: batch 1, one query token, the same
heads, a cache of --decode-tokens tokens interleaved over the ranks, CUDA-graph replays; one
GPU reads the whole cache with flash_attn_with_kvcache. Efficiency: (one GPU's time / N GPUs'
time) / N. Rank 0 prints the table and writes its rows into the JSON under its world size,
replacing rows of the same step and length and keeping the rest.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import flash_cute
from flash_cute import distributed as cp
from flash_cute.timing import time_cuda, time_graph


def _ring_prefill(s, world, rank, gen, h, hk, d):
    """Causal zigzag ring prefill of one s-token sequence on `world` GPUs against one GPU."""
    q, k, v = (
        torch.randn(1, s // world, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for n in (h, hk, hk)
    )
    ms_ring = time_cuda(lambda: cp.ring_attention(q, k, v, causal=True), 1, 3)
    q = k = v = None
    ms_one = None
    if rank == 0:
        qf, kf, vf = (
            torch.randn(1, s, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for n in (h, hk, hk)
        )
        ms_one = time_cuda(lambda: flash_cute.flash_attn_func(qf, kf, vf, causal=True), 1, 3)
    dist.barrier()
    flops = 4 * s * s * h * d / 2
    return dict(tokens=s, ms_n=ms_ring, ms_1=ms_one, tflops_per_gpu=flops / ms_ring / 1e9 / world)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, nargs="*", default=[131072])
    parser.add_argument("--decode-tokens", type=int, default=1 << 20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device(rank))
    world = dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, hk, d = 32, 8, 128
    rows = {}

    for s in args.seqlen:
        rows[f"ring_prefill_{s}"] = _ring_prefill(s, world, rank, gen, h, hk, d)

    # Sharded decode.
    n = args.decode_tokens
    qd = torch.randn(1, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    kd, vd = (
        torch.randn(1, n // world, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    lengths = torch.full((1,), n, dtype=torch.int32, device="cuda")
    ms_dec = time_graph(lambda: cp.sharded_decode(qd, kd, vd, lengths))
    kv_bytes = 2 * n * hk * d * 2
    ms_dec_one = None
    if rank == 0:
        kf, vf = (
            torch.randn(1, n, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2)
        )
        ms_dec_one = time_graph(
            lambda: flash_cute.flash_attn_with_kvcache(qd, kf, vf, cache_seqlens=lengths)
        )
    dist.barrier()
    rows[f"sharded_decode_{n}"] = dict(
        tokens=n, ms_n=ms_dec, ms_1=ms_dec_one, tb_per_s=kv_bytes / ms_dec / 1e9
    )

    if rank == 0:
        device = torch.cuda.get_device_name()
        print(f"{device} x {world}, torch {torch.__version__}")
        print("| step | tokens | 1 GPU ms | N GPUs ms | speedup | efficiency | rate |")
        print("|---|---|---|---|---|---|---|")
        for key, r in rows.items():
            name = key.rsplit("_", 1)[0]
            speedup = r["ms_1"] / r["ms_n"]
            rate = (
                f"{r['tflops_per_gpu']:.0f} TFLOP/s per GPU"
                if "tflops_per_gpu" in r
                else f"{r['tb_per_s']:.2f} TB/s of K+V"
            )
            print(
                f"| {name} | {r['tokens']} | {r['ms_1']:.3f} | {r['ms_n']:.3f} | "
                f"{speedup:.2f}x | {speedup / world:.2f} | {rate} |"
            )
        if args.json:
            runs = {}
            if os.path.exists(args.json):
                with open(args.json) as f:
                    runs = json.load(f).get("runs", {})
            old = runs.get(str(world), {}).get("rows", {})
            runs[str(world)] = dict(device=device, rows={**old, **rows})
            with open(args.json, "w") as f:
                json.dump(dict(runs=runs), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
