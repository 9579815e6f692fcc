"""benchmarks/tp_throughput.py on CPU (gloo, the tiny shape): TP=N ranks emit exactly TP=1's greedy tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_give_the_unsharded_tokens(tp):
    done = subprocess.run([sys.executable, "benchmarks/tp_throughput.py", "--smoke", "--tp", str(tp)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(f"| {tp} |")]
    assert len(rows) == 2 and all(row.rstrip().endswith("| yes |") for row in rows)  # batches 1 and 4


def test_a_shape_the_ranks_cannot_split_fails_before_any_process():
    done = subprocess.run([sys.executable, "benchmarks/tp_throughput.py", "--shape", "qwen2.5-7b", "--tp", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "divisible by 3" in done.stderr
