"""benchmarks/plot_step_variants.py: `step_costs.py --compare` records read per model at one batch (a repeated variant's
last row counting), drawn against the floor; a clear error where the records hold no such rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from plot_step_variants import load, main  # noqa: E402


def _row(model, label, batch, ms, digest, tokens=1):
    return dict(model=model, label=label, batch=batch, ctx=1024, tokens=tokens, ms=ms, floor_ms=0.5,
                logits_digest=digest)  # fmt: skip


def test_rows_per_model_at_one_batch_the_last_of_a_repeated_variant(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        _row("m1", "base", 1, 2.0, "aa"), _row("m1", "chain", 1, 1.6, "bb"), _row("m1", "base", 8, 2.5, "cc"),
        _row("m1", "base", 1, 2.2, "aa", tokens=16), {"note": "not a --compare row"},
    ]) + "\n")  # fmt: skip
    second.write_text(
        json.dumps(_row("m1", "chain", 1, 1.5, "bb")) + "\n" + json.dumps(_row("m2", "base", 1, 1.0, "dd"))
    )
    got = load([str(first), str(second)], batch=1)
    assert list(got) == ["m1", "m2"]
    assert [(r["label"], r["ms"]) for r in got["m1"]] == [("base", 2.0), ("chain", 1.5)]
    out = tmp_path / "fig.png"
    main([str(out), str(first), str(second)])
    assert out.stat().st_size > 10_000


def test_records_without_compare_rows_at_the_batch_are_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_row("m1", "base", 8, 2.0, "aa")) + "\n")
    with pytest.raises(SystemExit, match="no `--compare` decode rows at batch 1"):
        main([str(tmp_path / "x.png"), str(path)])
