"""The benchmark CLI's GPU-free parts: config listing for sweeps and redrawing a sweep's plot."""

import ast
import json

import pytest

from flash_cute import bench, timing


def _listed_labels(capsys, argv, count, head_dim):
    """Run `sweep ... --list`; check the count line and that labels tell configs apart."""
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"{count} valid configs for hdim {head_dim}"
    labels = lines[1:]
    assert len(set(labels)) == count, "config labels must tell configs apart"
    return labels


def test_sweep_list_covers_scheduler_knobs(capsys):
    argv = [
        "sweep",
        "--hdim",
        "128",
        "--causal",
        "--tile-m",
        "128",
        "--tile-n",
        "128",
        "--pv",
        "regs",
        "--pingpong",
        "on",
        "--rescale-before-pv",
        "off",
        "--scheduler",
        "single_tile",
        "dynamic_persistent",
        "--l2-section-mb",
        "8",
        "24",
        "--mbarrier-probe",
        "off",
        "on",
        "--list",
    ]
    labels = _listed_labels(capsys, argv, 8, 128)
    assert sum("dynamic" in label for label in labels) == 4
    assert sum("l2:24MB" in label for label in labels) == 4  # 8 MB is the default
    assert sum("probe" in label for label in labels) == 4


def test_sweep_list_covers_softmax_knobs(capsys):
    argv = [
        "sweep",
        "--hdim",
        "64",
        "--tile-m",
        "192",
        "--tile-n",
        "128",
        "--pv",
        "regs",
        "--pingpong",
        "on",
        "--rescale-before-pv",
        "off",
        "--scheduler",
        "single_tile",
        "--exp2-on-fma",
        "0",
        "2",
        "--lazy-rescale",
        "off",
        "on",
        "--rescale-threshold",
        "0",
        "8",
        "--list",
    ]
    labels = _listed_labels(capsys, argv, 8, 64)
    assert sum("fma-exp2:2/16" in label for label in labels) == 4
    assert sum(" lazy" in label for label in labels) == 4
    assert sum("lag8" in label for label in labels) == 4
    with pytest.raises(SystemExit):
        bench.main(["sweep", "--lazy-rescale", "maybe", "--list"])


def test_sweep_list_covers_the_o_store(capsys):
    argv = [
        "sweep",
        "--hdim",
        "64",
        "--tile-m",
        "192",
        "--tile-n",
        "128",
        "--pv",
        "regs",
        "--pingpong",
        "on",
        "--rescale-before-pv",
        "off",
        "--scheduler",
        "single_tile",
        "static_persistent",
        "--store-o-from-registers",
        "off",
        "on",
        "--list",
    ]
    labels = _listed_labels(capsys, argv, 4, 64)
    assert sum("O-regs" in label for label in labels) == 2


def test_sweep_rejects_unknown_scheduler():
    with pytest.raises(SystemExit):
        bench.main(["sweep", "--scheduler", "persistent", "--list"])


def test_plot_redraws_sweep_json(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        bench.SweepRow({"tile_m": 128}, "128x128 a", {512: 400.0, 1024: 500.0}),
        bench.SweepRow({"tile_m": 192}, "192x128 b", {512: 380.0, 1024: 520.0}),
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"title": "t", "rows": [bench.asdict(r) for r in rows]}))
    png = tmp_path / "sweep.png"
    assert bench.main(["plot", str(path), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_balanced_orders_let_each_peer_follow_every_other_equally(n):
    orders = timing.balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = {}
    for order in orders:
        for a, b in zip(order, order[1:]):
            follows[(a, b)] = follows.get((a, b), 0) + 1
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) == 1


def test_varlen_cases_list_without_gpu(capsys):
    assert bench.main(["varlen", "--list", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(bench.VARLEN_PREFILL_CASES)
    for line, case in zip(lines, bench.VARLEN_PREFILL_CASES):
        lengths = ast.literal_eval(line.split(": ", 1)[1])
        _, count, (lo, hi), *_ = case
        assert len(lengths) == count and all(lo <= n <= hi for n in lengths)
    assert bench.varlen_case_lengths(bench.VARLEN_PREFILL_CASES[0], 3) == bench.varlen_case_lengths(
        bench.VARLEN_PREFILL_CASES[0], 3
    ), "lengths must follow the seed"


def test_varlen_table_formats_ratios():
    row = bench.VarlenPrefillRow(
        "case",
        "128x128",
        100,
        {"flash_cute": 110.0, "flash_cute one CTA per tile": 100.0, "fa4": 55.0},
    )
    table = bench.varlen_prefill_table([row])
    assert table.splitlines()[-1] == "| case | 128x128 | 100 | 110 | 100 | 55 | 1.10 | 2.00 |"


def test_prefill_passes_merge_to_median_times():
    """Repeated grid passes: each peer's time is its median over the passes; the table gives
    the median and the range of the passes' own ratios."""

    def row(ms_fc, ms_fa4):
        r = bench.PrefillRow("bf16", 64, False, 1024, 16, 32)
        r.ms = {"flash_cute": ms_fc, "fa4": ms_fa4}
        r.tflops = {name: r.flops / ms / 1e9 for name, ms in r.ms.items()}
        return r

    merged = bench.merge_passes([row(1.0, 1.1), row(1.3, 1.0), row(1.05, 1.15)])
    assert merged.ms == {"flash_cute": 1.05, "fa4": 1.1}
    assert merged.flops == 4 * 16 * 32 * 1024 * 1024 * 64
    assert merged.ratio_to_best_peer == pytest.approx(1.1 / 1.05)
    assert merged.pass_ratios == pytest.approx([1.1, 1.0 / 1.3, 1.15 / 1.05])
    assert merged.paired_ratio == pytest.approx(1.15 / 1.05)  # the median pass, not 1.1 / 1.05
    lines = bench.prefill_table([merged]).splitlines()
    assert lines[-2] == "| bf16 | 64 | no | flash_cute / best peer | 1.10 |"
    assert lines[-1] == "| bf16 | 64 | no | range over passes | 0.77-1.10 |"
    single = bench.merge_passes([row(1.0, 1.1)])
    assert "range over passes" not in bench.prefill_table([single])
    late = row(1.0, 1.2)
    late.ms["cudnn"], late.tflops["cudnn"] = 0.5, late.flops / 0.5 / 1e9
    assert set(bench.merge_passes([row(1.0, 1.1), late]).ms) == {"flash_cute", "fa4", "cudnn"}


def test_prefill_passes_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["prefill", "--passes", "0"])


def test_prefill_rows_with_a_v_head_dim_count_both():
    """MLA prefill rows: FLOPs 2 b h s^2 (d + dv), halved when causal; labelled d/dv."""
    row = bench.PrefillRow("bf16", 192, True, 1024, 16, 16, hdim_v=128)
    assert row.flops == 2 * 16 * 16 * 1024 * 1024 * (192 + 128) / 2
    row.tflops = {"flash_cute": 500.0, "fa4": 400.0}
    assert "| bf16 | 192/128 | yes | flash_cute |" in bench.prefill_table([row])


def test_mla_table_reports_bandwidth_share():
    from flash_cute import bench_mla

    row = dict(
        batch=1, keys=4096, nheads=128, seqlen_q=1, us={"latent": 10.0},
        tbs={"latent": 2.7}, tflops={"latent": 5.0}, copy_tbs=3.0,
    )  # fmt: skip
    assert bench_mla.decode_table([row]).splitlines()[-1] == (
        "| 1 | 4096 | 128 | 1 | latent | 10.0 | 2.70 | 90% | 5 |"
    )


def test_fp8_math_knobs_parse_every_form():
    """(The FP8 benchmarks' sweep names: benchmarks/fp8_prefill.py and fp8_decode.py.)"""
    from flash_cute.bench import fp8_math_knobs

    assert fp8_math_knobs("m192+n128+st3+r72/144+pp0+ov0+dyn+b4") == dict(
        tile_m=192, tile_n=128, num_stages=3, producer_registers=72, mma_registers=144,
        pingpong=False, intra_wg_overlap=False, rescale_o_before_pv=False,
        scheduler="dynamic_persistent", transpose_batch=4,
    )  # fmt: skip
    assert fp8_math_knobs("static") == {"scheduler": "static_persistent"}
    with pytest.raises(ValueError, match="unknown FP8-math knob 'x3'"):
        fp8_math_knobs("n64+x3")


def test_set_fp8_math_changes_applies_and_restores():
    from flash_cute import bench, config, plan
    from flash_cute.runtime import PlanCache

    plans, row = PlanCache(), config.FORWARD_CONFIGS[(128, "bfloat16", False)]
    own = plan.fp8_math_config(row, 128, 128)
    try:
        bench.set_fp8_math_changes({"tile_n": 64}, plans)
        assert plan.fp8_math_config(row, 128, 128) == own.replace(tile_n=64)
    finally:
        bench.set_fp8_math_changes({}, plans)
    assert plan.fp8_math_config(row, 128, 128) == own


def test_graph_step_rounds_take_turns_and_report_per_call_medians(monkeypatch):
    """The decode benchmarks' method: rounds in which the replays take turns in their order,
    each time per call of the graph (ms -> us, over `calls`), the median of the rounds."""
    seen = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([10.0, 30.0, 20.0])}

    def fake_time_cuda(fn, warmup, reps):
        seen.append((fn(), warmup, reps))
        return next(times[seen[-1][0]])

    monkeypatch.setattr(timing, "time_cuda", fake_time_cuda)
    us = timing.graph_step_rounds_us({"a": lambda: "a", "b": lambda: "b"}, calls=10, rounds=3)
    assert [name for name, _, _ in seen] == ["a", "b"] * 3
    assert all((warmup, reps) == (1, 10) for _, warmup, reps in seen)
    assert us == {"a": 200.0, "b": 2000.0}
