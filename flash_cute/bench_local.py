"""The `local` benchmark suite: sliding windows, softcap and learnable sinks beside flash-attn-4.

    python -m flash_cute.bench local [--part prefill softcap sinks decode] [--json PATH]

prefill: causal windowed attention on model shapes (gpt-oss: 64 q / 8 kv heads, hdim 64;
Mistral: 32 / 8, hdim 128), 32k tokens per call at 4k-32k per sequence, for flash_cute and
flash-attn-4 with the window, and flash_cute's plain causal call. TFLOP/s count only the
(query, key) pairs the window lets a query see: 4 * d * pairs * heads.

softcap: the Gemma 2 shape (16 / 8 heads, hdim 256), causal, 16k tokens per call, with and
without softcap 50, for both. sinks: the gpt-oss shape with and without learnable sinks, with
and without a 128 window. The ratio with/without is each implementation's own overhead.

decode: one query per sequence against a 128k cache with a 4096 window (32 / 8 heads, hdim
128, bf16), contiguous and paged (page 16), eager and replayed from a CUDA graph. Beside it:
the same call without the window over a 4097-key cache (the same bytes), the unwindowed call's
fixed cost (a 1-key cache) and the floor: window bytes / copy bandwidth + that fixed cost.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List

import torch

from flash_cute.timing import copy_bandwidth_gbs, time_cuda, time_graph, time_interleaved

PREFILL_SHAPES = [
    # (name, q heads, kv heads, hdim, window left)
    ("gpt-oss", 64, 8, 64, 128),
    ("gpt-oss", 64, 8, 64, 512),
    ("gpt-oss", 64, 8, 64, 1024),  # the short-window row's last window
    ("gpt-oss", 64, 8, 64, 4096),
    ("Mistral", 32, 8, 128, 4096),
]


def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """(query, key) pairs a window (left, right) admits, bottom-right aligned; -1 unbounded."""
    i = torch.arange(seqlen_q, dtype=torch.int64) + seqlen_k - seqlen_q
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(i, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def _fa4():
    try:
        import flash_attn.cute as fa4

        return fa4
    except Exception as exc:
        print(f"# fa4 unavailable: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None


def _qkv(batch, seqlen, nheads, nheads_kv, hdim, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen, nheads, hdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(
            batch, seqlen, nheads_kv, hdim, device="cuda", dtype=torch.bfloat16, generator=gen
        )
        for _ in range(2)
    )
    return q, k, v


def _timed(fns: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    """Milliseconds per call (interleaved medians) of the callables that run."""
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
            ok[name] = fn
        except Exception as exc:
            print(f"# {name} failed: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
    return time_interleaved(ok, warmup=3, reps=reps)


def run_prefill(seqlens: List[int], tokens: int = 32768, reps: int = 30) -> List[dict]:
    """Where the table gives a window its own row, the causal row runs beside it
    ("flash_cute causal row")."""
    import flash_cute
    from flash_cute.config import default_config
    from flash_cute.plan import window_span

    fa4 = _fa4()
    rows = []
    for name, nheads, nheads_kv, hdim, left in PREFILL_SHAPES:
        for seqlen in seqlens:
            batch = max(1, tokens // seqlen)
            q, k, v = _qkv(batch, seqlen, nheads, nheads_kv, hdim, seqlen + left)
            window = (left, 0)
            fns = {
                "flash_cute": lambda: flash_cute.flash_attn_func(
                    q, k, v, causal=True, window_size=window
                ),
                "flash_cute causal": lambda: flash_cute.flash_attn_func(q, k, v, causal=True),
            }
            causal_row = default_config(hdim, "bfloat16", True, seqlen)
            if (
                default_config(hdim, "bfloat16", True, seqlen, window_span(left, 0, 0))
                != causal_row
            ):
                fns["flash_cute causal row"] = lambda: flash_cute.flash_attn_func(
                    q, k, v, causal=True, window_size=window, config=causal_row
                )
            if fa4 is not None:
                fns["fa4"] = lambda: fa4.flash_attn_func(q, k, v, causal=True, window_size=window)
            ms = _timed(fns, reps)
            pairs = visible_pairs(seqlen, seqlen, left, 0)
            flops = 4 * hdim * pairs * nheads * batch
            row = dict(
                shape=name, nheads=nheads, nheads_kv=nheads_kv, hdim=hdim, window=left,
                seqlen=seqlen, batch=batch, ms=ms,
                tflops={n: flops / t / 1e9 for n, t in ms.items() if n != "flash_cute causal"},
            )  # fmt: skip
            rows.append(row)
            print(_prefill_line(row), flush=True)
    return rows


def _prefill_line(row: dict) -> str:
    t, ms = row["tflops"], row["ms"]
    cells = " ".join(f"{n}={x:6.1f}" for n, x in t.items())
    vs = f"  vs fa4 {t['flash_cute'] / t['fa4']:.2f}x" if "fa4" in t and "flash_cute" in t else ""
    causal = ms.get("flash_cute causal")
    own = f"  time / own causal {ms['flash_cute'] / causal:.2f}" if causal else ""
    if "flash_cute causal row" in t:
        own += f"  table / causal row {t['flash_cute'] / t['flash_cute causal row']:.2f}x"
    return (
        f"{row['shape']} window {row['window']} seqlen {row['seqlen']} batch {row['batch']}: "
        f"{cells} TFLOP/s{vs}{own}"
    )


def run_softcap(seqlens: List[int], tokens: int = 16384, reps: int = 30) -> List[dict]:
    import flash_cute

    fa4 = _fa4()
    rows = []
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        q, k, v = _qkv(batch, seqlen, 16, 8, 256, seqlen)
        fns = {
            "flash_cute": lambda: flash_cute.flash_attn_func(q, k, v, causal=True),
            "flash_cute softcap": lambda: flash_cute.flash_attn_func(
                q, k, v, causal=True, softcap=50.0
            ),
        }
        if fa4 is not None:
            fns["fa4"] = lambda: fa4.flash_attn_func(q, k, v, causal=True)
            fns["fa4 softcap"] = lambda: fa4.flash_attn_func(q, k, v, causal=True, softcap=50.0)
        row = dict(case="Gemma 2 16/8 hdim 256 causal, softcap 50", seqlen=seqlen, batch=batch)
        row["ms"] = _timed(fns, reps)
        rows.append(row)
        print(_overhead_line(row, "softcap"), flush=True)
    return rows


def run_sinks(seqlen: int = 8192, tokens: int = 32768, reps: int = 30) -> List[dict]:
    import flash_cute

    fa4 = _fa4()
    rows = []
    batch = tokens // seqlen
    q, k, v = _qkv(batch, seqlen, 64, 8, 64, 5)
    sink = torch.randn(64, device="cuda", dtype=torch.float32)
    for left in (-1, 128):
        window = (left, 0)
        fns = {
            "flash_cute": lambda: flash_cute.flash_attn_func(
                q, k, v, causal=True, window_size=window
            ),
            "flash_cute sinks": lambda: flash_cute.flash_attn_func(
                q, k, v, causal=True, window_size=window, learnable_sink=sink
            ),
        }
        if fa4 is not None:
            # fa4 takes a slow local path for window_size=(-1, 0): pass only a bounded window.
            fa4_kw = dict(causal=True, window_size=window) if left >= 0 else dict(causal=True)
            fns["fa4"] = lambda kw=fa4_kw: fa4.flash_attn_func(q, k, v, **kw)
            fns["fa4 sinks"] = lambda kw=fa4_kw: fa4.flash_attn_func(
                q, k, v, learnable_sink=sink, **kw
            )
        row = dict(
            case=f"gpt-oss 64/8 hdim 64 causal{'' if left < 0 else f', window {left}'}",
            seqlen=seqlen,
            batch=batch,
        )
        row["ms"] = _timed(fns, reps)
        rows.append(row)
        print(_overhead_line(row, "sinks"), flush=True)
    return rows


def _overhead_line(row: dict, feature: str) -> str:
    ms = row["ms"]
    cells = " ".join(f"{n}={t * 1e3:.0f}us" for n, t in ms.items())
    ratios = " ".join(
        f"{n} +{(ms[f'{n} {feature}'] / ms[n] - 1) * 100:.1f}%"
        for n in ("flash_cute", "fa4")
        if n in ms and f"{n} {feature}" in ms
    )
    return f"{row['case']} seqlen {row['seqlen']} batch {row['batch']}: {cells}  {ratios}"


def run_decode(
    batches: List[int], seqlen_k: int = 131072, window: int = 4096, page_size: int = 16
) -> List[dict]:
    import flash_cute

    fa4 = _fa4()
    nheads, nheads_kv, d = 32, 8, 128
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs / 1e3:.2f} TB/s (read + write)", flush=True)
    rows = []
    for batch in batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        shape = (batch, seqlen_k, nheads_kv, d)
        k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
        window_bytes = 2 * batch * (window + 1) * nheads_kv * d * 2
        for page in (0, page_size):
            table = None
            k_cache, v_cache = k, v
            if page:
                pages = seqlen_k // page
                perm = torch.randperm(batch * pages, device="cuda", generator=gen)
                table = perm.view(batch, pages).to(torch.int32)
                k_cache = torch.empty_like(k).view(batch * pages, page, nheads_kv, d)
                v_cache = torch.empty_like(k_cache)
                k_cache[perm] = k.reshape(batch * pages, page, nheads_kv, d)
                v_cache[perm] = v.reshape(batch * pages, page, nheads_kv, d)

            def ours(keys, window_size, k_cache=k_cache, v_cache=v_cache, table=table):
                n = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
                return lambda: flash_cute.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=n, page_table=table, causal=True,
                    window_size=window_size,
                )  # fmt: skip

            fns = {
                "flash_cute": ours(seqlen_k, (window, 0)),
                "flash_cute no window, 4097 keys": ours(window + 1, (-1, -1)),
                "flash_cute no window, 1 key": ours(1, (-1, -1)),
            }
            if fa4 is not None and page:
                cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                fns["fa4"] = lambda k_cache=k_cache, v_cache=v_cache, table=table: (
                    fa4.flash_attn_varlen_func(
                        q.view(batch, nheads, d), k_cache, v_cache, cu_seqlens_q=cu_q,
                        seqused_k=lengths, page_table=table, max_seqlen_q=1, causal=True,
                        window_size=(window, 0),
                    )
                )  # fmt: skip
            elif fa4 is not None:
                fns["fa4"] = lambda: fa4.flash_attn_func(
                    q, k, v, causal=True, window_size=(window, 0)
                )
            row = dict(batch=batch, seqlen_k=seqlen_k, window=window, page_size=page, us={})
            for name, fn in fns.items():
                try:
                    row["us"][name] = time_cuda(fn, 3, 30) * 1e3
                    row["us"][name + "/graph"] = time_graph(fn) * 1e3
                except Exception as exc:
                    print(f"# {name}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
            fixed = row["us"].get("flash_cute no window, 1 key/graph", 0.0)
            row["floor_us"] = window_bytes / copy_gbs / 1e3 + fixed
            rows.append(row)
            print(_decode_line(row), flush=True)
        torch.cuda.empty_cache()
    return rows


def _decode_line(row: dict) -> str:
    us = row["us"]
    cells = "  ".join(f"{n}={t:.1f}us" for n, t in us.items())
    ours = us.get("flash_cute/graph")
    ratio = f"  graph / floor {ours / row['floor_us']:.2f}" if ours else ""
    layout = f"page {row['page_size']}" if row["page_size"] else "contiguous"
    return (
        f"batch {row['batch']} {layout} cache {row['seqlen_k']} window {row['window']}: "
        f"floor {row['floor_us']:.1f}us  {cells}{ratio}"
    )
