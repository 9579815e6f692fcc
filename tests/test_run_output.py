"""What a run prints: why speculation ran or not (from the SD policy's own numbers), progress lines with the
time left, and the closing summary."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tlt_rt.ir.strategy import Strategy
from tlt_rt.rollout.policy import SDPolicy
from tlt_rt.rollout.policy.costs import CostTable
from tlt_rt.train.rl.progress import Progress, duration, run_summary
from tlt_rt.train.rl.sd_explain import explain_policy, sd_reason, sd_why


def measured_policy(sd_seconds: float, accept: float) -> SDPolicy:
    s = Strategy.parse("3_2_4")
    policy = SDPolicy([s], [1, 2, 4], CostTable(), mode="auto")
    for _ in range(5):
        policy.observe(1, None, 0.010, 1.0)
        policy.observe(1, s, sd_seconds, accept)
    return policy


def test_explain_reads_the_policys_costs_and_accept_lengths():
    policy = measured_policy(sd_seconds=0.030, accept=1.2)
    why = explain_policy(policy, [{"kind": "prefill", "batch": 3}, {"kind": "decode", "batch": 1}])
    row = why["buckets"]["1"]
    assert why["mode"] == "auto" and set(why["buckets"]) == {"1"}  # only the batches decoded at
    assert row["strategy"] == "3_2_4" and row["measured"]
    assert row["cost_ratio"] == pytest.approx(3.0, rel=0.05)
    assert row["accept"] == pytest.approx(1.2, rel=0.05)
    assert row["speedup"] == pytest.approx(row["accept"] / row["cost_ratio"])
    assert explain_policy(None, []) is None


def test_sd_reason_says_why():
    slow = {"sd_share": 0.0, "sd_policy": explain_policy(measured_policy(0.030, 1.2), [{"kind": "decode", "batch": 1}])}
    text = sd_reason(slow, "auto")
    assert text.startswith("SD unused: at batch <= 1 the best strategy 3_2_4 costs 3.0 plain steps and emits 1.20")
    assert "(measured): 0.40x plain decoding, so the policy kept plain decoding" in text
    fast = {"sd_share": 0.4, "sd_policy": explain_policy(measured_policy(0.012, 3.0), [{"kind": "sd", "batch": 1}])}
    assert sd_reason(fast, "auto").startswith("SD 40% of decode time; at batch <= 1")
    assert "2.50x plain decoding" in sd_reason(fast, "auto")
    assert sd_reason(fast, "off") == "SD off (rollout.speculative=off)"
    assert "times plain decoding first" in sd_why({"sd_share": 0.0, "sd_policy": None}, "auto")
    forced = sd_reason({"sd_share": 1.0, "sd_policy": {"mode": "on", "buckets": {"1": {"plain_ms": None}}}}, "on")
    assert forced.startswith("SD 100% of decode time; rollout.speculative=on") and "no plain step is timed" in forced


def test_progress_lines_count_steps_and_time_left():
    stream = io.StringIO()  # not a terminal: the beat thread would print here; every_s=0 keeps it off
    p = Progress(start_step=2, total_steps=5, every_s=0, stream=stream)
    assert "time left unknown" in p.eta()
    p.begin(2, "rollout", total_seqs=12)
    p.update(4)
    assert p.line().startswith("[progress] step 3/5: rollout 4/12 sequences,")
    p.step_done()
    assert p.prefix(2).startswith("[step 3/5 | ") and p.prefix(2).endswith("left]")
    assert (duration(5), duration(125), duration(7300)) == ("5s", "2m05s", "2h01m")


def test_run_summary_names_everything_a_newcomer_needs():
    records = [
        {"step": s, "reward_mean": r, "accuracy": r, "rollout_seconds": 10.0, "step_seconds": 20.0, "sd_share": 0.0,
         "accept_length_hist": {}, "spot_steps": 2, "harvested_worker_seconds": 1.5, "sd_policy": None}
        for s, r in ((0, 0.0), (1, 0.5))
    ]  # fmt: skip
    text = run_summary(records, Path("runs/x"), Path("runs/x/checkpoints/step_000002"), "auto", 45.0)
    assert text.splitlines()[0] == "done: 2 step(s) in 45s"
    for part in ("reward    0.000 -> 0.500", "rollout   20s of 40s step time (50%)", "SD        0% of decode time",
                 "accept length - (no speculative steps)", "why       ", "run       runs/x",
                 "checkpoint runs/x/checkpoints/step_000002", "report    python -m tlt_rt.report runs/x"):  # fmt: skip
        assert part in text, part
