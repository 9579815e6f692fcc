"""benchmarks/gpu_one.sh, the one-GPU pass, run with a stand-in `python` that records each call and writes the
warm-up's report: the parts run in order, each given what the one before made, and a pass whose warm-up made no
drafter stops before the runs that need one."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

STUB = """#!/bin/bash
echo "python $*" >> "$CALLS"
if [[ "$*" == *--warmup-only* && -z "$NO_DRAFTER" ]]; then
  out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/'); mkdir -p "$out/drafter"
  echo '{"accept_length": {"1": {"after": 4.0, "ceiling": 7.0}}}' > "$out/drafter/warmup.json"
fi
"""


def _pass(tmp_path: Path, **env: str) -> tuple[list[str], str]:
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text(STUB)
    (stub / "python").chmod(0o755)
    calls, out = tmp_path / "calls.log", tmp_path / "out"
    full_env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "CALLS": str(calls), **env}
    subprocess.run(["bash", str(REPO / "benchmarks/gpu_one.sh"), str(out), "/m/q15.gguf"], cwd=REPO, env=full_env,
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    main = out / "main.log"
    deadline = time.time() + 60
    while time.time() < deadline and not any(w in (main.read_text() if main.exists() else "")
                                             for w in ("all done", "no drafter")):  # fmt: skip
        time.sleep(0.2)
    return calls.read_text().splitlines(), main.read_text()


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_one_runs_its_parts_in_order_on_the_warm_drafter(tmp_path):
    calls, main = _pass(tmp_path, PROFILE="1")
    assert "all done" in main
    kinds = [next((k for k in ("convert_gguf", "learner_step.py", "-m gpu", "--warmup-only", "e2e_rl.py --config",
                               "engine_throughput", "bench_attention", "bench_linear", "step_costs") if k in c), c)
             for c in calls]  # fmt: skip
    assert kinds[:2] == ["convert_gguf", "learner_step.py"] and set(kinds[2:4]) == {"-m gpu", "--warmup-only"}
    assert kinds[4:6] == ["e2e_rl.py --config", "engine_throughput"]
    assert kinds[6:] == ["bench_attention", "bench_linear", "step_costs", "step_costs", "step_costs"]  # no learner
    drafter = str(tmp_path / "out" / "w0" / "drafter")
    assert f"--drafter {drafter}" in calls[4] and f"--drafter {drafter}" in calls[5]
    warm = calls[kinds.index("--warmup-only")]
    assert all(a in warm for a in ("--warmup-max-new-tokens 512", "--warmup-epochs 4", "--warmup-curve 4"))
    assert "rl.compile_layers=false" in calls[1] and "model.path=/m/q15.gguf" in calls[4]


@pytest.mark.skipif(not Path("/usr/bin/setsid").exists() and not Path("/bin/setsid").exists(), reason="needs setsid")
def test_gpu_one_stops_before_the_runs_when_the_warm_up_made_no_drafter(tmp_path):
    calls, main = _pass(tmp_path, NO_DRAFTER="1", LEARNER_STEP="0")
    assert "no drafter" in main and "all done" not in main
    assert not [c for c in calls if "learner_step.py" in c or "engine_throughput" in c or "--drafter" in c]
