"""A/B of the ways two warpgroups share a wide (V head dim 512) tile, in one process:
- "repeat": both compute all of each key block's scores (o_split alone, P from registers);
- "split": each computes half of each block's scores, P exchanged through smem (split_scores);
- each with the next block's Q K^T issued under this block's softmax (intra_wg_overlap, the
  "ov" names) or not. With V in K's stages (absorbed MLA) the overlap holds two stages at once,
  so the next block's load starts only when this block's P V ends.

Points: absorbed MLA decode (FlashMLA's form: q and a paged latent cache 576 wide, v its first
512 columns), CUDA-graph replays, at points of the `mla` suite's grid; head dim 512 prefill,
4 heads, 16k tokens, causal and not. Prints per point each config's microseconds, TB/s of cache
bytes or TFLOP/s, the time against the first config, and the largest difference from its
output. Run from the repository root on a GPU:

    python benchmarks/wide_tile_ab.py > benchmarks/wide_tile_ab.log

`--only NAME...` keeps those configs (the first named is the baseline); `--no-prefill` skips
the head dim 512 points.
"""

import argparse

import torch

import flash_cute
from flash_cute.bench_mla import D_LATENT, D_ROPE, _paged
from flash_cute.config import wide_config
from flash_cute.timing import copy_bandwidth_gbs, time_graph

# (heads, q tokens, batch, keys)
MLA_POINTS = [
    (128, 1, 64, 16384),
    (128, 2, 64, 4096),
    (128, 1, 16, 65536),
    (128, 1, 1, 65536),
    (128, 1, 1, 4096),
    (16, 1, 64, 16384),
    (16, 1, 4, 65536),
    (64, 1, 32, 16384),
]


def configs(head_dim: int, v_in_k: bool) -> dict:
    repeat = wide_config(head_dim, 512, v_in_k).replace(
        pv_from_registers=True, split_scores=False, intra_wg_overlap=True
    )
    split = repeat.replace(pv_from_registers=False, split_scores=True)
    return {
        "split ov": split,
        "split": split.replace(intra_wg_overlap=False),
        "repeat ov": repeat,
        "repeat": repeat.replace(intra_wg_overlap=False),
    }


def row(label: str, us: dict, outs: dict, units) -> str:
    first = next(iter(us))
    cells = "  ".join(f"{n} {t:8.1f} us {units(t)}" for n, t in us.items())
    ratios = " ".join(f"{us[n] / us[first]:.3f}" for n in us)
    diff = max((o - outs[first]).abs().max().item() for o in outs.values())
    return f"{label}: {cells}  time/{first} {ratios}  maxdiff {diff:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", help="config names to keep, baseline first")
    parser.add_argument("--no-prefill", action="store_true", help="skip the head dim 512 points")
    args = parser.parse_args()

    def chosen(head_dim: int, v_in_k: bool) -> dict:
        all_configs = configs(head_dim, v_in_k)
        names = args.only or list(all_configs)
        return {n: all_configs[n] for n in names if n in all_configs}

    print(f"copy {copy_bandwidth_gbs() / 1e3:.2f} TB/s", flush=True)
    for h, sq, b, keys in MLA_POINTS:
        gen = torch.Generator(device="cuda").manual_seed(b * 7 + keys)
        latent, table = _paged(b, keys, D_LATENT + D_ROPE, gen)
        lens = torch.full((b,), keys, dtype=torch.int32, device="cuda")
        q = torch.randn(b, sq, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        us, outs = {}, {}
        for name, config in chosen(576, True).items():

            def step(config=config):
                return flash_cute.flash_attn_with_kvcache(
                    q, latent, latent[..., :D_LATENT], cache_seqlens=lens, page_table=table,
                    causal=True, config=config,
                )  # fmt: skip

            outs[name] = step().float()
            us[name] = time_graph(step) * 1e3
        flops, cache_bytes = 2 * b * h * sq * keys * 1088, b * keys * 1152
        label = f"mla h={h:3d} sq={sq} b={b:3d} keys={keys:6d}"
        units = lambda t: f"{cache_bytes / t / 1e6:.2f} TB/s {flops / t / 1e6:4.0f} TF"  # noqa: E731
        print(row(label, us, outs, units), flush=True)
    for causal in () if args.no_prefill else (False, True):
        s, h = 16384, 4
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (
            torch.randn(1, s, h, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        )
        us, outs = {}, {}
        for name, config in chosen(512, False).items():

            def step(config=config):
                return flash_cute.flash_attn_func(q, k, v, causal=causal, config=config)

            outs[name] = step().float()
            us[name] = time_graph(step) * 1e3
        flops = 4 * h * s * s * 512 / (2 if causal else 1)
        label = f"d512 prefill 16k causal={causal}"
        print(row(label, us, outs, lambda t: f"{flops / t / 1e6:4.0f} TF"), flush=True)


if __name__ == "__main__":
    main()
