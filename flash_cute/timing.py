"""How the benchmarks time calls: CUDA-event medians after warm-up, callables taking turns in
balanced orders, CUDA-graph replays, host time per call, and the device's copy bandwidth (the
memory-bound floor)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds per call of fn(), each call bracketed by CUDA events, calls issued
    back to back (as triton.testing.do_bench does): a call's time is its GPU time, or its host
    time when the host cannot keep the GPU busy."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_event_times(fn, reps))


def _event_times(fn: Callable[[], object], reps: int) -> List[float]:
    """Milliseconds of `reps` back-to-back calls, one pair of CUDA events around each."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def balanced_orders(n: int) -> List[List[int]]:
    """Orders of n callables in which each one follows every other one equally often (a
    Williams Latin square: n orders for even n, 2n for odd n). A burst of calls runs faster
    after a low-power kernel (the GPU has boost headroom), so a fixed order favours whoever
    follows the lightest peer."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return orders


def time_interleaved(
    fns: Dict[str, Callable[[], object]],
    warmup: int = 5,
    reps: int = 30,
    rounds: Optional[int] = None,
) -> Dict[str, float]:
    """time_cuda for several callables, taking turns in rounds so that drift of the GPU's
    clocks or temperature during the run falls on all of them alike, each round in another
    order of balanced_orders (by default one round per order, so within rounds each callable
    follows every other equally often); median of all reps."""
    names = list(fns)
    if not names:
        return {}
    orders = balanced_orders(len(names))
    rounds = rounds or len(orders)
    samples: Dict[str, list] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    per_round = max(1, reps // rounds)
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            samples[names[i]] += _event_times(fns[names[i]], per_round)
    return {name: statistics.median(times) for name, times in samples.items()}


def host_rounds_us(
    fns: Dict[str, Callable[[], object]], calls: int = 500, rounds: int = 15
) -> Dict[str, List[float]]:
    """Host microseconds per call of each fn() issued back to back (tiny problems: the GPU keeps
    up), one value per round of `calls` calls. The callables take turns round by round, each
    round starting with another one, so that load from other processes on a shared host CPU
    (which moves single rounds by tens of percent) falls on all of them alike, and round r of
    two callables can be compared (an A/B's median of the rounds' differences)."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    per_round: Dict[str, List[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (
            names[r % len(names) :] + names[: r % len(names)]
        ):  # each round starts elsewhere
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_round[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return per_round


def host_us_per_call(
    fns: Dict[str, Callable[[], object]], calls: int = 500, rounds: int = 15
) -> Dict[str, Tuple[float, float]]:
    """(median, best) over host_rounds_us' rounds for each callable; the best round is the
    cost with the least load from other processes."""
    return {
        name: (statistics.median(t), min(t))
        for name, t in host_rounds_us(fns, calls, rounds).items()
    }


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), 3, 20)
    return 2 * nbytes / ms / 1e6


def captured(fn: Callable[[], object], calls: int = 20) -> Callable[[], None]:
    """The replay of one CUDA graph of `calls` back-to-back calls of fn (run once before, and
    once on the capture stream)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def optional_fa3():
    """FlashAttention-3's own forward (the fa3-fwd wheel's `fa3_fwd_interface`), the benchmarks'
    peer, or None where it is not installed (said once, on stdout)."""
    try:
        import fa3_fwd_interface
    except ImportError as e:
        print("no FlashAttention-3:", e)
        return None
    return fa3_fwd_interface


def env_points(points: list, var: str = "POINTS") -> list:
    """The benchmark points an environment variable picks by index (POINTS=0,2), or all."""
    picked = os.environ.get(var)
    return [points[int(i)] for i in picked.split(",")] if picked else list(points)


def graph_step_rounds_us(
    replays: Dict[str, Callable[[], None]], calls: int, rounds: int, reps: int = 10
) -> Dict[str, float]:
    """Per name, microseconds per call of a graph replay holding `calls` calls (captured):
    the median over `rounds` rounds, in each of which the replays take turns in their order and
    each time is the median of reps replays (the decode benchmarks' method)."""
    samples: Dict[str, list] = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            samples[name].append(time_cuda(replay, 1, reps) * 1e3 / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def time_graph(fn: Callable[[], object], calls: int = 20, reps: int = 10) -> float:
    """Median milliseconds per call of `calls` back-to-back calls captured in one CUDA graph."""
    return time_cuda(captured(fn, calls), 2, reps) / calls
