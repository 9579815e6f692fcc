"""benchmarks/workload_profile.py on a CPU: accuracy and the answer-length tail of a config's task, per variant."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from workload_profile import main  # noqa: E402


def test_profile_prints_one_row_per_variant(capsys):
    keys = ["model.device=cpu", "rl.group_size=2", "rollout.max_new_tokens=12"]
    assert main(["--config", "configs/smollm2-arith.yaml", "--prompts", "2", "--variants", "", "task.num_ops=3",
                 "--", *keys]) == 0  # fmt: skip
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| (config)") or
            line.startswith("| task.num_ops=3")]  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        answers, accuracy, p50, cut = int(cells[1]), float(cells[2]), float(cells[3]), cells[8]
        assert answers == 4 and 0.0 <= accuracy <= 1.0 and 1 <= p50 <= 12 and cut.endswith("%")
