"""Cost of tracing (AttentionConfig.trace) on the prefill grid, in one process: each point's
table config with and without the trace, taking turns in balanced orders
(flash_cute.timing.time_interleaved); per point the traced time over the untraced.

Grid: the FlashAttention-3 paper's (batch x seqlen = 16k tokens, nheads x headdim = 2048),
bf16, head dims 64/128/256, causal and not. Run from the repository root on a GPU:

    python benchmarks/trace_overhead.py > benchmarks/trace_overhead.log
"""

import statistics

import torch

import flash_cute
from flash_cute.config import default_config
from flash_cute.timing import time_interleaved

SEQLENS = [512, 2048, 8192, 16384]


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    ratios = []
    for hdim in (64, 128, 256):
        for causal in (False, True):
            for seqlen in SEQLENS:
                batch, heads = 16384 // seqlen, 2048 // hdim
                q, k, v = (
                    torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3)
                )
                config = default_config(hdim, "bfloat16", causal, seqlen)
                calls = {
                    name: (lambda c=c: flash_cute.flash_attn_func(q, k, v, causal=causal, config=c))
                    for name, c in (("plain", config), ("traced", config.replace(trace=True)))
                }
                ms = time_interleaved(calls, reps=30)
                ratio = ms["traced"] / ms["plain"]
                ratios.append(ratio)
                print(
                    f"hdim {hdim:3d} causal={causal!s:5} seqlen {seqlen:5d}: plain "
                    f"{ms['plain'] * 1e3:8.1f} us  traced {ms['traced'] * 1e3:8.1f} us  "
                    f"traced/plain {ratio:.3f}",
                    flush=True,
                )
    print(
        f"traced/plain: median {statistics.median(ratios):.3f}, max {max(ratios):.3f} "
        f"over {len(ratios)} points"
    )


if __name__ == "__main__":
    main()
