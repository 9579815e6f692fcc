"""The pieces of the verl GRPO recipe that need no verl: the parquet rows (tlt_rt.integrations.verl_data), the
reward function verl calls (tlt_rt.integrations.verl_reward) and benchmarks/gpu_verl.sh's overrides.
tests/verl drives them through verl itself (`make verl-test`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tlt_rt.config import DEFAULT_INSTRUCTION
from tlt_rt.integrations import verl_data
from tlt_rt.integrations.verl_reward import compute_score
from tlt_rt.train.rl.reward import reward

REPO = Path(__file__).resolve().parents[1]


def test_rows_are_verl_rows_of_the_arithmetic_task():
    rows = verl_data.rows("train", 16)
    assert len(rows) == 16
    for i, r in enumerate(rows):
        assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert r["data_source"] == verl_data.DATA_SOURCE and r["ability"] == "math"
        [msg] = r["prompt"]
        assert msg["role"] == "user"
        assert msg["content"] == f"{r['extra_info']['question']}\n{DEFAULT_INSTRUCTION}"
        assert r["reward_model"] == {"style": "rule", "ground_truth": r["extra_info"]["answer"]}
        assert r["extra_info"]["split"] == "train" and r["extra_info"]["index"] == i
        assert int(r["reward_model"]["ground_truth"]) >= 1  # the task's answers are positive integers
    assert rows == verl_data.rows("train", 16)  # a pure function of (split, n, seed, knobs)
    assert len({r["extra_info"]["question"] for r in rows}) > 1


def test_test_split_holds_out_another_seed():
    train = {r["extra_info"]["question"] for r in verl_data.rows("train", 64)}
    test = verl_data.rows("test", 64)
    assert all(r["extra_info"]["split"] == "test" for r in test)
    assert len(train & {r["extra_info"]["question"] for r in test}) < 8  # a few short stories may coincide
    assert verl_data.rows("train", 4, seed=1) != verl_data.rows("train", 4, seed=0)
    with pytest.raises(ValueError, match="split"):
        verl_data.rows("val", 4)
    with pytest.raises(ValueError, match="n must be"):
        verl_data.rows("train", 0)


def test_instruction_and_knobs():
    [row] = verl_data.rows("train", 1, instruction=None, digits=3, num_ops=1, max_digits=3, max_ops=1)
    assert row["prompt"][0]["content"] == row["extra_info"]["question"]
    assert row["extra_info"]["difficulty"] >= 3


def test_parquet_round_trip_through_the_project_loader(tmp_path):
    pytest.importorskip("pyarrow")
    from tlt_rt.train.rl.data import load_dataset_file

    assert verl_data.main([str(tmp_path), "--train", "12", "--test", "5"]) == 0
    train = load_dataset_file(tmp_path / "train.parquet")
    test = load_dataset_file(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (12, 5)
    rows = verl_data.rows("train", 12)
    assert [p.answer for p in train] == [r["reward_model"]["ground_truth"] for r in rows]
    assert [p.messages for p in train] == [r["prompt"] for r in rows]


def test_compute_score_is_the_project_reward():
    right = "4 - 2 = 2, then 2 + 2 = 4. The answer is 4."
    assert compute_score("tlt_rt/arithmetic", right, "4") == {"score": 1.0, "acc": 1.0, "pred": "4"}
    assert compute_score("tlt_rt/arithmetic", "The answer is 5.", "4")["score"] == 0.0
    assert compute_score("tlt_rt/arithmetic", "so \\boxed{1,234}", 1234)["score"] == 1.0
    assert compute_score(solution_str="no number here", ground_truth="4") == {"score": 0.0, "acc": 0.0, "pred": ""}
    assert compute_score("x", None, "4")["score"] == 0.0  # never raises
    # what verl passes besides: extra_info and, with a reward model, its router
    assert compute_score("x", "The answer is 7", "7", extra_info={"index": 0}, reward_router_address=None)["acc"]
    for r in verl_data.rows("test", 8):
        gt = r["reward_model"]["ground_truth"]
        assert compute_score(r["data_source"], f"The answer is {gt}.", gt)["score"] == reward(f"= {gt}", gt) == 1.0


def _overrides(tmp_path, **env) -> dict[str, str]:
    out = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu_verl.sh"), "--overrides", "/models/qwen", str(tmp_path), "/out"],
        capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin", **env},
    ).stdout  # fmt: skip
    pairs = [line.split("=", 1) for line in out.splitlines() if line]
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), "an override is given twice"
    return dict(pairs)


def test_gpu_verl_overrides(tmp_path):
    o = _overrides(tmp_path)
    assert o["actor_rollout_ref.rollout.name"] == "tlt_rt" and o["actor_rollout_ref.rollout.mode"] == "async"
    assert o["algorithm.adv_estimator"] == "grpo"
    assert (o["data.train_batch_size"], o["actor_rollout_ref.rollout.n"]) == ("8", "4")
    assert o["data.max_response_length"] == "512" and o["trainer.total_training_steps"] == "3"
    assert o["trainer.n_gpus_per_node"] == "1" and o["trainer.logger"] == "[console]"
    assert o["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    assert o["actor_rollout_ref.model.path"] == "/models/qwen"
    assert o["data.train_files"] == f"{tmp_path}/train.parquet"
    assert Path(o["reward.custom_reward_function.path"]) == REPO / "tlt_rt/integrations/verl_reward.py"
    # no flash-attn on the GPU machine: padded sdpa
    assert o["actor_rollout_ref.model.use_remove_padding"] == "False"
    assert o["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert o["+actor_rollout_ref.rollout.engine_kwargs.tlt_rt.speculative"] == "auto"
    o = _overrides(tmp_path, SPEC="off", STEPS="2")
    assert o["+actor_rollout_ref.rollout.engine_kwargs.tlt_rt.speculative"] == "off"
    assert o["trainer.total_training_steps"] == "2"
