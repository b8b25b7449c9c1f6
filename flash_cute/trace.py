"""Per-SM timelines of flash_cute's forward kernel: which SM ran each work tile, and when.

    with flash_cute.trace.record() as rec:
        flash_cute.flash_attn_func(q, k, v, causal=True)
    launch = rec.launches[0]
    launch.table()              # one row per tile: sm, coordinates, phase times (ns)
    launch.summary()            # SM idle fraction, tail, time per phase
    plot_timelines([launch], "timeline.png")

Calls made inside record() take the traced variant of their config (AttentionConfig.trace):
each work tile's record holds its SM, its coordinates (query tile, head, batch, split) and
%globaltimer stamps of its phases (kernels/trace_records.py). The records are read once the
block ends (the device is synchronized then). Untraced kernels carry none of this; a traced
call does not reuse the launch plans of untraced ones, nor they its.

Phases of a tile, on its SM: "load" from the producer's start to the MMA warps' start (the
producer runs ahead under a persistent CTA's previous tile), "wait K" until the first K block
has landed, "mainloop", "epilogue" (O and LSE stores, and a split's in-kernel merge).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from . import plan, runtime
from .config import AttentionConfig
from .kernels import trace_records as words

COLUMNS = {
    "sm": words.SM,
    "cta": words.CTA,
    "m_block": words.M_BLOCK,
    "head": words.HEAD,
    "batch": words.BATCH,
    "split": words.SPLIT,
    "load_start": words.LOAD_START,
    "start": words.START,
    "kv_ready": words.KV_READY,
    "mainloop_end": words.MAINLOOP_END,
    "end": words.END,
    "load_end": words.LOAD_END,
}
STAMPS = ("load_start", "start", "kv_ready", "mainloop_end", "end", "load_end")
# (name, from stamp, to stamp) of the phases drawn and summed, in a tile's order.
PHASES = (
    ("load", "load_start", "start"),
    ("wait K", "start", "kv_ready"),
    ("mainloop", "kv_ready", "mainloop_end"),
    ("epilogue", "mainloop_end", "end"),
)


@dataclass(frozen=True)
class TraceSummary:
    """A launch's timeline in numbers. span_ns: first stamp to last; busy: the SMs' time inside
    a tile (a tile from its first stamp to its last; overlapping tiles of one SM count once);
    idle_fraction: 1 - busy / (num_sms x span); tail_ns: from the first SM's last tile ending
    to the launch's last; phase_ns: each phase summed over tiles."""

    tiles: int
    num_sms: int
    sms_used: int
    span_ns: int
    busy_ns: int
    idle_fraction: float
    tail_ns: int
    phase_ns: Dict[str, int]

    def text(self) -> str:
        phases = ", ".join(f"{name} {ns / 1e3:.1f} us" for name, ns in self.phase_ns.items())
        return (
            f"{self.tiles} tiles on {self.sms_used} of {self.num_sms} SMs, span "
            f"{self.span_ns / 1e3:.1f} us, SM idle {100 * self.idle_fraction:.1f}%, tail "
            f"{self.tail_ns / 1e3:.1f} us; summed over tiles: {phases}"
        )


@dataclass(frozen=True)
class LaunchTrace:
    """One traced launch: `label` (its variant), the number of SMs of its device, and its
    records (tiles, RECORD_WORDS) int64 with the empty slots dropped and the stamps made
    relative to the launch's first one (ns); `config`: the variant's (not kept in JSON)."""

    label: str
    num_sms: int
    records: np.ndarray
    config: Optional[AttentionConfig] = None

    @staticmethod
    def decode(
        label: str, num_sms: int, raw: np.ndarray, config: Optional[AttentionConfig] = None
    ) -> "LaunchTrace":
        """From a launch's raw records (slots, RECORD_WORDS): the slots that held a tile, with
        stamps relative to the earliest (stamps a kernel did not write stay 0 there and
        become the tile's START)."""
        raw = np.asarray(raw, dtype=np.int64)
        rows = raw[raw[:, words.KIND] != 0].copy()
        stamp_words = [COLUMNS[name] for name in STAMPS]
        if len(rows):
            stamps = rows[:, stamp_words]
            stamps = np.where(stamps == 0, rows[:, [words.START]], stamps)
            rows[:, stamp_words] = stamps - stamps.min()
        return LaunchTrace(label, num_sms, rows, config)

    def table(self) -> Dict[str, np.ndarray]:
        """One array per column (COLUMNS' names), one entry per tile; pandas takes it as is
        (pandas.DataFrame(launch.table()))."""
        return {name: self.records[:, word] for name, word in COLUMNS.items()}

    def tile_intervals(self) -> np.ndarray:
        """(tiles, 2): each tile's first and last stamp."""
        stamps = self.records[:, [COLUMNS[name] for name in STAMPS]]
        return np.stack([stamps.min(axis=1), stamps.max(axis=1)], axis=1)

    def summary(self) -> TraceSummary:
        table, intervals = self.table(), self.tile_intervals()
        if not len(intervals):
            return TraceSummary(0, self.num_sms, 0, 0, 0, 1.0, 0, {n: 0 for n, _, _ in PHASES})
        span = int(intervals[:, 1].max() - intervals[:, 0].min())
        busy, last_ends = 0, []
        for sm in np.unique(table["sm"]):
            mine = intervals[table["sm"] == sm]
            busy += _union_length(mine)
            last_ends.append(mine[:, 1].max())
        phase_ns = {name: int(np.clip(table[b] - table[a], 0, None).sum()) for name, a, b in PHASES}
        return TraceSummary(
            tiles=len(intervals),
            num_sms=self.num_sms,
            sms_used=len(last_ends),
            span_ns=span,
            busy_ns=int(busy),
            idle_fraction=1.0 - busy / (self.num_sms * span) if span else 0.0,
            tail_ns=int(max(last_ends) - min(last_ends)),
            phase_ns=phase_ns,
        )

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "num_sms": self.num_sms,
            "columns": list(COLUMNS),
            "tiles": [[int(row[w]) for w in COLUMNS.values()] for row in self.records],
        }

    @staticmethod
    def from_json(data: dict) -> "LaunchTrace":
        rows = np.zeros((len(data["tiles"]), words.RECORD_WORDS), dtype=np.int64)
        rows[:, words.KIND] = words.FORWARD_TILE
        for j, name in enumerate(data["columns"]):
            rows[:, COLUMNS[name]] = [tile[j] for tile in data["tiles"]]
        return LaunchTrace(data["label"], data["num_sms"], rows)


def _union_length(intervals: np.ndarray) -> int:
    """Total length covered by [start, end] intervals."""
    total, reach = 0, None
    for start, end in sorted(map(tuple, intervals)):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return int(total)


@dataclass
class Recording:
    """The launches traced inside one record() block, available once it has ended."""

    launches: List[LaunchTrace] = field(default_factory=list)


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Trace every flash_cute forward launch made inside the block (see the module doc), in
    every thread of the process: the switch is process-wide."""
    import torch

    caches = runtime.PlanCache.every()  # (every entry point's, FlashAttention-3's and the op's)
    saved = [dict(cache) for cache in caches]
    for cache in caches:
        cache.clear()
    runtime.TRACED_LAUNCHES.clear()
    recording = Recording()
    plan.trace_calls(True)
    try:
        yield recording
    finally:
        plan.trace_calls(False)
        for cache, plans in zip(caches, saved):
            cache.clear()
            cache.update(plans)
        launches = list(runtime.TRACED_LAUNCHES)
        runtime.TRACED_LAUNCHES.clear()
        if launches:
            torch.cuda.synchronize(launches[0].records.device)
        for launch in launches:
            props = torch.cuda.get_device_properties(launch.records.device)
            recording.launches.append(
                LaunchTrace.decode(
                    launch.label,
                    props.multi_processor_count,
                    launch.records.cpu().numpy(),
                    launch.config,
                )
            )


PHASE_COLORS = {
    "load": "#c7c7c7",
    "wait K": "#ff7f0e",
    "mainloop": "#1f77b4",
    "epilogue": "#2ca02c",
}
# Every other tile of an SM's lane takes these, so that back-to-back tiles stay apart.
PHASE_COLORS_ALT = {
    "load": "#a0a0a0",
    "wait K": "#d62728",
    "mainloop": "#6baed6",
    "epilogue": "#98df8a",
}


def plot_timelines(
    launches: Sequence[LaunchTrace],
    path: str,
    titles: Optional[Sequence[str]] = None,
    same_time_axis: bool = True,
) -> None:
    """Draw each launch's timeline (one above the other; same_time_axis: on one time axis, as
    when comparing two runs of a problem) to an image file:
    one row per SM, one bar per tile coloured by phase (every other tile of a lane in other
    shades; the loads as a thin strip on top: they may run under the previous tile), idle time
    left blank. Tiles whose MMA phases overlap on one
    SM (several CTAs per SM) take lanes of the SM's row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(
        len(launches), 1, figsize=(12, 3.2 * len(launches)), sharex=same_time_axis, squeeze=False
    )
    spans = [max(float(launch.table()["end"].max(initial=0)), 1.0) / 1e3 for launch in launches]
    for i, (ax, launch) in enumerate(zip(axes[:, 0], launches)):
        _draw(ax, launch)
        span = max(spans) if same_time_axis else spans[i]
        ax.set_xlim(-0.01 * span, 1.01 * span)
        title = titles[i] if titles else launch.label
        ax.set_title(f"{title}\n{launch.summary().text()}", fontsize=8, loc="left")
        ax.set_ylabel("SM")
    for ax in axes[-1:, 0] if same_time_axis else axes[:, 0]:
        ax.set_xlabel("time since the launch's first stamp (us)")
    handles = [Patch(color=c, label=name) for name, c in PHASE_COLORS.items()]
    axes[0, 0].legend(handles=handles, loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _draw(ax, launch: LaunchTrace) -> None:
    """One launch's bars on ax (collections: the caller sets the time axis's limits)."""
    table = launch.table()
    n = len(table["sm"])
    y, height, shade = np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool)
    for sm in np.unique(table["sm"]):
        index = np.flatnonzero(table["sm"] == sm)
        index = index[np.argsort(table["start"][index], kind="stable")]
        # Lanes by the MMA warps' interval (a tile's loads may run under the previous tile):
        # each tile takes the first lane free at its start.
        lane_ends: List[int] = []
        lanes = []
        for t in index:
            start = table["start"][t]
            lane = next((j for j, e in enumerate(lane_ends) if e <= start), None)
            if lane is None:
                lane_ends.append(0)
                lane = len(lane_ends) - 1
            lane_ends[lane] = table["end"][t]
            lanes.append(lane)
        lane_height = 0.9 / max(len(lane_ends), 1)
        y[index] = sm - 0.45 + np.asarray(lanes) * lane_height
        height[index] = lane_height
        shade[index] = np.arange(len(index)) % 2 == 1
    # One collection of rectangles per phase and shade (a trace may hold tens of thousands of
    # tiles; an artist per bar would take minutes).
    from matplotlib.collections import PolyCollection

    for name, a, b in (*PHASES[1:], PHASES[0]):  # the loads last: over the previous tile
        x0, x1 = table[a] / 1e3, table[b] / 1e3
        # The loads as a thin strip along the lane's top edge, over what runs there.
        y1 = y + height * (0.25 if name == "load" else 0.95)
        for alt, colors in ((False, PHASE_COLORS), (True, PHASE_COLORS_ALT)):
            keep = (x1 > x0) & (shade == alt)
            if keep.any():
                corners = [(x0, y), (x1, y), (x1, y1), (x0, y1)]
                verts = np.stack([np.stack([cx[keep], cy[keep]], -1) for cx, cy in corners], 1)
                ax.add_collection(PolyCollection(verts, facecolors=colors[name], linewidths=0))
    ax.set_ylim(-1, launch.num_sms)
    ax.invert_yaxis()
