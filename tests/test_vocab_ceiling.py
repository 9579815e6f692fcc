"""benchmarks/vocab_ceiling.py with tiny settings: counts from the target's answers, a reduced vocabulary,
its coverage and the perfect-drafter ceiling over it beside the full vocabulary's, on the same answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vocab_ceiling  # noqa: E402


def test_vocab_ceiling_rows(tmp_path):
    out = tmp_path / "v.jsonl"
    rows = vocab_ceiling.main(["--tiny", "--out", str(out)])
    assert [(r["temperature"], r["vocab"]) for r in rows] == [(1.0, 49152), (1.0, 256), (0.0, 49152), (0.0, 256)]
    for full, cut in (rows[:2], rows[2:]):
        assert full["coverage"] == 1.0 and full["share"] == 1.0 and full["ceiling"] == full["ceiling_full"]
        assert cut["ceiling_full"] == full["ceiling"] and cut["answer_tokens"] == full["answer_tokens"]
        assert 0.0 < cut["coverage"] < 1.0  # 256 ids cannot hold every token of SmolLM2's answers
        assert 1.0 <= cut["ceiling"] <= 4.0 and 1.0 <= full["ceiling"] <= 4.0  # 3_2_4: at most 3 drafted + 1
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
