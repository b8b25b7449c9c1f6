"""One absorbed-MLA decode step to profile with Nsight Compute (the leads in PERF_NOTES "Open
leads": shared-memory bandwidth of the half-block Q K^T, tensor-pipe activity, whether L2
serves the second 64-head tile's reads of the latent cache).

    ncu --kernel-name regex:kernel --launch-skip 3 --launch-count 1 \\
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\\
    l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_shared_ld.sum,\\
    lts__t_sector_hit_rate.pct,dram__bytes_read.sum,gpu__time_duration.sum \\
        python3 benchmarks/mla_ncu.py [--batch 64] [--keys 16384] [--heads 128] [--repeat]

(warm-up launches first, then the profiled one; --repeat profiles the config whose two
warpgroups both compute all of each block's scores instead of split_scores.) DRAM bytes read
against batch * keys * 1152 tells whether each sequence's cache was read once or twice.
"""

import argparse

import torch

import flash_cute
from flash_cute.bench_mla import D_LATENT, D_ROPE, _paged
from flash_cute.config import wide_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--keys", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--seqlen-q", type=int, default=1)
    parser.add_argument("--repeat", action="store_true", help="scores computed by both")
    args = parser.parse_args()
    config = wide_config(D_LATENT + D_ROPE, D_LATENT, True)
    if args.repeat:
        config = config.replace(pv_from_registers=True, split_scores=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    latent, table = _paged(args.batch, args.keys, D_LATENT + D_ROPE, gen)
    lens = torch.full((args.batch,), args.keys, dtype=torch.int32, device="cuda")
    q = torch.randn(
        args.batch, args.seqlen_q, args.heads, D_LATENT + D_ROPE, device="cuda",
        dtype=torch.bfloat16, generator=gen,
    )  # fmt: skip
    for _ in range(4):  # 3 warm-up launches, then the one ncu skips to
        flash_cute.flash_attn_with_kvcache(
            q, latent, latent[..., :D_LATENT], cache_seqlens=lens, page_table=table,
            causal=True, config=config,
        )  # fmt: skip
    torch.cuda.synchronize()
    print(f"{config}\ncache bytes {args.batch * args.keys * 1152 / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
