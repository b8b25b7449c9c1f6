"""Benchmarks of flash_cute beside the attention peers present on the machine.

    python -m flash_cute.bench prefill [--dtype bf16] [--hdim 64 128 256] [--causal both]
                                       [--seqlens 512 ... 16384] [--json PATH]

prefill: the FlashAttention-3 paper's grid (batch * seqlen = 16k tokens, nheads * hdim = 2048)
timed for flash_cute, torch SDPA with the cuDNN and flash backends, and flash-attn-4
(`flash_attn.cute`) when importable. Prints TFLOP/s per peer and flash_cute's ratio to the
best peer. Times are CUDA-event medians after warm-up; FLOPs = 4 * b * h * s^2 * d, halved
when causal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of fn() over reps calls, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def prefill_peers(q, k, v, causal: bool) -> Dict[str, Callable[[], object]]:
    """Callables computing the same attention, keyed by peer name (flash_cute first)."""
    import flash_cute

    peers = {"flash_cute": lambda: flash_cute.flash_attn_func(q, k, v, causal=causal)}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    # SDPA wants (b, h, s, d); transpose once, outside the timed region.
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, is_causal=causal)
        try:
            run()
            peers[name] = run
        except Exception as exc:  # backend unavailable for this shape/GPU
            print(f"# {name} unavailable: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    try:
        from flash_attn.cute import flash_attn_func as fa4_func

        def run_fa4():
            return fa4_func(q, k, v, causal=causal)

        run_fa4()
        peers["fa4"] = run_fa4
    except Exception as exc:
        print(f"# fa4 unavailable: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    return peers


@dataclass
class PrefillRow:
    dtype: str
    hdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    tflops: Dict[str, float] = field(default_factory=dict)
    ms: Dict[str, float] = field(default_factory=dict)

    @property
    def ratio_to_best_peer(self) -> Optional[float]:
        others = [t for name, t in self.tflops.items() if name != "flash_cute"]
        if "flash_cute" not in self.tflops or not others:
            return None
        return self.tflops["flash_cute"] / max(others)


def run_prefill(dtype: str, hdims: List[int], causals: List[bool], seqlens: List[int],
                total_tokens: int = 16384, hidden: int = 2048, warmup: int = 5, reps: int = 30) -> List[PrefillRow]:
    rows = []
    for hdim in hdims:
        nheads = hidden // hdim
        for causal in causals:
            for seqlen in seqlens:
                batch = max(1, total_tokens // seqlen)
                gen = torch.Generator(device="cuda").manual_seed(seqlen + hdim)
                q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=DTYPES[dtype], generator=gen)
                           for _ in range(3))
                flops = 4 * batch * nheads * seqlen * seqlen * hdim / (2 if causal else 1)
                row = PrefillRow(dtype, hdim, causal, seqlen, batch, nheads)
                for name, fn in prefill_peers(q, k, v, causal).items():
                    ms = time_cuda(fn, warmup, reps)
                    row.ms[name] = ms
                    row.tflops[name] = flops / ms / 1e9
                rows.append(row)
                print(format_prefill_row(row), flush=True)
                del q, k, v
    return rows


def format_prefill_row(row: PrefillRow) -> str:
    cells = " ".join(f"{name}={t:6.1f}" for name, t in row.tflops.items())
    ratio = row.ratio_to_best_peer
    ratio_s = f"{ratio:.2f}x" if ratio is not None else "n/a"
    return (f"{row.dtype} hdim={row.hdim:3d} causal={int(row.causal)} seqlen={row.seqlen:5d} "
            f"batch={row.batch:2d}: {cells}  flash_cute/best_peer={ratio_s}")


def prefill_table(rows: List[PrefillRow]) -> str:
    """Markdown table: TFLOP/s per peer per sequence length."""
    peers = []
    for row in rows:
        peers += [p for p in row.tflops if p not in peers]
    seqlens = sorted({r.seqlen for r in rows})
    lines = ["| dtype | hdim | causal | peer | " + " | ".join(str(s) for s in seqlens) + " |",
             "|---|---|---|---|" + "---|" * len(seqlens)]
    groups = sorted({(r.dtype, r.hdim, r.causal) for r in rows})
    for dtype, hdim, causal in groups:
        group = {r.seqlen: r for r in rows if (r.dtype, r.hdim, r.causal) == (dtype, hdim, causal)}
        for peer in peers + ["ratio"]:
            cells = []
            for s in seqlens:
                r = group.get(s)
                if r is None:
                    cells.append("")
                elif peer == "ratio":
                    ratio = r.ratio_to_best_peer
                    cells.append(f"{ratio:.2f}" if ratio is not None else "")
                else:
                    cells.append(f"{r.tflops[peer]:.0f}" if peer in r.tflops else "")
            name = "flash_cute / best peer" if peer == "ratio" else peer
            lines.append(f"| {dtype} | {hdim} | {'yes' if causal else 'no'} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prefill", help="FlashAttention-3 paper grid")
    pre.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    pre.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    pre.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    pre.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    pre.add_argument("--reps", type=int, default=30)
    pre.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = run_prefill(args.dtype, args.hdim, causals, args.seqlens, reps=args.reps)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(prefill_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
