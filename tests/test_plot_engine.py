"""benchmarks/plot_engine.py on synthetic engine_throughput rows."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import plot_engine  # noqa: E402


def _run(path: Path, rows: list[tuple[str, int, float]]) -> str:
    path.write_text("\n".join(json.dumps({"provider": "tlt", "config": c, "batch": b, "tokens_per_s": t})
                              for c, b, t in rows))  # fmt: skip
    return str(path)


def test_plot_engine_writes_a_figure_and_rejects_runs_without_plain_decoding(tmp_path):
    a = _run(tmp_path / "a.jsonl", [("off", 1, 400.0), ("auto", 1, 420.0), ("off", 8, 3000.0), ("auto", 8, 2900.0)])
    b = _run(tmp_path / "b.jsonl", [("off", 1, 410.0), ("auto", 1, 400.0), ("6_2_12", 1, 450.0)])
    assert plot_engine.load(a) == {"off": {1: 400.0, 8: 3000.0}, "auto": {1: 420.0, 8: 2900.0}}
    out = tmp_path / "fig.png"
    plot_engine.main([str(out), a, b, "--labels", "before", "after"])
    assert out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no 'off' rows"):
        plot_engine.load(_run(tmp_path / "c.jsonl", [("auto", 1, 1.0)]))
    with pytest.raises(SystemExit):
        plot_engine.main([str(out), a, b, "--labels", "one"])


def test_auto_ratio_is_the_paired_one_where_the_run_has_it(tmp_path):
    # an interleaved run's paired ratio (median over rounds) need not equal the ratio of the medians
    path = tmp_path / "paired.jsonl"
    rows = [("off", 8, 1000.0, 1.0), ("auto", 8, 1500.0, 1.42), ("off", 128, 2000.0, 1.0), ("auto", 128, 1900.0, None)]
    path.write_text("\n".join(json.dumps({"provider": "tlt", "config": c, "batch": b, "tokens_per_s": t,
                                          "paired_ratio": r}) for c, b, t, r in rows))  # fmt: skip
    data, paired = plot_engine.load(str(path)), plot_engine.paired_ratios(str(path))
    assert paired == {"off": {8: 1.0, 128: 1.0}, "auto": {8: 1.42}}
    assert plot_engine.auto_ratio(data, paired, 8) == 1.42  # paired, not 1500 / 1000
    assert plot_engine.auto_ratio(data, paired, 128) == 0.95  # no paired ratio: the medians'
    assert math.isnan(plot_engine.auto_ratio(data, paired, 32))  # not run
