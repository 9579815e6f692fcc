"""benchmarks/step_host.py runs through the engine's public step on the CPU (its stubs follow the runner's calls)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_host_times_plain_and_speculative_steps():
    cmd = [sys.executable, "benchmarks/step_host.py", "--batch", "2", "--strategies", "8_4_32", "--steps", "3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["2"]]
    assert [(r[1], r[2]) for r in rows] == [("off", "off"), ("off", "on"), ("8_4_32", "on")]
    assert all(float(x) > 0 for r in rows for x in r[3:])
