"""benchmarks/plot_warmups.py on the recorded warm-up reports and on reports it must refuse."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import plot_warmups  # noqa: E402

RECORDS = [BENCH / "data" / f"warmup-qwen05-{n}-h200x2-669a54c.json" for n in ("8192x1.5-u3", "6144x1.5-u5")]


def test_plots_recorded_warm_ups_with_their_own_labels(tmp_path):
    out = tmp_path / "fig.png"
    assert plot_warmups.main([str(out), *map(str, RECORDS)]) == 0
    assert out.stat().st_size > 10_000
    rep, curve = plot_warmups.load(str(RECORDS[1]))
    assert plot_warmups.label_of(rep) == "6144 prompts, unroll 5" and len(curve) == 3


def test_refuses_a_report_without_a_curve_and_labels_that_do_not_match(tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"curve": [{"accept": 2.0, "ceiling": 3.0, "train_tokens": 1, "seconds": 1.0}]}))
    with pytest.raises(SystemExit, match="no curve"):
        plot_warmups.load(str(flat))
    blind = tmp_path / "blind.json"
    blind.write_text(json.dumps({"curve": [{"accept": 2.0, "ceiling": 0.0, "train_tokens": 1, "seconds": 1.0}] * 2}))
    with pytest.raises(SystemExit, match="without a ceiling"):
        plot_warmups.load(str(blind))
    with pytest.raises(SystemExit):
        plot_warmups.main([str(tmp_path / "x.png"), *map(str, RECORDS), "--labels", "one"])
