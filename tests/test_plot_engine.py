"""benchmarks/plot_engine.py on synthetic engine_throughput rows."""

from __future__ import annotations

import json
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
