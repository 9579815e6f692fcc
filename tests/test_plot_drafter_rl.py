"""benchmarks/plot_drafter_rl.py on synthetic drafter_rl rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import plot_drafter_rl  # noqa: E402


def _row(variant: str, temperature: float, accept: float, ceiling: float) -> dict:
    return {"variant": variant, "strategy": "8_4_32", "temperature": temperature, "accept_length": accept,
            "ceiling": ceiling, "ratio": round(accept / ceiling, 3)}  # fmt: skip


def test_plot_reads_jsonl_and_logs_and_rejects_files_without_rows(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [_row("base", 1.0, 1.9, 2.7), _row("base", 0.0, 4.0, 8.3)]))
    log = tmp_path / "b.log"  # a log: progress lines, other JSON (the warm-up's report) and the rows
    log.write_text("\n".join(["training 100/677", json.dumps({"generated_tokens": 5}),
                              json.dumps(_row("mix", 1.0, 2.2, 2.7)), "done"]))  # fmt: skip
    rows = plot_drafter_rl.load([str(jsonl), str(log)])
    assert [(r["variant"], r["temperature"]) for r in rows] == [("base", 1.0), ("base", 0.0), ("mix", 1.0)]
    out = tmp_path / "fig.png"
    plot_drafter_rl.main([str(out), str(jsonl), str(log)])
    assert out.stat().st_size > 10_000
    empty = tmp_path / "c.log"
    empty.write_text("no rows here\n")
    with pytest.raises(ValueError, match="no drafter_rl rows"):
        plot_drafter_rl.load([str(empty)])
