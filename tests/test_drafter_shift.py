"""benchmarks/drafter_shift.py with tiny settings: the policy moves, the drafter is measured on the moved
policy's answers before and after online training, and the report comes out whole."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import drafter_shift  # noqa: E402


def test_shift_then_online_training_report(tmp_path):
    out = tmp_path / "shift.jsonl"
    rep = drafter_shift.main(["--train", "2", "--held-out", "1", "--max-new-tokens", "8", "--steps", "2",
                              "--shift-steps", "3", "--online-steps", "2", "--batch-tokens", "128", "--depth", "3",
                              "--out", str(out)])  # fmt: skip
    # the fine-tuning moved the policy toward the terse answers it was shown
    assert len(rep["shift_losses"]) == 3 and rep["shift_losses"][-1] < rep["shift_losses"][0]
    for key in ("a_held_out_before_shift", "b_held_out_before_online", "b_held_out_after_online"):
        r = rep[key]
        assert len(r["top1_by_depth"]) == 3 and all(0.0 <= x <= 1.0 for x in r["top1_by_depth"])
        assert 1.0 <= r["chain_steps"] <= 4.0
    for key in ("train_on_a", "online_on_b"):
        assert math.isfinite(rep[key]["loss"])
    assert json.loads(out.read_text().splitlines()[-1])["shift_losses"] == rep["shift_losses"]


def test_terse_answer_uses_the_expression():
    from tlt_rt.train.rl.data import ArithmeticTask

    p = ArithmeticTask(digits=2, num_ops=1, seed=3).problem(0)
    assert drafter_shift.terse_answer(p) == f"{p.meta['expression']} = {p.answer}."
