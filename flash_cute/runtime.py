"""The launch runtime: replayable launch plans, the buffers kept per stream, the combine launch.

A call's first pass (flash_cute.interface) checks its arguments, asks the plan step
(flash_cute.plan) which variant to launch, and builds a `LaunchPlan`: the compiled kernel,
the plan's constants and the output shapes. It launches through that plan, and keeps it
under a key of the call's metadata (`PlanCache`): a later call with the same key replays the
plan without the checks.

Launches that need zeroed counters (the dynamic scheduler's tile counter, a split launch's
per-tile arrival counters) or split scratch (fp32 partial O and LSE) take them from
`BUFFERS`, which keeps one of each per (device, stream) between launches: each launch leaves
its counters zero and consumes its scratch, so launches that run one after another on a
stream share them. A CUDA-graph capture gets its own. `empty_cache()` drops them.

Streams are told apart by their raw handle: after destroying an external stream whose handle
may be reused, call empty_cache().
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from . import checks
from .call import KERNEL_CALL_FIELDS
from .compile_cache import (
    DESCALES,
    SHORT,
    CombineKernelKey,
    get_combine_kernel,
    get_forward_kernel,
    raw_function,
    signature,
)
from .config import AttentionConfig
from .kernels.flash_combine import FlashAttentionCombine
from .kernels.trace_records import RECORD_WORDS
from .plan import ForwardPlan, tracing

# ----------------------------------------------------------------------------------------
# Device and stream queries (torch's internals where they exist: they skip several us of
# Python wrappers on every call)
# ----------------------------------------------------------------------------------------

try:
    current_device = torch._C._cuda_getDevice  # torch.cuda.current_device without its wrappers
except AttributeError:  # pragma: no cover - other torch builds
    current_device = torch.cuda.current_device

try:
    current_raw_stream = torch._C._cuda_getCurrentRawStream
    stream_capturing = torch._C._cuda_isCurrentStreamCapturing
except AttributeError:  # pragma: no cover - other torch builds

    def current_raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream

    stream_capturing = torch.cuda.is_current_stream_capturing


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def stream_key(device_index: int) -> Optional[tuple]:
    """(device index, current raw stream): the key of the buffers kept per stream between
    launches; None while a CUDA graph is being captured (a capture makes its own buffers, so
    no graph holds a cached one)."""
    raw = current_raw_stream(device_index)
    # The legacy default stream (0) cannot be captured: no capture query for eager calls on it.
    if raw and stream_capturing():
        return None
    return device_index, raw


class on_device:
    """torch.cuda.device(d) only when d is not already current (it costs a few us)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ctx = None

    def __enter__(self):
        index = self.device.index
        if index is not None and index != current_device():
            self.ctx = torch.cuda.device(self.device)
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# ----------------------------------------------------------------------------------------
# Buffers kept per (device, stream)
# ----------------------------------------------------------------------------------------

# Split scratch of up to this many floats (16 MB: decode steps need well under 1 MB per 8
# sequences) stays allocated per stream between calls; larger scratch (split prefills) is
# allocated per call, where the host cost is noise.
SCRATCH_MAX_FLOATS = 4 << 20


@dataclass(frozen=True)
class SplitScratchLayout:
    """A split launch's fp32 partial O (num_splits, *out_shape) and LSE
    (num_splits, *lse_shape), contiguous and sharing one allocation (O first: its size is a
    multiple of headdim >= 64 floats, so the LSE starts 16-byte aligned), as the kernel builds
    them from one address (FlashAttentionForwardSm90.__call__)."""

    o_shape: tuple
    o_stride: tuple
    lse_shape: tuple
    lse_stride: tuple
    lse_offset: int
    numel: int

    def __post_init__(self):  # hashed once: a split launch looks its scratch views up by layout
        key = (self.o_shape, self.o_stride, self.lse_shape, self.lse_stride)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def for_shapes(num_splits: int, out_shape: tuple, lse_shape: tuple) -> SplitScratchLayout:
        o_shape, lse_shape = (num_splits, *out_shape), (num_splits, *lse_shape)
        offset = math.prod(o_shape)
        return SplitScratchLayout(
            o_shape,
            _contiguous_strides(o_shape),
            lse_shape,
            _contiguous_strides(lse_shape),
            offset,
            offset + math.prod(lse_shape),
        )

    def allocate(self, device):
        return self.views_of(torch.empty(self.numel, dtype=torch.float32, device=device))

    def views_of(self, buffer):
        """(out_partial, lse_partial) at the start of an fp32 buffer of at least numel floats."""
        return (
            buffer.as_strided(self.o_shape, self.o_stride),
            buffer.as_strided(self.lse_shape, self.lse_stride, self.lse_offset),
        )


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _grown_size(current: Optional[torch.Tensor], needed: int, cap: Optional[int] = None) -> int:
    """Size of a per-stream buffer replacing `current` (None: none yet) that is too small for
    `needed` elements: doubled, so a run of growing calls reallocates a few times only (at most
    `cap`, unless `needed` is larger). The replaced buffer goes back to torch's caching
    allocator, which reuses it only in stream order, after the launches that used it."""
    if current is None:
        return needed
    doubled = 2 * current.numel()
    return max(needed, doubled if cap is None else min(doubled, cap))


class StreamBuffers:
    """Zeroed int32 counters and split scratch, one of each per (device, stream).

    counters: {stream key: int32 tensor}; scratch: {stream key: (fp32 tensor, {layout:
    views})}. `version` changes whenever a buffer is replaced or dropped: launch plans memo
    the addresses of the buffers they last used (LaunchPlan.launch) and look again when it
    moved, so every path that replaces or drops a buffer must bump it.
    """

    def __init__(self):
        self.counters: dict = {}
        self.scratch: dict = {}
        self.version = 0
        # Held while a buffer is looked up, grown or dropped: threads launching on one stream
        # (or clearing) must not race on the caches or the version. Replays that reuse their
        # memo (LaunchPlan.launch) only read the version.
        self.lock = threading.Lock()

    def zeroed_counters(self, device, count: int, stream: Optional[tuple]) -> torch.Tensor:
        """At least `count` zeroed int32 counters for a launch on `stream` (stream_key; None
        during a capture, which takes counters of its own from GRAPH_COUNTERS, so graphs
        replayed on different streams never share them). Grown when a launch needs more."""
        if stream is None:
            return GRAPH_COUNTERS.take(device, count)
        counters = self.counters.get(stream)
        if counters is None or counters.numel() < count:
            size = _grown_size(counters, count)
            counters = self.counters[stream] = torch.zeros(size, dtype=torch.int32, device=device)
            self.version += 1
        return counters

    def split_scratch(self, device, layout: SplitScratchLayout, stream: Optional[tuple]):
        """A split launch's (out_partial, lse_partial). The kernel merges them before it ends,
        so launches on one stream share one buffer, with its views cached per layout
        (torch.empty and two as_strided cost several us per call). A capture and layouts
        above SCRATCH_MAX_FLOATS allocate their own."""
        key = None if layout.numel > SCRATCH_MAX_FLOATS else stream
        if key is None:
            return layout.allocate(device)
        scratch = self.scratch.get(key)
        if scratch is None or scratch[0].numel() < layout.numel:
            current = None if scratch is None else scratch[0]
            size = _grown_size(current, layout.numel, SCRATCH_MAX_FLOATS)
            buffer = torch.empty(size, dtype=torch.float32, device=device)
            scratch = self.scratch[key] = (buffer, {})
            self.version += 1
        views = scratch[1].get(layout)
        if views is None:
            if len(scratch[1]) >= 64:
                scratch[1].clear()
            views = scratch[1][layout] = layout.views_of(scratch[0])
        return views

    def for_launch(self, device, stream, num_counters: int, layout: Optional[SplitScratchLayout]):
        """(tensors, addresses) of a launch on `stream`: the counters and the scratch (None
        where the launch needs none), and their addresses as the kernel takes them
        (partials, counters; None where unused). The caller keeps the tensors alive through the
        launch (the caches do between calls)."""
        with self.lock:
            counters = self.zeroed_counters(device, num_counters, stream) if num_counters else None
            scratch = self.split_scratch(device, layout, stream) if layout is not None else None
        addresses = (
            None if scratch is None else scratch[0].data_ptr(),
            None if counters is None else counters.data_ptr(),
        )
        return (counters, scratch), addresses

    def clear(self):
        with self.lock:
            self.counters.clear()
            self.scratch.clear()
            self.version += 1


BUFFERS = StreamBuffers()


class GraphCounters:
    """Zeroed int32 counters for launches captured in CUDA graphs, without a zeroing kernel
    in the graph: each captured launch takes a slice of its own from a per-device pool that
    was zeroed before the capture, and the kernel leaves its counters zero, so every replay
    finds them zero. Slices are never handed out twice nor freed (a graph may be replayed at
    any time); a pool is refilled by eager launches (`refill`, when `low`), since memory
    cannot be zeroed during a capture without capturing the zeroing. A capture that finds too
    little takes counters zeroed by a captured fill (one more kernel per replay) and warns."""

    CHUNK = 1 << 20  # counters per refill (4 MB): some hundred captured split launches

    def __init__(self):
        self.pools: dict = {}  # device index: [int32 tensor, next free offset]
        self.retired: list = []  # replaced pools: captured graphs still hold their slices
        self.low = True  # some device's pool may be missing or short: eager launches refill
        self.warned = False
        # Slices are handed out under it: two threads capturing at once never share one.
        self.lock = threading.Lock()

    def take(self, device, count: int) -> torch.Tensor:
        with self.lock:
            return self._take(device, count)

    def _take(self, device, count: int) -> torch.Tensor:
        pool = self.pools.get(device.index)
        if pool is not None and pool[0].numel() - pool[1] >= count:
            start = pool[1]
            pool[1] += count
            if pool[0].numel() - pool[1] < self.CHUNK // 2:
                self.low = True
            return pool[0][start : start + count]
        if not self.warned:
            self.warned = True
            warnings.warn(
                "flash_cute: a launch captured in a CUDA graph zeroes its counters with a "
                "captured fill (one more kernel per replay): make one eager call on this "
                "device before capturing to set aside pre-zeroed counters for captures",
                stacklevel=4,
            )
        self.low = True
        return torch.zeros(count, dtype=torch.int32, device=device)

    def refill(self, device) -> None:
        """Outside captures: give `device` a pool with at least CHUNK / 2 free counters."""
        with self.lock:
            self._refill(device)

    def _refill(self, device) -> None:
        pool = self.pools.get(device.index)
        if pool is None or pool[0].numel() - pool[1] < self.CHUNK // 2:
            # (Zeroed on the current stream, with no host sync: torch.cuda.graph synchronizes
            # the device before it captures.)
            fresh = torch.zeros(self.CHUNK, dtype=torch.int32, device=device)
            if pool is not None:
                self.retired.append(pool[0])
            self.pools[device.index] = [fresh, 0]
        self.low = any(t.numel() - used < self.CHUNK // 2 for t, used in self.pools.values())


GRAPH_COUNTERS = GraphCounters()


# ----------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------


class PlanCache(dict):
    """Launch plans of one entry point by call key, bounded (cleared when full). Every cache
    made is reachable from PlanCache.every() (empty_cache, flash_cute.trace.record)."""

    MAX_PLANS = 4096
    _every = weakref.WeakValueDictionary()

    def __init__(self):
        super().__init__()
        PlanCache._every[id(self)] = self

    @staticmethod
    def every() -> list:
        return list(PlanCache._every.values())

    def remember(self, key, plan) -> None:
        if key is None or plan is None:
            return
        if len(self) >= self.MAX_PLANS:
            self.clear()
        self[key] = plan


@dataclass(frozen=True)
class TracedLaunch:
    """A traced kernel's launch: what ran (label; a forward launch's config) and its (tiles,
    RECORD_WORDS) int64 records (kernels/trace_records.py), filled once the launch has run."""

    label: str
    config: Optional[AttentionConfig]
    records: torch.Tensor


# The latest traced launches, oldest first (flash_cute.trace.record takes those of its block).
TRACED_LAUNCHES: deque = deque(maxlen=64)


def traced_records(label: str, config, slots: int, device) -> torch.Tensor:
    """Zeroed (slots, RECORD_WORDS) int64 records for one traced launch, listed in
    TRACED_LAUNCHES (read once the launch has run); a traced launch under CUDA-graph capture
    raises, since nothing would read its records after a replay."""
    if stream_capturing():
        raise RuntimeError(
            "a traced call (AttentionConfig.trace, flash_cute.trace.record) cannot be captured "
            "in a CUDA graph: its records are read after the call; trace an eager call"
        )
    records = torch.zeros(slots, RECORD_WORDS, dtype=torch.int64, device=device)
    TRACED_LAUNCHES.append(TracedLaunch(label, config, records))
    return records


# The positions of q_descale, k_descale and v_descale among the kernel's call arguments.
_FIRST_DESCALE = KERNEL_CALL_FIELDS.index(DESCALES[0])
_END_DESCALES = _FIRST_DESCALE + len(DESCALES)
assert KERNEL_CALL_FIELDS[_FIRST_DESCALE:_END_DESCALES] == DESCALES  # (replaced together)

FUNC_PLANS = PlanCache()
KVCACHE_PLANS = PlanCache()
VARLEN_PLANS = PlanCache()


class LaunchPlan:
    """Everything a call derived from its arguments' metadata: the compiled kernel, its
    signature, the plan's constants, the output shapes. A later call whose key matches makes
    the same choices and launches without the checks: the key holds the metadata those
    choices depend on (q's shape, dtype, device and contiguity, k's shape, flags, the int32
    tensors' shapes and dtypes, and with out the strides that size the overlap check); the
    compiled function itself checks the rest of the tensors (dtypes, one device, ranks,
    head_dim, strides divisible by 8 elements on dims longer than 1, 16-byte alignment, v's
    shape against k's, out's against q's) and raises before launching, and the call then takes
    the full checks (which name the argument, or copy what TMA cannot read). What neither
    covers is checked here: the current device, and out not overlapping the inputs."""

    __slots__ = (
        "kernel",
        "short",
        "device",
        "device_index",
        "dtype",
        "out_shape",
        "lse_shape",
        "scale_log2",
        "max_ctas",
        "num_splits",
        "num_counters",
        "scratch",
        "unit_descale",
        "descales_taken",
        "extents",
        "out_like_q",
        "int_capacity",
        "buffers",
        "v_in_k",
        "merge",
        "trace",
        "variant",
    )

    def __init__(
        self,
        plan: ForwardPlan,
        kernel,
        device: torch.device,
        dtype: torch.dtype,
        out_shape: tuple,
        lse_shape: tuple,
        scale_log2: float,
        extents: tuple = (0, 0, 0, 0),
        out_like_q: bool = False,
    ):
        """kernel: the compiled function of plan.variant, called positionally in its
        signature's order (compile_cache.SHORT or FULL). lse_shape: the LSE's shape, returned
        when the variant writes it (split scratch holds one per split either way)."""
        self.kernel = kernel
        self.variant = plan.variant
        self.short = signature(plan.variant) is SHORT
        self.device, self.device_index, self.dtype = device, device.index, dtype
        self.out_shape = out_shape
        self.lse_shape = lse_shape if plan.variant.writes_lse else None  # returned LSE
        self.scale_log2, self.max_ctas, self.num_splits = (
            scale_log2,
            plan.max_ctas,
            plan.num_splits,
        )
        self.num_counters = plan.num_counters
        # Traced variants: the records per launch, else None.
        self.trace = plan.trace_slots or None
        # Replays check that v still aliases k (qv's V is a tensor of its own).
        self.v_in_k = plan.variant.v_in_k and not plan.variant.qv
        # FP8 K/V (and q with FP8 math): the descale a call leaves out is 1 (a one-element
        # tensor read at every (batch, kv head) through zero strides).
        self.unit_descale = None
        self.descales_taken = plan.variant.descales_taken
        if any(self.descales_taken):
            self.unit_descale = torch.ones(1, dtype=torch.float32, device=device).as_strided(
                (1, 1), (0, 0)
            )
        self.scratch = None  # a split launch's scratch layout
        if plan.variant.split:
            self.scratch = SplitScratchLayout.for_shapes(plan.num_splits, out_shape, lse_shape)
        # combine_launch: the compiled combine kernel that merges the partials after the launch.
        self.merge = None
        if plan.variant.combine_launch:
            key = CombineKernelKey(
                checks.ALL_DTYPE_NAMES[dtype],
                plan.variant.head_dim_v,
                self.lse_shape is not None,
                plan.variant.config.trace,
            )
            self.merge = get_combine_kernel(key)
        self.extents = extents  # bytes spanned by q, k, v, out
        self.out_like_q = out_like_q  # q contiguous: empty_like(q) is out (and cheaper to call)
        # flash_attn_with_kvcache with an int cache_seqlens: the cache's capacity (replays pass
        # their length to the kernel as a scalar); None otherwise.
        self.int_capacity = None
        # The per-stream buffers' addresses of the last launch: (raw stream, BUFFERS.version,
        # (partials, counters)), reused while the stream and version match (two cache lookups
        # fewer per split call; the caches keep the buffers alive, and replacing or dropping
        # one bumps the version); None before the first launch.
        self.buffers = None

    @staticmethod
    def build(plan: ForwardPlan, q, k, v, out, lse_shape, scale_log2) -> LaunchPlan:
        """The launch plan of a call whose plan step gave `plan`, compiling its kernel if need
        be; q, k, v, out as the call passes them (their metadata sizes the replays)."""
        kernel = raw_function(get_forward_kernel(plan.variant))
        return LaunchPlan(
            plan,
            kernel,
            q.device,
            out.dtype,
            tuple(out.shape),
            lse_shape,
            scale_log2,
            extents=tuple(checks.byte_extent(t) for t in (q, k, v, out)),
            out_like_q=q.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype,
        )

    def usable(self, q, k, v, out) -> bool:
        """Whether a call whose key matched may replay this plan (see the class docstring)."""
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (qp | kp | vp) & 15 or current_device() != self.device_index:
            return False
        if out is None:
            return True
        op = out.data_ptr()
        if op & 15:
            return False
        # Byte extents come from the metadata the plan was made for.
        oe = self.extents[3]
        return all(op >= p + e or p >= op + oe for p, e in zip((qp, kp, vp), self.extents))

    def launch(self, q, k, v, out, call_args: tuple):
        """Launch on the current stream; out is allocated when None. call_args: the kernel's
        call arguments (flash_cute.call.KERNEL_CALL_FIELDS, its signature's order from
        cu_seqlens_q to kv_length). Returns out, or (out, lse) when the plan returns the LSE."""
        if out is None:
            if self.out_like_q:
                out = torch.empty_like(q)
            else:
                out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.short:  # the common call
            self.kernel(q, k, v, out, call_args[-1], self.scale_log2, self.max_ctas)
            return out
        if self.v_in_k and (v.data_ptr() != k.data_ptr() or v.stride() != k.stride()):
            # (A call whose key matched, with a v of its own: the checks plan it anew.)
            raise ValueError("this launch plan reads v from k's columns; v is not a view of k")
        lse = None
        if self.lse_shape is not None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        partials = counters = merge_views = None
        held = None  # a capture's or a large scratch's tensors, alive through the launch
        if self.num_counters or self.scratch is not None:
            # stream_key inlined (one query for every per-stream buffer); the memo holds the
            # raw stream, the plan's device being fixed.
            raw = current_raw_stream(self.device_index)
            capturing = raw and stream_capturing()  # (the legacy default stream 0 cannot be)
            if GRAPH_COUNTERS.low and self.num_counters and not capturing:
                GRAPH_COUNTERS.refill(self.device)
            memo = self.buffers
            if not capturing and memo is not None and memo[0] == raw and memo[1] == BUFFERS.version:
                partials, counters = memo[2]
            else:
                stream = None if capturing else (self.device_index, raw)
                held, (partials, counters) = BUFFERS.for_launch(
                    self.device, stream, self.num_counters, self.scratch
                )
                if self.merge is not None:
                    merge_views = combine_views(*held[1])
                # (A capture's buffers are its own; large split scratch is allocated per call; a
                # combine launch takes views of them, so it looks them up every call.)
                if (
                    stream is not None
                    and self.merge is None
                    and (self.scratch is None or self.scratch.numel <= SCRATCH_MAX_FLOATS)
                ):
                    self.buffers = (raw, BUFFERS.version, (partials, counters))
        if self.unit_descale is not None:
            # FP8 K/V: a descale the call leaves out is 1 (q's only where the kernel takes it:
            # FP8 math).
            qd, kd, vd = call_args[_FIRST_DESCALE:_END_DESCALES]
            # (Identity tests: `None in (tensors)` would compare tensors with None.)
            if qd is None or kd is None or vd is None:
                unit = self.unit_descale
                qd, kd, vd = (
                    unit if d is None and taken else d
                    for d, taken in zip((qd, kd, vd), self.descales_taken)
                )
                call_args = (*call_args[:_FIRST_DESCALE], qd, kd, vd, *call_args[_END_DESCALES:])
        records = None
        if self.trace is not None:
            variant = self.variant
            records = traced_records(variant.describe(), variant.config, self.trace, q.device)
        self.kernel(
            q, k, v, out, lse, *call_args, partials, counters, self.scale_log2, self.max_ctas,
            self.num_splits, records,
        )  # fmt: skip
        if self.merge is not None:
            run_combine(self.merge, self.trace is not None, *merge_views, *combine_views(out, lse))
        return out if lse is None else (out, lse)


def empty_cache() -> None:
    """Drop the buffers flash_cute keeps between calls on each (device, stream): split-KV
    partials scratch (up to 16 MB each) and the zeroed tile counters. Their memory goes back to
    torch's caching allocator (torch.cuda.empty_cache() then returns it to the driver); launches
    already queued are unaffected, since the allocator reuses a block only in stream order.
    CUDA graphs keep the buffers they captured."""
    BUFFERS.clear()
    for plans in PlanCache.every():  # (their memos hold the buffers too)
        for plan in plans.values():
            plan.buffers = None


# ----------------------------------------------------------------------------------------
# The combine kernel
# ----------------------------------------------------------------------------------------


def combine_views(out, lse):
    """The combine kernel's views of a forward launch's out (..., B, S, H, D) and LSE
    (..., B, H, S) (split partials: a leading split mode): out as it is and the LSE as
    (..., B, S, H) (None stays None)."""
    return out, None if lse is None else lse.transpose(-1, -2)


def run_combine(kernel, traced: bool, out_partial, lse_partial, out, lse) -> None:
    """Launch a compiled combine kernel; traced: with a record per CTA (TRACED_LAUNCHES)."""
    if not traced:
        kernel(out_partial, lse_partial, out, lse, None)
        return
    batch, seqlen, nheads, head_dim = out.shape
    gx, gy, _ = FlashAttentionCombine.grid(batch, seqlen, nheads, head_dim)
    label = f"combine d{head_dim} {checks.ALL_DTYPE_NAMES[out.dtype]} splits {len(out_partial)}"
    kernel(out_partial, lse_partial, out, lse, traced_records(label, None, gx * gy, out.device))


def combine(out_partial, lse_partial, out, lse) -> None:
    """Merge partials by their LSEs: out_partial (K, B, S, H, D) or (K, T, H, D) and
    matching lse views -> out, lse (lse may be None)."""
    if out_partial.dim() == 4:
        out_partial, lse_partial = out_partial.unsqueeze(1), lse_partial.unsqueeze(1)
        out = out.unsqueeze(0)
        lse = lse.unsqueeze(0) if lse is not None else None
    if not checks.aligned_16b(out_partial):
        if out_partial.data_ptr() % 16 == 0:
            out_partial = out_partial.contiguous()
        else:
            out_partial = out_partial.clone(memory_format=torch.contiguous_format)
    out_kernel = out
    if not checks.aligned_16b(out):
        out_kernel = torch.empty_like(out, memory_format=torch.contiguous_format)
    key = CombineKernelKey(
        out_dtype=checks.ALL_DTYPE_NAMES[out.dtype],
        head_dim=out.shape[-1],
        writes_lse=lse is not None,
        trace=tracing(),
    )
    with on_device(out.device):
        run_combine(get_combine_kernel(key), key.trace, out_partial, lse_partial, out_kernel, lse)
        if out_kernel.data_ptr() != out.data_ptr():
            out.copy_(out_kernel)
