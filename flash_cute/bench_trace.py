"""The `trace` command: one call, traced (flash_cute.trace), drawn as per-SM timelines.

    python -m flash_cute.bench trace prefill --seqlen 8192 --causal --out trace
    python -m flash_cute.bench trace decode --batch 1 --seqlen 32768 --out decode
    python -m flash_cute.bench trace varlen --lengths 1 17 1000 4097 300 --causal --out mixed
    python -m flash_cute.bench trace prefill --seqlen 8192 --causal \\
        --compare scheduler=single_tile scheduler=dynamic_persistent --out schedulers

The call takes its table row's config unless `--config KEY=VALUE ...` overrides fields of it;
`--compare A B` runs it twice, with the overrides A and then B (each a comma-separated list of
KEY=VALUE), and draws the two timelines one above the other. Writes OUT.json (the records of
each launch; `python -m flash_cute.bench plot OUT.json PNG` draws it again without a GPU),
OUT.png and OUT.txt (the summaries). Each summary's SM idle fraction comes from
the trace's own span; beside it, the one from the same launch's kernel time as torch's
profiler measures it: 1 - busy / (SMs x that time); and the untraced call's time (CUDA events,
median of many).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, List, Optional, Sequence

import torch

from flash_cute.config import AttentionConfig

ENTRY_POINTS = ("prefill", "decode", "varlen")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_overrides(text: str) -> Dict[str, object]:
    """'scheduler=dynamic_persistent,tile_n=112' -> AttentionConfig field values, typed by the
    fields' defaults (bool: true/false/1/0)."""
    fields = {f.name: f for f in dataclasses.fields(AttentionConfig)}
    out: Dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(
                f"--config/--compare: expected KEY=VALUE with KEY an AttentionConfig field, "
                f"got {item!r}"
            )
        default = fields[name].default
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--config/--compare: {name} takes true or false, got {value!r}")
            out[name] = value.lower() in ("true", "1")
        elif isinstance(default, int) or name in ("tile_m", "tile_n"):
            out[name] = None if value == "none" else int(value)
        else:
            out[name] = value
    return out


def make_call(args) -> Callable[[Optional[AttentionConfig]], object]:
    """The call args describe, as a function of its config (None: the table's)."""
    import flash_cute

    dtype, gen = DTYPES[args.dtype], torch.Generator(device="cuda").manual_seed(0)
    heads, heads_kv = args.heads

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    if args.entry == "prefill":
        q, k, v = (
            randn(args.batch, args.seqlen, heads_kv if i else heads, args.hdim) for i in range(3)
        )
        return lambda config: flash_cute.flash_attn_func(q, k, v, causal=args.causal, config=config)
    if args.entry == "decode":
        q = randn(args.batch, args.seqlen_q, heads, args.hdim)
        k, v = (randn(args.batch, args.seqlen, heads_kv, args.hdim) for _ in range(2))
        return lambda config: flash_cute.flash_attn_with_kvcache(
            q, k, v, causal=args.causal, num_splits=args.num_splits, config=config
        )
    lengths = args.lengths
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q = randn(sum(lengths), heads, args.hdim)
    k, v = (randn(sum(lengths), heads_kv, args.hdim) for _ in range(2))
    return lambda config: flash_cute.flash_attn_varlen_func(
        q, k, v, cu, max(lengths), cu_seqlens_k=cu, max_seqlen_k=max(lengths),
        causal=args.causal, config=config,
    )  # fmt: skip


def kernel_times_us(call) -> List[float]:
    """Device time (us) of each flash_cute kernel `call` launches, in launch order, from torch's
    profiler (CUPTI); empty where the profiler records no kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.events() if "FlashAttention" in e.name and getattr(e, "device_time", 0) > 0
    ]
    kernels.sort(key=lambda e: e.time_range.start)
    return [e.device_time for e in kernels]


def run(args) -> int:
    from flash_cute import trace
    from flash_cute.timing import time_cuda

    call = make_call(args)
    sides: List[Dict[str, object]] = [parse_overrides(",".join(args.config))]
    if args.compare:
        sides = [{**sides[0], **parse_overrides(text)} for text in args.compare]
    launches, titles, lines = [], [], []
    for overrides in sides:
        with trace.record() as probe:  # the table's row for this call (compiles the traced
            call(None)  # variant of the table's row)
        traced_config = probe.launches[0].config.replace(**overrides)
        plain_config = traced_config.replace(trace=False)
        plain_us = time_cuda(lambda: call(plain_config), warmup=5, reps=50) * 1e3
        call(plain_config)
        recording = {}

        def traced_call():
            with trace.record() as rec:
                call(plain_config)
            recording["launches"] = rec.launches

        kernel_us = kernel_times_us(traced_call)
        for i, launch in enumerate(recording["launches"]):
            s = launch.summary()
            title = launch.label
            if overrides:
                title += " (" + ",".join(f"{k}={v}" for k, v in overrides.items()) + ")"
            line = f"{title}\n  {s.text()}"
            if i < len(kernel_us):  # the same launch's kernel time, by the profiler
                idle = 1.0 - s.busy_ns / (s.num_sms * kernel_us[i] * 1e3)
                line += (
                    f"\n  kernel {kernel_us[i]:.1f} us (profiler): SM idle {100 * idle:.1f}% of "
                    f"SMs x that time"
                )
            if i == 0:
                line += f"; the untraced call takes {plain_us:.1f} us (CUDA events, median)"
            lines.append(line)
            launches.append(launch)
            titles.append(title)
    text = "\n".join(lines)
    print(text)
    with open(f"{args.out}.txt", "w") as f:
        f.write(text + "\n")
    with open(f"{args.out}.json", "w") as f:
        json.dump(
            {
                "launches": [launch.to_json() for launch in launches],
                "titles": titles,
                "same_time_axis": bool(args.compare),
            },
            f,
        )
    trace.plot_timelines(launches, f"{args.out}.png", titles, same_time_axis=bool(args.compare))
    print(f"wrote {args.out}.json, {args.out}.png, {args.out}.txt")
    return 0


def replot(data: dict, png_path: str) -> None:
    """Draw a trace's JSON (OUT.json of `trace`) again: `python -m flash_cute.bench plot`."""
    from flash_cute import trace

    launches = [trace.LaunchTrace.from_json(launch) for launch in data["launches"]]
    trace.plot_timelines(
        launches, png_path, data.get("titles"), same_time_axis=data.get("same_time_axis", False)
    )


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="per-SM timelines of one traced call (flash_cute.trace)")
    p.add_argument("entry", choices=ENTRY_POINTS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=8192, help="keys (prefill: also queries)")
    p.add_argument("--seqlen-q", type=int, default=1, help="decode: query tokens")
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 17, 1000, 4097, 300, 113],
                   help="varlen: the sequences' lengths")  # fmt: skip
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--num-splits", type=int, default=0, help="decode: 0 picks")
    p.add_argument("--config", nargs="*", default=[], help="KEY=VALUE overrides of the row")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two override lists")
    p.add_argument("--out", default="trace", help="output prefix")


def validate(parser, args: Sequence) -> None:
    try:
        parse_overrides(",".join(args.config))
        for text in args.compare or ():
            parse_overrides(text)
    except ValueError as e:
        parser.error(str(e))
