"""benchmarks/engine_throughput.py's story of a call: its steps as runs of one option."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from engine_throughput import story  # noqa: E402


def _step(kind, strategy, batch, ms):
    return {"kind": kind, "strategy": strategy, "batch": batch, "seconds": ms / 1e3}


def test_story_runs_of_one_option():
    entries = [_step("prefill", None, 4, 30.0), _step("sd", "8_4_32", 4, 5.0), _step("sd", "8_4_32", 3, 7.0),
               _step("decode", None, 3, 1.5), _step("sd", "6_2_12", 2, 4.0)]  # fmt: skip
    want = "prefill x1 b4 30.00ms | 8_4_32 x2 b4-3 6.00ms | off x1 b3 1.50ms | 6_2_12 x1 b2 4.00ms"
    assert story(entries) == want
    assert story([]) == ""
