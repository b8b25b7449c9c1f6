"""Trace records on the CPU: decoding a synthetic buffer, the summary's arithmetic, the
picture, the JSON round trip, and the plan step's traced variants."""

import json

import numpy as np
import pytest
from flash_cute.kernels import trace_records as words

from flash_cute import plan as plans
from flash_cute import trace
from flash_cute.config import AttentionConfig
from flash_cute.plan import Problem, plan_forward


def synthetic(tiles):
    """Raw records (slots, RECORD_WORDS) from (slot, sm, (load_start, start, kv_ready,
    mainloop_end, end, load_end)) tuples, stamps offset by a large global time; other slots
    empty."""
    raw = np.zeros((max(t[0] for t in tiles) + 3, words.RECORD_WORDS), dtype=np.int64)
    base = 1_700_000_000_000_000_000
    for slot, sm, stamps in tiles:
        raw[slot, words.KIND] = words.FORWARD_TILE
        raw[slot, words.SM] = sm
        raw[slot, words.M_BLOCK] = slot
        for name, value in zip(trace.STAMPS, stamps):
            raw[slot, trace.COLUMNS[name]] = base + value
    return raw


# Two SMs of four: SM 0 runs two tiles back to back (0-100, 100-300), SM 1 one (50-150).
TILES = [
    (0, 0, (0, 10, 20, 80, 100, 90)),
    (2, 0, (100, 110, 150, 250, 300, 240)),
    (5, 1, (50, 60, 70, 120, 150, 100)),
]


def test_decode_drops_empty_slots_and_makes_stamps_relative():
    launch = trace.LaunchTrace.decode("x", 4, synthetic(TILES))
    table = launch.table()
    assert sorted(table["m_block"].tolist()) == [0, 2, 5]
    assert table["load_start"].min() == 0
    assert table["end"].max() == 300
    row = table["m_block"].tolist().index(5)
    assert table["kv_ready"][row] == 70 and table["sm"][row] == 1


def test_summary_counts_busy_time_per_sm():
    s = trace.LaunchTrace.decode("x", 4, synthetic(TILES)).summary()
    assert (s.tiles, s.sms_used, s.span_ns) == (3, 2, 300)
    assert s.busy_ns == 300 + 100  # SM 0 covers 0-300, SM 1 50-150
    assert s.idle_fraction == pytest.approx(1 - 400 / (4 * 300))
    assert s.tail_ns == 300 - 150
    assert s.phase_ns == {"load": 30, "wait K": 60, "mainloop": 210, "epilogue": 100}
    assert "3 tiles on 2 of 4 SMs" in s.text()


def test_overlapping_tiles_of_one_sm_count_once():
    tiles = [(0, 3, (0, 0, 10, 90, 100, 50)), (1, 3, (40, 40, 50, 150, 160, 120))]
    s = trace.LaunchTrace.decode("x", 1, synthetic(tiles)).summary()
    assert s.busy_ns == 160 and s.idle_fraction == pytest.approx(0.0)


def test_unwritten_stamps_take_the_tile_start():
    raw = synthetic(TILES)
    raw[5, words.LOAD_START] = raw[5, words.LOAD_END] = 0  # (e.g. no producer record)
    launch = trace.LaunchTrace.decode("x", 4, raw)
    row = launch.table()["m_block"].tolist().index(5)
    assert launch.table()["load_start"][row] == launch.table()["start"][row]


def test_empty_launch():
    raw = np.zeros((4, words.RECORD_WORDS), dtype=np.int64)
    s = trace.LaunchTrace.decode("x", 132, raw).summary()
    assert s.tiles == 0 and s.idle_fraction == 1.0


def test_json_round_trip():
    launch = trace.LaunchTrace.decode("x", 4, synthetic(TILES))
    again = trace.LaunchTrace.from_json(json.loads(json.dumps(launch.to_json())))
    assert again.label == "x" and again.num_sms == 4
    for name, column in launch.table().items():
        assert column.tolist() == again.table()[name].tolist(), name


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    launch = trace.LaunchTrace.decode("x", 4, synthetic(TILES))
    path = tmp_path / "t.png"
    trace.plot_timelines([launch, launch], str(path), titles=["a", "b"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _problem(**kw):
    base = dict(
        batch=2, nheads=16, nheads_kv=16, head_dim=128, dtype="bfloat16", max_seqlen_q=1000,
        max_seqlen_k=1000, kv_capacity=1000, causal=True,
    )  # fmt: skip
    return Problem(**{**base, **kw})


def test_tracing_calls_take_the_traced_variant_with_a_slot_per_tile():
    untraced = plan_forward(_problem(), 132)
    assert not untraced.variant.config.trace and untraced.trace_slots == 0
    plans.trace_calls(True)
    try:
        traced = plan_forward(_problem(), 132)
        split = plan_forward(_problem(max_seqlen_q=1, max_seqlen_k=32768), 132, None, 4)
    finally:
        plans.trace_calls(False)
    assert traced.variant.config == untraced.variant.config.replace(trace=True)
    assert traced.variant.takes_optionals
    tile_m = traced.variant.config.tile_m
    assert traced.trace_slots == 2 * 16 * -(-1000 // tile_m)
    assert split.num_splits == 4 and split.trace_slots == 2 * 16 * 4
    assert not plan_forward(_problem(), 132).variant.config.trace


def test_config_trace_must_be_a_bool():
    with pytest.raises(TypeError, match="AttentionConfig.trace must be a bool"):
        AttentionConfig(128, 128, trace=1)


def test_bench_overrides_are_typed_by_the_config_fields():
    from flash_cute.bench_trace import parse_overrides

    assert parse_overrides("scheduler=dynamic_persistent, tile_n=112,pingpong=false") == {
        "scheduler": "dynamic_persistent",
        "tile_n": 112,
        "pingpong": False,
    }
    assert parse_overrides("") == {}
    with pytest.raises(ValueError, match="AttentionConfig field"):
        parse_overrides("tiles=3")
    with pytest.raises(ValueError, match="pingpong takes true or false"):
        parse_overrides("pingpong=maybe")


def test_bench_plot_redraws_a_trace_json(tmp_path):
    pytest.importorskip("matplotlib")
    from flash_cute import bench

    launch = trace.LaunchTrace.decode("d128 x", 4, synthetic(TILES))
    path, png = tmp_path / "t.json", tmp_path / "t.png"
    launches = [launch.to_json(), launch.to_json()]
    data = {"launches": launches, "titles": ["a", "b"], "same_time_axis": True}
    path.write_text(json.dumps(data))
    assert bench.main(["plot", str(path), str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_record_sets_the_untraced_plans_aside_and_restores_them():
    from flash_cute import runtime

    runtime.FUNC_PLANS["key"] = "untraced plan"
    try:
        with trace.record() as rec:
            assert "key" not in runtime.FUNC_PLANS and plans.tracing()
            runtime.FUNC_PLANS["traced key"] = "traced plan"
        assert not plans.tracing()
        assert runtime.FUNC_PLANS.get("key") == "untraced plan"
        assert "traced key" not in runtime.FUNC_PLANS
        assert rec.launches == []
    finally:
        runtime.FUNC_PLANS.pop("key", None)


def test_record_sets_every_entry_points_plans_aside():
    """FlashAttention-3's functions and the custom op keep plan caches of their own: record()
    sets those aside too (their untraced plans would replay inside the block)."""
    from flash_cute import entry

    caches = [point.plans for point in entry.ENTRY_POINTS]
    assert len(caches) > 3
    for cache in caches:
        cache["key"] = "untraced plan"
    try:
        with trace.record():
            assert all("key" not in cache for cache in caches)
        assert all(cache.get("key") == "untraced plan" for cache in caches)
    finally:
        for cache in caches:
            cache.pop("key", None)
