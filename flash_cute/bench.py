"""Benchmarks of flash_cute beside the attention peers present on the machine.

    python -m flash_cute.bench prefill [--dtype bf16] [--hdim 64 128 256] [--causal both]
                                       [--seqlens 512 ... 16384] [--json PATH]
                                       [--hdim 192 --hdim-v 128 --nheads 16]  (MLA)

    python -m flash_cute.bench decode [--batch 1 8 32 128] [--seqlens 1024 ... 131072]
                                      [--pages 0 16 64] [--hdim 512 --heads 8 4]
                                      [--json PATH]
    python -m flash_cute.bench sweep --hdim 128 [--causal] [knob lists] [--json PATH] [--plot PNG]
    python -m flash_cute.bench host
    python -m flash_cute.bench mla [--batch ...] [--seqlens ...]   (flash_cute.bench_mla)
    python -m flash_cute.bench trace prefill|decode|varlen [...] --out PREFIX
                                                   (per-SM timelines: flash_cute.bench_trace)

prefill: the FlashAttention-3 paper's grid (batch * seqlen = 16k tokens, nheads * hdim = 2048)
timed for flash_cute, torch SDPA with the cuDNN and flash backends, and flash-attn-4
(`flash_attn.cute`) when importable. Prints TFLOP/s per peer and flash_cute's ratio to the
best peer. Times are CUDA-event medians after warm-up; FLOPs = 2 * b * h * s^2 * (d + dv)
(4 * b * h * s^2 * d when dv = d), halved when causal.

decode: one new token per sequence against a KV cache (32 q heads, 8 kv heads, hdim 128,
bf16; --hdim, --heads Q KV), contiguous and paged (page 16, 64, random page order), for flash_cute
(flash_attn_with_kvcache, auto split count), torch SDPA and flash-attn-4 (paged through its
varlen API), eager and as CUDA-graph replays. Reports microseconds and the K+V read bandwidth
(bytes / time) beside the device-to-device copy bandwidth measured in the same run, plus a
varlen batch mixing prefills and decodes.

sweep: every valid config of the given knob lists (tile M/N, stages, P source, overlap,
ping-pong, rescale point, CTAs per SM, persistent scheduler) on the paper-grid shapes of one
head dim; prints a table ranked by geometric-mean TFLOP/s, writes JSON, and with --plot draws
TFLOP/s per config against sequence length. Configs compile in parallel worker processes first
(into the disk cache).

plot: redraw a sweep's JSON as a PNG, on any machine.

host: host microseconds per eager call on tiny problems (the GPU keeps up), for each entry
point and the peers, and the first-call time of a new config with an empty and a warm disk cache.

Times are per call with calls issued back to back (CUDA events around each, median), so a
call's time is its GPU time unless the host cannot keep up. Prefill peers take turns in rounds,
each round in another order (each peer follows every other equally often), so neither drift
during a run nor the previous peer's power draw favours one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from flash_cute import bench_trace
from flash_cute.config import TILE_SCHEDULERS, AttentionConfig
from flash_cute.timing import (
    copy_bandwidth_gbs,
    host_us_per_call,
    time_cuda,
    time_graph,
    time_interleaved,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def prefill_peers(q, k, v, causal: bool) -> Dict[str, Callable[[], object]]:
    """Callables computing the same attention, keyed by peer name (flash_cute first)."""
    import flash_cute

    peers = {"flash_cute": lambda: flash_cute.flash_attn_func(q, k, v, causal=causal)}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    # SDPA wants (b, h, s, d); transpose once, outside the timed region.
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)]
    if q.shape[-1] > 256:  # (head dims the fused backends refuse: SDPA's best is this one)
        backends.append(("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION))
    for name, backend in backends:

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


def prefill_flops(
    batch: int, nheads: int, seqlen: int, head_dim: int, causal: bool, head_dim_v=None
) -> float:
    """FLOPs of one attention forward over a padded batch: 2 b h s^2 (d + dv) (4 b h s^2 d
    when dv == d), halved when causal."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    return 2 * batch * nheads * seqlen * seqlen * (head_dim + head_dim_v) / (2 if causal else 1)


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
    pass_ratios: List[float] = field(default_factory=list)  # flash_cute / best peer in each pass
    hdim_v: Optional[int] = None  # V's head dim where it differs from q's (MLA: 192 / 128)

    @property
    def flops(self) -> float:
        return prefill_flops(
            self.batch, self.nheads, self.seqlen, self.hdim, self.causal, self.hdim_v
        )

    @property
    def dims(self) -> str:
        return f"{self.hdim}/{self.hdim_v}" if self.hdim_v else str(self.hdim)

    @property
    def paired_ratio(self) -> Optional[float]:
        """flash_cute / best peer: with several passes the median of the passes' ratios (each
        pass times the peers side by side, so its ratio shares one state of the GPU's clocks)."""
        if len(self.pass_ratios) > 1:
            return statistics.median(self.pass_ratios)
        return self.ratio_to_best_peer

    @property
    def ratio_to_best_peer(self) -> Optional[float]:
        others = [t for name, t in self.tflops.items() if name != "flash_cute"]
        if "flash_cute" not in self.tflops or not others:
            return None
        return self.tflops["flash_cute"] / max(others)


def run_prefill(
    dtype: str,
    hdims: List[int],
    causals: List[bool],
    seqlens: List[int],
    total_tokens: int = 16384,
    hidden: int = 2048,
    warmup: int = 5,
    reps: int = 30,
    passes: int = 1,
    hdim_v: Optional[int] = None,
    nheads: Optional[int] = None,
) -> List[PrefillRow]:
    """The grid, each point timed with its peers interleaved (hdim_v: V's head dim where it
    differs from q's; nheads: fixed instead of hidden // hdim). With passes > 1 the whole grid runs
    that many times; each peer's time at a point is its median over the passes, and the ratio
    to the best peer the median of the passes' ratios: a point's passes lie a minute or more
    apart, so a stretch of lower clocks (power or temperature) falls on one pass of it rather
    than deciding it."""
    points = [(hdim, causal, seqlen) for hdim in hdims for causal in causals for seqlen in seqlens]
    runs: Dict[tuple, List[PrefillRow]] = {point: [] for point in points}
    for p in range(passes):
        for hdim, causal, seqlen in points:
            heads = nheads or hidden // hdim
            batch = max(1, total_tokens // seqlen)
            gen = torch.Generator(device="cuda").manual_seed(seqlen + hdim)
            q, k, v = (
                torch.randn(
                    batch, seqlen, heads, dim, device="cuda", dtype=DTYPES[dtype], generator=gen
                )
                for dim in (hdim, hdim, hdim_v or hdim)
            )
            row = PrefillRow(dtype, hdim, causal, seqlen, batch, heads, hdim_v=hdim_v)
            for name, ms in time_interleaved(prefill_peers(q, k, v, causal), warmup, reps).items():
                row.ms[name] = ms
                row.tflops[name] = row.flops / ms / 1e9
            runs[(hdim, causal, seqlen)].append(row)
            print(
                format_prefill_row(row) + (f"  (pass {p + 1}/{passes})" if passes > 1 else ""),
                flush=True,
            )
            del q, k, v
    return [merge_passes(rows) for rows in runs.values()]


def merge_passes(rows: List[PrefillRow]) -> PrefillRow:
    """One point's passes as one row: each peer's median time, and each pass's ratio (their
    median is the row's paired_ratio)."""
    first = rows[0]
    merged = PrefillRow(
        first.dtype,
        first.hdim,
        first.causal,
        first.seqlen,
        first.batch,
        first.nheads,
        hdim_v=first.hdim_v,
    )
    for name in dict.fromkeys(name for r in rows for name in r.ms):  # peers of any pass
        times = [r.ms[name] for r in rows if name in r.ms]
        merged.ms[name] = statistics.median(times)
        merged.tflops[name] = merged.flops / merged.ms[name] / 1e9
    merged.pass_ratios = [r.ratio_to_best_peer for r in rows if r.ratio_to_best_peer is not None]
    return merged


def format_prefill_row(row: PrefillRow) -> str:
    cells = " ".join(f"{name}={t:6.1f}" for name, t in row.tflops.items())
    ratio = row.ratio_to_best_peer
    ratio_s = f"{ratio:.2f}x" if ratio is not None else "n/a"
    return (
        f"{row.dtype} hdim={row.dims:>3} causal={int(row.causal)} seqlen={row.seqlen:5d} "
        f"batch={row.batch:2d}: {cells}  flash_cute/best_peer={ratio_s}"
    )


def prefill_table(rows: List[PrefillRow]) -> str:
    """Markdown table: TFLOP/s per peer per sequence length."""
    peers = []
    for row in rows:
        peers += [p for p in row.tflops if p not in peers]
    seqlens = sorted({r.seqlen for r in rows})
    lines = [
        "| dtype | hdim | causal | peer | " + " | ".join(str(s) for s in seqlens) + " |",
        "|---|---|---|---|" + "---|" * len(seqlens),
    ]
    groups = sorted({(r.dtype, r.hdim, r.dims, r.causal) for r in rows})
    for dtype, _, dims, causal in groups:  # (sorted by head dim, labelled by both)
        group = {r.seqlen: r for r in rows if (r.dtype, r.dims, r.causal) == (dtype, dims, causal)}
        several = any(len(r.pass_ratios) > 1 for r in group.values())
        for peer in peers + ["ratio"] + (["pass ratios"] if several else []):
            cells = []
            for s in seqlens:
                r = group.get(s)
                if r is None:
                    cells.append("")
                elif peer == "ratio":
                    ratio = r.paired_ratio
                    cells.append(f"{ratio:.2f}" if ratio is not None else "")
                elif peer == "pass ratios":
                    cells.append(
                        f"{min(r.pass_ratios):.2f}-{max(r.pass_ratios):.2f}"
                        if r.pass_ratios
                        else ""
                    )
                else:
                    cells.append(f"{r.tflops[peer]:.0f}" if peer in r.tflops else "")
            name = {"ratio": "flash_cute / best peer", "pass ratios": "range over passes"}.get(
                peer, peer
            )
            lines.append(
                f"| {dtype} | {dims} | {'yes' if causal else 'no'} | {name} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


@dataclass
class DecodeRow:
    batch: int
    seqlen_k: int
    page_size: int  # 0: contiguous cache
    kv_bytes: int
    us: Dict[str, float] = field(default_factory=dict)  # "peer" eager, "peer/graph" replayed

    def tbs(self, name: str) -> float:
        """K+V bytes read per second (an "_fp8" peer reads half the bf16 cache's bytes)."""
        scale = 0.5 if name.split("/")[0].endswith("_fp8") else 1.0
        return scale * self.kv_bytes / self.us[name] / 1e6


def _flashinfer_decode(q, k_cache, v_cache, page_table, seqlens) -> Callable[[], object]:
    """FlashInfer's paged decode (BatchDecodeWithPagedKVCacheWrapper, NHD pages) of q (batch,
    1, nheads, d) over k_cache, v_cache (num_pages, page_size, nheads_kv, d) in bf16 or
    float8_e4m3fn (scales 1); planned here (a host sync), so the callable only runs."""
    import flashinfer

    batch, _, nheads, d = q.shape
    page, nheads_kv = k_cache.shape[1], k_cache.shape[2]
    used = (seqlens.long() + page - 1) // page
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = used.cumsum(0)
    indices = page_table[torch.arange(page_table.shape[1], device="cuda") < used[:, None]]
    last = (seqlens.long() - (used - 1) * page).to(torch.int32)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        indptr, indices.to(torch.int32), last, nheads, nheads_kv, d, page,
        q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )  # fmt: skip
    q3 = q[:, 0]
    out = torch.empty_like(q3)
    return lambda: wrapper.run(q3, (k_cache, v_cache), out=out)


def _try_peer(peers: Dict[str, Callable[[], object]], name: str, make) -> None:
    """peers[name] = make() once a first call runs; otherwise a line on stderr saying why."""
    try:
        fn = make()
        fn()
        peers[name] = fn
    except Exception as exc:
        print(f"# {name} unavailable: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)


def decode_peers(
    q, k, v, page_size: int, seqlens: torch.Tensor, gen
) -> Dict[str, Callable[[], object]]:
    """(batch, 1, nheads, d) decode against k/v (batch, seqlen_k, nheads_kv, d), paged when
    page_size: flash_cute and FlashInfer on the bf16 cache and on its float8_e4m3fn copy
    ("_fp8", descales 1), FlashAttention-4, and on contiguous caches every SDPA backend."""
    import flash_cute

    batch, seqlen_k = k.shape[0], k.shape[1]
    fp8 = torch.float8_e4m3fn
    k8, v8 = k.to(fp8), v.to(fp8)
    ones = torch.ones(1, device="cuda").expand(batch, k.shape[2])
    peers: Dict[str, Callable[[], object]] = {}
    if page_size:
        pages = seqlen_k // page_size
        num_pages = batch * pages
        perm = torch.randperm(num_pages, device="cuda", generator=gen)
        page_table = perm.view(batch, pages).to(torch.int32)

        def paged(x):
            cache = torch.empty(num_pages, page_size, *x.shape[2:], dtype=x.dtype, device="cuda")
            cache.view(torch.uint8)[perm] = x.view(torch.uint8).reshape(
                num_pages, page_size, *x.shape[2:-1], -1
            )
            return cache

        kc, vc, kc8, vc8 = paged(k), paged(v), paged(k8), paged(v8)
    else:  # (FlashInfer reads a contiguous cache as pages of 16 keys)
        kc, vc, kc8, vc8 = k, v, k8, v8
        page_table = None
    peers["flash_cute"] = lambda: flash_cute.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=seqlens, page_table=page_table
    )
    peers["flash_cute_fp8"] = lambda: flash_cute.flash_attn_with_kvcache(
        q, kc8, vc8, cache_seqlens=seqlens, page_table=page_table, k_descale=ones, v_descale=ones
    )
    fi_page = page_size or 16
    fi_table = page_table
    if not page_size:
        fi_table = torch.arange(batch * seqlen_k // 16, device="cuda", dtype=torch.int32).view(
            batch, -1
        )
    for name, a, b in (("flashinfer", kc, vc), ("flashinfer_fp8", kc8, vc8)):
        if not page_size:
            a, b = (t.view(-1, fi_page, *t.shape[2:]) for t in (a, b))
        _try_peer(peers, name, lambda a=a, b=b: _flashinfer_decode(q, a, b, fi_table, seqlens))
    if page_size:

        def fa4_paged():
            from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

            cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            q_packed = q.reshape(batch, *q.shape[2:])
            return lambda: fa4_varlen(
                q_packed, kc, vc, cu_seqlens_q=cu_q, seqused_k=seqlens, page_table=page_table,
                max_seqlen_q=1,
            )  # fmt: skip

        _try_peer(peers, "fa4", fa4_paged)
        return peers
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    for name, backend in (
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def make(backend=backend):
            # (efficient attention takes no enable_gqa: K/V expanded to q's heads)
            gqa = backend is not SDPBackend.EFFICIENT_ATTENTION
            ke, ve = (kt, vt) if gqa else (t.repeat_interleave(rep, dim=1) for t in (kt, vt))

            def run():
                with sdpa_kernel(backend):
                    return sdpa(qt, ke, ve, enable_gqa=gqa)

            return run

        _try_peer(peers, name, make)

    def fa4_dense():
        from flash_attn.cute import flash_attn_func as fa4_func

        return lambda: fa4_func(q, k, v)

    _try_peer(peers, "fa4", fa4_dense)
    return peers


def run_decode(
    batches: List[int],
    seqlens: List[int],
    pages: List[int],
    graphs: bool = True,
    memory_fraction: float = 0.4,
    head_dim: int = 128,
    heads: tuple = (32, 8),
) -> List[DecodeRow]:
    (nheads, nheads_kv), d, dtype = heads, head_dim, torch.bfloat16
    free = torch.cuda.mem_get_info()[0]
    rows = []
    for batch in batches:
        for seqlen_k in seqlens:
            kv_bytes = 2 * batch * seqlen_k * nheads_kv * d * 2
            if 3 * kv_bytes > memory_fraction * free:  # paged and FP8 copies triple it
                print(
                    f"# skip batch={batch} seqlen_k={seqlen_k}: {kv_bytes / 1e9:.1f} GB",
                    file=sys.stderr,
                )
                continue
            gen = torch.Generator(device="cuda").manual_seed(batch * 7 + seqlen_k)
            q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(
                batch, seqlen_k, nheads_kv, d, device="cuda", dtype=dtype, generator=gen
            )
            v = torch.randn(
                batch, seqlen_k, nheads_kv, d, device="cuda", dtype=dtype, generator=gen
            )
            seqlens_t = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
            for page in pages:
                if page and seqlen_k % page:
                    continue
                row = DecodeRow(batch, seqlen_k, page, kv_bytes)
                for name, fn in decode_peers(q, k, v, page, seqlens_t, gen).items():
                    try:
                        row.us[name] = time_cuda(fn, 3, 20) * 1e3
                    except torch.OutOfMemoryError:  # a peer on K/V expanded to q's heads
                        print(f"# {name} out of memory: not timed", file=sys.stderr)
                        continue
                    if graphs:
                        try:
                            row.us[name + "/graph"] = time_graph(fn) * 1e3
                        except Exception as exc:
                            print(
                                f"# {name} graph capture failed: "
                                f"{type(exc).__name__}: {str(exc)[:120]}",
                                file=sys.stderr,
                            )
                rows.append(row)
                print(format_decode_row(row), flush=True)
                torch.cuda.empty_cache()
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def format_decode_row(row: DecodeRow) -> str:
    cells = "  ".join(f"{name}={us:8.1f}us {row.tbs(name):5.2f}TB/s" for name, us in row.us.items())
    layout = f"page{row.page_size}" if row.page_size else "contig"
    return (
        f"batch={row.batch:3d} seqlen_k={row.seqlen_k:6d} {layout:7s} "
        f"KV={row.kv_bytes / 1e6:8.1f}MB  {cells}"
    )


def decode_table(rows: List[DecodeRow], copy_gbs: float) -> str:
    names = []
    for row in rows:
        names += [n for n in row.us if n not in names]
    lines = [
        "K+V read bandwidth in TB/s (us in parentheses); "
        f"device-to-device copy: {copy_gbs / 1e3:.2f} TB/s",
        "",
        "| batch | seqlen_k | KV MB | layout | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [f"{r.tbs(n):.2f} ({r.us[n]:.0f})" if n in r.us else "" for n in names]
        layout = f"page {r.page_size}" if r.page_size else "contiguous"
        lines.append(
            f"| {r.batch} | {r.seqlen_k} | {r.kv_bytes / 1e6:.0f} | {layout} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def run_varlen_mixed() -> str:
    """A mixed batch: 2 prefill chunks of 2048 tokens and 30 single-token decodes over 8k-key
    contexts, through one flash_attn_varlen_func call on a paged cache (page 64)."""
    import flash_cute

    nheads, nheads_kv, d, page = 32, 8, 128, 64
    q_lens = [2048, 2048] + [1] * 30
    k_lens = [2048, 4096] + [8192] * 30
    batch = len(q_lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), nheads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pages = max(k_lens) // page
    k_cache = torch.randn(
        batch * pages, page, nheads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    v_cache = torch.randn_like(k_cache)
    page_table = (
        torch.randperm(batch * pages, device="cuda", generator=gen)
        .view(batch, pages)
        .to(torch.int32)
    )
    seqused = torch.tensor(k_lens, device="cuda", dtype=torch.int32)
    kv_bytes = sum(k_lens) * nheads_kv * d * 2 * 2
    flops = sum(4 * nheads * ql * kl * d for ql, kl in zip(q_lens, k_lens))
    lines = []
    for causal in (False, True):
        fn = lambda: flash_cute.flash_attn_varlen_func(  # noqa: E731
            q,
            k_cache,
            v_cache,
            cu_q,
            max(q_lens),
            seqused_k=seqused,
            page_table=page_table,
            causal=causal,
            num_splits=0,
        )
        ms = time_cuda(fn, 3, 20)
        lines.append(
            "varlen mixed batch (2 x 2048-token prefill + 30 decodes at 8k keys, page 64, "
            f"causal={causal}): flash_cute {ms * 1e3:.0f} us, "
            f"{kv_bytes / ms / 1e9:.2f} TB/s of K+V, {flops / ms / 1e9:.0f} TFLOP/s"
        )
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

            fa4 = lambda: fa4_varlen(  # noqa: E731
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=cu_q,
                seqused_k=seqused,  # noqa: E731
                page_table=page_table,
                max_seqlen_q=max(q_lens),
                causal=causal,
            )
            fa4()
            ms = time_cuda(fa4, 3, 20)
            lines.append(f"    fa4 {ms * 1e3:.0f} us, {kv_bytes / ms / 1e9:.2f} TB/s")
        except Exception as exc:
            lines.append(f"    fa4 unavailable: {type(exc).__name__}: {str(exc)[:100]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# FP8-math sweeps (benchmarks/fp8_prefill.py, fp8_decode.py)
# ----------------------------------------------------------------------------------------

_PLAN_FP8_MATH_CONFIG = None  # plan.fp8_math_config as the plan has it


def fp8_math_knobs(name: str) -> dict:
    """The config changes of an FP8-math sweep name: parts
    joined by "+", each mN tile_m, nN tile_n, stN num_stages, rP/M producer and MMA
    registers, ppN pingpong, ovN intra_wg_overlap (0 also drops the O rescale before P V,
    which needs it), dyn / static a persistent scheduler, bN transpose_batch, fmaN exp2_on_fma
    (N of every 16 exponentials on the FMA pipe)."""
    changes = {}
    for part in name.split("+"):
        kind = part.rstrip("0123456789/")
        value = part[len(kind) :]
        if part in ("dyn", "static"):
            changes["scheduler"] = f"{'dynamic' if part == 'dyn' else 'static'}_persistent"
        elif kind == "r":
            producer, mma = value.split("/")
            changes.update(producer_registers=int(producer), mma_registers=int(mma))
        elif kind in ("m", "n", "st", "pp"):
            field_name = {"m": "tile_m", "n": "tile_n", "st": "num_stages", "pp": "pingpong"}[kind]
            changes[field_name] = bool(int(value)) if kind == "pp" else int(value)
        elif kind == "ov":
            changes.update(intra_wg_overlap=bool(int(value)), rescale_o_before_pv=False)
        elif kind == "b":
            changes["transpose_batch"] = int(value)
        elif kind == "fma":
            changes["exp2_on_fma"] = int(value)
        else:
            raise ValueError(f"unknown FP8-math knob {part!r} in {name!r}")
    return changes


def set_fp8_math_changes(changes: dict, plans) -> None:
    """The plan's FP8-math configs from now on with `changes` applied ({}: the plan's own);
    the entry point's launch plans (`plans`) cleared, as a kept plan replays its config."""
    from flash_cute import plan

    global _PLAN_FP8_MATH_CONFIG
    if _PLAN_FP8_MATH_CONFIG is None:
        _PLAN_FP8_MATH_CONFIG = plan.fp8_math_config
    original = _PLAN_FP8_MATH_CONFIG
    plan.fp8_math_config = (
        (lambda *a, **k: original(*a, **k).replace(**changes)) if changes else original
    )
    plans.clear()


# ----------------------------------------------------------------------------------------
# Config sweep
# ----------------------------------------------------------------------------------------

ON_OFF = {"on": True, "off": False}


# The sweep's knobs: (flag, AttentionConfig field, values: "on/off" or a type or choices,
# default list, help). Each flag takes a list; the sweep tries their product.
SWEEP_KNOBS = [
    ("--tile-m", "tile_m", int, [64, 128, 192], None),
    ("--tile-n", "tile_n", int, [64, 80, 96, 112, 128, 144, 160, 176, 192], None),
    ("--stages", "num_stages", int, [2], None),
    ("--pv", "pv_from_registers", {"regs": True, "smem": False}, ["regs", "smem"], None),
    ("--overlap", "intra_wg_overlap", ON_OFF, ["on"], None),
    ("--pingpong", "pingpong", ON_OFF, ["on", "off"], None),
    ("--rescale-before-pv", "rescale_o_before_pv", ON_OFF, ["off", "on"], None),
    ("--ctas-per-sm", "ctas_per_sm", int, [1], None),
    (
        "--scheduler",
        "scheduler",
        {name: name for name in TILE_SCHEDULERS},
        list(TILE_SCHEDULERS),
        "tile schedulers to try (one CTA per tile, or persistent CTAs)",
    ),
    (
        "--l2-section-mb",
        "l2_section_mb",
        int,
        [AttentionConfig.l2_section_mb],
        "causal tile order: MB of K/V per section of heads ordered longest first",
    ),
    (
        "--mbarrier-probe",
        "mbarrier_probe",
        ON_OFF,
        ["off"],
        "poll K/V barriers once before the blocking wait",
    ),
    (
        "--exp2-on-fma",
        "exp2_on_fma",
        int,
        [0],
        "of every 16 softmax exponentials, how many a polynomial computes on the FMA pipe",
    ),
    (
        "--lazy-rescale",
        "lazy_rescale",
        ON_OFF,
        ["off"],
        "skip a warp's O rescale when no row max moved",
    ),
    (
        "--rescale-threshold",
        "rescale_threshold",
        int,
        [0],
        "log2 units a row's max may lag a new block's before it moves",
    ),
    (
        "--store-o-from-registers",
        "store_o_from_registers",
        ON_OFF,
        ["off"],
        "padded problems store O from registers instead of through smem and TMA",
    ),
    ("--o-split", "o_split", int, [1], "warpgroups splitting O (2: dv > 256)"),
    (
        "--split-scores",
        "split_scores",
        ON_OFF,
        ["off"],
        "o_split warpgroups split each key block's scores (P through smem)",
    ),
]


def sweep_configs(head_dim: int, dtype: str, head_dim_v=None, **knobs) -> List[AttentionConfig]:
    """Every valid AttentionConfig of the product of the knob lists (AttentionConfig field ->
    values; a field not given keeps its default), for V head dim head_dim_v (default
    head_dim)."""
    import itertools

    configs = []
    for values in itertools.product(*knobs.values()):
        try:
            cfg = AttentionConfig(**dict(zip(knobs, values)))
            cfg.validate(head_dim, "bfloat16" if dtype == "bf16" else "float16", head_dim_v)
        except ValueError:
            continue
        configs.append(cfg)
    return configs


def _compile_worker(variant):
    from flash_cute.compile_cache import get_forward_kernel

    try:
        get_forward_kernel(variant)
        return None
    except Exception as exc:  # reported, and the config is skipped
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile_parallel(variants, workers: int) -> dict:
    """Compile keys in worker processes into the disk cache; returns {key: error} failures."""
    import concurrent.futures
    import multiprocessing

    from flash_cute.compile_cache import disk_cache_dir

    if workers <= 1 or disk_cache_dir() is None:
        return {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        errors = dict(zip(variants, pool.map(_compile_worker, variants)))
    return {k: e for k, e in errors.items() if e}


@dataclass
class SweepRow:
    config: dict
    label: str
    tflops: Dict[int, float] = field(default_factory=dict)  # seqlen -> TFLOP/s

    @property
    def geomean(self) -> float:
        values = [t for t in self.tflops.values() if t > 0]
        return float(torch.tensor(values).log().mean().exp()) if values else 0.0


def config_label(cfg) -> str:
    label = (
        f"{cfg.tile_m}x{cfg.tile_n} st{cfg.num_stages} {'RS' if cfg.pv_from_registers else 'SS'}"
        f"{' ov' if cfg.intra_wg_overlap else ''}{' pp' if cfg.pingpong else ''}"
        f"{' rb' if cfg.rescale_o_before_pv else ''}"
    )
    label += f" {cfg.ctas_per_sm}cta" if cfg.ctas_per_sm > 1 else ""
    short = {"single_tile": "", "static_persistent": " static", "dynamic_persistent": " dynamic"}
    label += (
        f" l2:{cfg.l2_section_mb}MB" if cfg.l2_section_mb != AttentionConfig.l2_section_mb else ""
    )
    label += " probe" if cfg.mbarrier_probe else ""
    label += f" fma-exp2:{cfg.exp2_on_fma}/16" if cfg.exp2_on_fma else ""
    label += " lazy" if cfg.lazy_rescale else ""
    label += f" lag{cfg.rescale_threshold}" if cfg.rescale_threshold else ""
    label += " O-regs" if cfg.store_o_from_registers else ""
    label += f" O-split{cfg.o_split}" if cfg.o_split > 1 else ""
    label += " split-scores" if cfg.split_scores else ""
    return label + short[cfg.scheduler]


def run_sweep(
    head_dim: int,
    causal: bool,
    dtype: str,
    seqlens: List[int],
    configs,
    workers: int,
    reps: int = 20,
    window_left: int = -1,
    head_dim_v: Optional[int] = None,
    nheads: Optional[int] = None,
) -> List[SweepRow]:
    """With window_left, a causal window (window_left, 0); TFLOP/s then count the visible
    (query, key) pairs only. head_dim_v: V's head dim where it differs; nheads: fixed instead
    of 2048 // head_dim."""
    import flash_cute
    from flash_cute.precompile import func_variant

    dtype_name = "bfloat16" if dtype == "bf16" else "float16"
    variants = [
        func_variant(
            cfg, head_dim, dtype_name, causal, window_left=window_left, head_dim_v=head_dim_v
        )
        for cfg in configs
    ]
    failed = precompile_parallel(variants, workers)
    for cfg, variant in zip(configs, variants):
        if variant in failed:
            print(f"# skip {config_label(cfg)}: {failed[variant]}", file=sys.stderr)
    configs = [cfg for cfg, variant in zip(configs, variants) if variant not in failed]
    rows = [SweepRow(asdict(cfg), config_label(cfg)) for cfg in configs]
    nheads = nheads or 2048 // head_dim
    for seqlen in seqlens:
        batch = max(1, 16384 // seqlen)
        gen = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k, v = (
            torch.randn(
                batch, seqlen, nheads, dim, device="cuda", dtype=DTYPES[dtype], generator=gen
            )
            for dim in (head_dim, head_dim, head_dim_v or head_dim)
        )
        flops = prefill_flops(batch, nheads, seqlen, head_dim, causal, head_dim_v)
        window = {}
        if window_left >= 0:
            from flash_cute.bench_local import visible_pairs

            window = dict(window_size=(window_left, 0))
            flops = 4 * head_dim * visible_pairs(seqlen, seqlen, window_left, 0) * nheads * batch
        # Configs take turns in rounds, so drift hits them alike (up to 4 rounds: with many
        # configs, the orders are not balanced the way the prefill peers' are).
        fns = {
            row.label: (
                lambda cfg=cfg: flash_cute.flash_attn_func(
                    q, k, v, causal=causal, config=cfg, **window
                )
            )
            for row, cfg in zip(rows, configs)
        }
        times = time_interleaved(fns, warmup=3, reps=reps, rounds=min(4, reps))
        for row in rows:
            row.tflops[seqlen] = flops / times[row.label] / 1e9
        best = max(rows, key=lambda r: r.tflops[seqlen])
        print(f"seqlen {seqlen}: best {best.label} {best.tflops[seqlen]:.0f} TFLOP/s", flush=True)
    return sorted(rows, key=lambda r: -r.geomean)


def sweep_table(rows: List[SweepRow], seqlens: List[int], top: int = 30) -> str:
    lines = [
        "| rank | config | geomean | " + " | ".join(str(s) for s in seqlens) + " |",
        "|---|---|---|" + "---|" * len(seqlens),
    ]
    for rank, r in enumerate(rows[:top], 1):
        cells = " | ".join(f"{r.tflops.get(s, 0):.0f}" for s in seqlens)
        lines.append(f"| {rank} | {r.label} | {r.geomean:.0f} | {cells} |")
    return "\n".join(lines)


def plot_sweep(
    rows: List[SweepRow], seqlens: List[int], title: str, path: str, highlight: int = 8
) -> None:
    """TFLOP/s against sequence length, one line per config; the best `highlight` in color."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for r in rows[highlight:]:
        ax.plot(
            seqlens, [r.tflops.get(s, float("nan")) for s in seqlens], color="0.8", lw=0.8, zorder=1
        )
    for r in rows[:highlight]:
        ax.plot(
            seqlens,
            [r.tflops.get(s, float("nan")) for s in seqlens],
            marker="o",
            lw=1.8,
            zorder=2,
            label=f"{r.label} ({r.geomean:.0f})",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [str(s) for s in seqlens])
    ax.set_xlabel("sequence length (batch x seqlen = 16k tokens)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, title="best configs (geomean TFLOP/s)", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_host() -> List[str]:
    """Host cost per eager call on tiny problems, for flash_cute's entry points and the peers,
    and the disk cache's first-call times."""
    import subprocess

    import flash_cute

    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 8, 128, device=dev, dtype=bf16)
    k, v = (
        torch.randn(1, 256, 8, 128, device=dev, dtype=bf16),
        torch.randn(1, 256, 8, 128, device=dev, dtype=bf16),
    )
    qd = torch.randn(1, 1, 16, 128, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 1024, 2, 128, device=dev, dtype=bf16) for _ in range(2))
    seqlens = torch.full((1,), 1024, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    calls = {
        "flash_cute.flash_attn_func": lambda: flash_cute.flash_attn_func(q, k, v),
        "flash_cute.flash_attn_func(out=)": lambda: flash_cute.flash_attn_func(q, k, v, out=out),
        "flash_cute.flash_attn_with_kvcache (no split)": lambda: flash_cute.flash_attn_with_kvcache(
            qd, kc, vc, cache_seqlens=seqlens, num_splits=1
        ),
        "flash_cute.flash_attn_with_kvcache (auto split, merged in-kernel)": lambda: (
            flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens)
        ),
        "flash_cute.flash_attn_with_kvcache (int cache_seqlens, auto split)": lambda: (
            flash_cute.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=1000)
        ),
    }
    # A decode loop's int length grows by one per step (512-1023: one launch plan).
    growing = iter(range(1 << 40))
    calls["flash_cute.flash_attn_with_kvcache (int cache_seqlens + 1 per call, auto split)"] = (
        lambda: flash_cute.flash_attn_with_kvcache(
            qd, kc, vc, cache_seqlens=512 + next(growing) % 512
        )
    )
    # A vLLM-style paged decode step through the varlen entry point: 4 sequences, 4 splits.
    qv = torch.randn(4, 16, 128, device=dev, dtype=bf16)
    kp, vp = (torch.randn(64, 16, 2, 128, device=dev, dtype=bf16) for _ in range(2))
    cu_q = torch.arange(5, dtype=torch.int32, device=dev)
    pages = torch.arange(64, dtype=torch.int32, device=dev).view(4, 16)
    used = torch.full((4,), 256, dtype=torch.int32, device=dev)
    calls["flash_cute.flash_attn_varlen_func (paged decode, 4 splits)"] = lambda: (
        flash_cute.flash_attn_varlen_func(
            qv, kp, vp, cu_q, 1, seqused_k=used, max_seqlen_k=256, page_table=pages, num_splits=4
        )
    )
    # The same calls through FlashAttention-3's interface module, and through the custom ops
    # (the dispatcher: what a torch.compile graph calls; eager calls skip it).
    from flash_cute import flash_attn_interface as fa3

    calls["flash_attn_interface.flash_attn_func"] = lambda: fa3.flash_attn_func(q, k, v)
    calls["flash_attn_interface.flash_attn_with_kvcache (no split)"] = lambda: (
        fa3.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens, num_splits=1)
    )
    calls["flash_attn_interface.flash_attn_with_kvcache (paged decode, varlen q, 4 splits)"] = (
        lambda: fa3.flash_attn_with_kvcache(
            qv, kp, vp, cache_seqlens=used, page_table=pages, cu_seqlens_q=cu_q, max_seqlen_q=1,
            num_splits=4,
        )
    )  # fmt: skip
    from flash_cute.call import Call
    from flash_cute.ops import op_arguments

    func_op = op_arguments(Call(q, k, v, out, decode_rows=False, pack_gqa=False))
    decode_op = op_arguments(Call(qd, kc, vc, torch.empty_like(qd), seqused_k=seqlens))
    calls["torch.ops.flash_cute.forward (func, out=)"] = lambda: torch.ops.flash_cute.forward(
        *func_op
    )
    calls["torch.ops.flash_cute.forward (kvcache, no split, out=)"] = lambda: (
        torch.ops.flash_cute.forward(*decode_op)
    )
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    calls["torch sdpa"] = lambda: sdpa(qt, kt, vt)
    scratch = torch.zeros(8, device=dev)
    calls["torch x.add_(0) (one tiny kernel launch: the CPU's speed)"] = lambda: scratch.add_(0)
    try:
        from flash_attn.cute import flash_attn_func as fa4_func

        fa4_func(q, k, v)
        calls["fa4 flash_attn_func"] = lambda: fa4_func(q, k, v)
    except Exception as exc:
        print(f"# fa4 unavailable: {type(exc).__name__}", file=sys.stderr)
    lines = [
        f"{name}: {median:.1f} us/call (median of rounds; best round {best:.1f})"
        for name, (median, best) in host_us_per_call(calls).items()
    ]
    code = (
        "import time, torch, flash_cute; "
        "q = torch.randn(1, 77, 4, 96, device='cuda', dtype=torch.float16); "
        "t = time.time(); flash_cute.flash_attn_func(q, q, q, causal=True); "
        "torch.cuda.synchronize(); "
        "print(f'{time.time() - t:.3f}')"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, FLASH_CUTE_CACHE_DIR=cache_dir)
        for label in (
            "first call of a new config, empty disk cache",
            "first call in a new process, warm disk cache",
        ):
            r = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True
            )
            lines.append(f"{label}: {r.stdout.strip() or r.stderr[-200:]} s")
    return lines


# Varlen prefill cases: (name, number of sequences, length range, hdim, q heads, kv heads, causal).
VARLEN_PREFILL_CASES = [
    ("16 x 100-2000, hdim 128, causal", 16, (100, 2000), 128, 32, 8, True),
    ("16 x 100-2000, hdim 128", 16, (100, 2000), 128, 32, 8, False),
    ("64 x 50-600, hdim 128, causal", 64, (50, 600), 128, 32, 8, True),
    ("8 x 500-4000, hdim 64, causal", 8, (500, 4000), 64, 32, 32, True),
    ("8 x 500-4000, hdim 256, causal", 8, (500, 4000), 256, 16, 16, True),
]


@dataclass
class VarlenPrefillRow:
    case: str
    config: str
    tokens: int
    tflops: Dict[str, float] = field(default_factory=dict)


def varlen_case_lengths(case, seed: int) -> List[int]:
    _, count, (lo, hi), *_ = case
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (count,), generator=gen).tolist()


def run_varlen_prefill(dtype: str, seed: int = 0, reps: int = 40) -> List[VarlenPrefillRow]:
    """One flash_attn_varlen_func call per case (packed K/V, random lengths): the table's
    config, the same config with one CTA per tile, and flash-attn-4's varlen call."""
    import flash_cute
    from flash_cute.checks import dtype_name
    from flash_cute.config import default_config

    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    except Exception as exc:
        fa4_varlen = None
        print(f"# fa4 unavailable: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
    rows = []
    for case in VARLEN_PREFILL_CASES:
        name, _, _, hdim, nheads, nheads_kv, causal = case
        lens = varlen_case_lengths(case, seed)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
        total, longest = int(cu[-1]), max(lens)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(total, nheads, hdim, device="cuda", dtype=DTYPES[dtype], generator=gen)
        k = torch.randn(total, nheads_kv, hdim, device="cuda", dtype=DTYPES[dtype], generator=gen)
        v = torch.randn_like(k)
        flops = sum(4 * n * n * hdim * nheads / (2 if causal else 1) for n in lens)
        table = default_config(hdim, dtype_name(DTYPES[dtype]), causal, longest)
        one_cta = table.replace(scheduler="single_tile")

        def ours(cfg):
            return lambda: flash_cute.flash_attn_varlen_func(
                q,
                k,
                v,
                cu,
                longest,
                cu_seqlens_k=cu,
                max_seqlen_k=longest,
                causal=causal,
                config=cfg,
            )

        fns = {"flash_cute": ours(table), "flash_cute one CTA per tile": ours(one_cta)}
        if fa4_varlen is not None:
            fns["fa4"] = lambda: fa4_varlen(
                q,
                k,
                v,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=longest,
                max_seqlen_k=longest,
                causal=causal,
            )
        times = time_interleaved(fns, warmup=3, reps=reps)
        row = VarlenPrefillRow(
            name, config_label(table), total, {n: flops / ms / 1e9 for n, ms in times.items()}
        )
        print(
            f"{row.case} ({row.config}): "
            + " ".join(f"{n}={t:.0f}" for n, t in row.tflops.items()),
            flush=True,
        )
        rows.append(row)
    return rows


def varlen_prefill_table(rows: List[VarlenPrefillRow]) -> str:
    """Markdown table: TFLOP/s per implementation, and flash_cute's ratios."""
    lines = [
        "| case | config | tokens | flash_cute | one CTA per tile | fa4 | flash_cute / one CTA "
        "| flash_cute / fa4 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, one, fa4 = (
            r.tflops.get(n) for n in ("flash_cute", "flash_cute one CTA per tile", "fa4")
        )
        cell = lambda x: f"{x:.0f}" if x else ""  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else ""  # noqa: E731
        lines.append(
            f"| {r.case} | {r.config} | {r.tokens} | {cell(ours)} | {cell(one)} | {cell(fa4)} | "
            f"{ratio(ours, one)} | {ratio(ours, fa4)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prefill", help="FlashAttention-3 paper grid")
    pre.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    pre.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    pre.add_argument(
        "--hdim-v", type=int, default=None, help="V's head dim where it differs (MLA: 128)"
    )
    pre.add_argument("--nheads", type=int, default=None, help="default: 2048 // hdim")
    pre.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    pre.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    pre.add_argument("--reps", type=int, default=30)
    pre.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the grid this many times; each peer's time is its median over the passes",
    )
    pre.add_argument("--json", default=None, help="write the rows here")
    sw = sub.add_parser("sweep", help="rank a grid of configs on one problem")
    sw.add_argument("--hdim", type=int, default=128)
    sw.add_argument("--hdim-v", type=int, default=None, help="V's head dim where it differs")
    sw.add_argument("--nheads", type=int, default=None, help="default: 2048 // hdim")
    sw.add_argument("--causal", action="store_true")
    sw.add_argument(
        "--window", type=int, default=-1, help="a causal sliding window of this many keys back"
    )
    sw.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    sw.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    for flag, field_name, values, default, help_text in SWEEP_KNOBS:
        if isinstance(values, dict):
            sw.add_argument(
                flag, dest=field_name, choices=list(values), nargs="+", default=default,
                help=help_text,
            )  # fmt: skip
        else:
            sw.add_argument(flag, dest=field_name, type=values, nargs="+", default=default,
                            help=help_text)  # fmt: skip
    sw.add_argument("--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    sw.add_argument("--reps", type=int, default=20)
    sw.add_argument("--list", action="store_true", help="print the valid configs and exit (no GPU)")
    sw.add_argument("--json", default=None)
    sw.add_argument("--plot", default=None, help="PNG of TFLOP/s per config and sequence length")
    sub.add_parser("host", help="host time per eager call, and the disk cache's first-call times")
    dec = sub.add_parser("decode", help="KV-cache decoding, contiguous and paged")
    dec.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 32, 128])
    dec.add_argument("--seqlens", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    dec.add_argument("--pages", type=int, nargs="+", default=[0, 16, 64], help="0: contiguous")
    dec.add_argument("--hdim", type=int, default=128)
    dec.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    dec.add_argument("--no-graphs", action="store_true")
    dec.add_argument("--no-varlen", action="store_true")
    dec.add_argument("--json", default=None)
    var = sub.add_parser("varlen", help="varlen prefill of mixed-length batches")
    var.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    var.add_argument("--seed", type=int, default=0, help="seed of the random sequence lengths")
    var.add_argument("--reps", type=int, default=40)
    var.add_argument(
        "--list", action="store_true", help="print the cases' lengths and exit (no GPU)"
    )
    var.add_argument("--json", default=None)
    loc = sub.add_parser("local", help="windows, softcap and sinks (flash_cute.bench_local)")
    loc.add_argument(
        "--part",
        choices=["prefill", "softcap", "sinks", "decode"],
        nargs="+",
        default=["prefill", "softcap", "sinks", "decode"],
    )
    loc.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    loc.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    loc.add_argument("--json", default=None)
    mla = sub.add_parser("mla", help="absorbed-MLA decode (flash_cute.bench_mla)")
    mla.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    mla.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    mla.add_argument("--heads", type=int, nargs="+", default=[128])
    mla.add_argument("--seqlen-q", type=int, nargs="+", default=[1, 2])
    mla.add_argument("--json", default=None)
    bench_trace.add_parser(sub)
    plot = sub.add_parser("plot", help="draw a sweep's or a trace's JSON as a PNG (no GPU needed)")
    plot.add_argument("json_path")
    plot.add_argument("png_path")
    args = parser.parse_args(argv)
    if args.command == "plot":
        with open(args.json_path) as f:
            data = json.load(f)
        if "launches" in data:  # a trace's records (bench trace)
            bench_trace.replot(data, args.png_path)
            print(f"plot: {args.png_path}")
            return 0
        rows = [
            SweepRow(r["config"], r["label"], {int(s): t for s, t in r["tflops"].items()})
            for r in data["rows"]
        ]
        seqlens = sorted({s for r in rows for s in r.tflops})
        plot_sweep(rows, seqlens, data["title"], args.png_path)
        print(f"plot: {args.png_path}")
        return 0
    if args.command == "sweep":
        knobs = {}
        for _, field_name, values, _, _ in SWEEP_KNOBS:
            chosen = getattr(args, field_name)
            knobs[field_name] = [values[x] for x in chosen] if isinstance(values, dict) else chosen
        configs = sweep_configs(args.hdim, args.dtype, args.hdim_v, **knobs)
        print(f"{len(configs)} valid configs for hdim {args.hdim}", flush=True)
        if args.list:
            for cfg in configs:
                print(config_label(cfg))
            return 0
    if args.command == "varlen" and args.list:
        for case in VARLEN_PREFILL_CASES:
            print(f"{case[0]}: {varlen_case_lengths(case, args.seed)}")
        return 0
    if args.command == "trace":
        bench_trace.validate(parser, args)
    if args.command == "prefill" and args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    if args.command == "sweep":
        rows = run_sweep(
            args.hdim,
            args.causal,
            args.dtype,
            args.seqlens,
            configs,
            args.compile_workers,
            args.reps,
            args.window if args.causal else -1,
            args.hdim_v,
            args.nheads,
        )
        title = (
            f"flash_cute config sweep: hdim {args.hdim}"
            + (f"/{args.hdim_v}" if args.hdim_v else "")
            + ", "
            f"{'causal' if args.causal else 'non-causal'}, "
            + (f"window {args.window}, " if args.causal and args.window >= 0 else "")
            + f"{args.dtype}, {torch.cuda.get_device_name()}"
        )
        print(f"\n{title}\n")
        print(sweep_table(rows, args.seqlens))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"title": title, "rows": [asdict(r) for r in rows]}, f, indent=1)
        if args.plot:
            plot_sweep(rows, args.seqlens, title, args.plot)
            print(f"plot: {args.plot}")
        return 0
    if args.command == "host":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        for line in run_host():
            print(line)
        return 0
    if args.command == "local":
        from flash_cute import bench_local

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        results = {}
        if "prefill" in args.part:
            results["prefill"] = bench_local.run_prefill(args.seqlens)
        if "softcap" in args.part:
            results["softcap"] = bench_local.run_softcap([s for s in args.seqlens if s <= 16384])
        if "sinks" in args.part:
            results["sinks"] = bench_local.run_sinks()
        if "decode" in args.part:
            results["decode"] = bench_local.run_decode(args.batch)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    if args.command == "trace":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        return bench_trace.run(args)
    if args.command == "mla":
        from flash_cute import bench_mla

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        rows = bench_mla.run_decode(args.batch, args.seqlens, args.heads, args.seqlen_q)
        print("\n" + bench_mla.decode_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.command == "decode":
        copy_gbs = copy_bandwidth_gbs()
        print(f"device-to-device copy: {copy_gbs / 1e3:.2f} TB/s (read + write)", flush=True)
        rows = run_decode(
            args.batch, args.seqlens, args.pages, not args.no_graphs, 0.85, args.hdim, args.heads
        )
        print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
        print(decode_table(rows, copy_gbs))
        if not args.no_varlen:
            print()
            print(run_varlen_mixed())
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_gbs": copy_gbs, "rows": [asdict(r) for r in rows]}, f, indent=1)
        return 0
    if args.command == "varlen":
        rows = run_varlen_prefill(args.dtype, args.seed, args.reps)
        return _report(varlen_prefill_table(rows), rows, args.json)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = run_prefill(
        args.dtype,
        args.hdim,
        causals,
        args.seqlens,
        reps=args.reps,
        passes=args.passes,
        hdim_v=args.hdim_v,
        nheads=args.nheads,
    )
    return _report(prefill_table(rows), rows, args.json)


def _report(table: str, rows: list, json_path: Optional[str]) -> int:
    """Print the device line and a table; write the rows as JSON when asked."""
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
