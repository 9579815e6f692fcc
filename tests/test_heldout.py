"""Held-out evaluation and the per-step perfect-drafter ceiling (train/heldout.py, Worker.evaluate /
Worker.accept_ceiling): what they measure, that they stay out of the RL step, and their errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.test_train_loop import metrics, ray_cluster, tiny, tiny_config  # noqa: F401  (fixtures)
from tlt_rt.config import ConfigError, TLTConfig, load_config, to_dict
from tlt_rt.train import heldout
from tlt_rt.train.drafter.data import collect_hidden
from tlt_rt.train.drafter.eval import oracle_counts, oracle_steps
from tlt_rt.train.loop import make_source, train
from tlt_rt.train.rl.tasks import ArithmeticTask


def test_held_out_arithmetic_problems_are_not_training_problems():
    cfg = load_config(TLTConfig, overrides=["task.digits=1", "task.num_ops=2", "task.ops=[+,-]",
                                            "logging.eval_every=5", "logging.eval_prompts=40"])  # fmt: skip
    held = heldout.held_out_problems(cfg)
    assert len(held) == 40 and all(set(p.meta["ops"]) <= {"+", "-"} for p in held)
    source = make_source(cfg)
    train_qs = {p.question for _ in range(20) for p in source.next_batch()}
    assert not train_qs & {p.question for p in held}
    # the same config gives the same held-out set: runs are compared on the same problems
    assert [p.question for p in heldout.held_out_problems(cfg)] == [p.question for p in held]
    assert heldout.held_out_problems(load_config(TLTConfig, overrides=["logging.eval_every=0"])) == []


def test_held_out_file_tasks_need_eval_path(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
    cfg = load_config(TLTConfig, overrides=["task.kind=jsonl", f"task.path={data}", "logging.eval_every=1"])
    with pytest.raises(ConfigError, match="task.eval_path"):
        heldout.held_out_problems(cfg)
    cfg = load_config(TLTConfig, overrides=["task.kind=jsonl", f"task.path={data}", f"task.eval_path={data}",
                                            "logging.eval_every=1", "logging.eval_prompts=3"])  # fmt: skip
    assert [p.answer for p in heldout.held_out_problems(cfg)] == ["0", "1", "2"]


@pytest.mark.parametrize("bad", ["task.ops=[]", "task.ops=[+,^]", "logging.eval_every=-1", "logging.eval_prompts=0"])
def test_bad_eval_and_ops_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        load_config(TLTConfig, overrides=[bad])


def test_arithmetic_task_ops_option_reaches_the_generator():
    cfg = load_config(TLTConfig, overrides=['task.ops=["*"]', "task.num_ops=1", "task.word_problems=false"])
    problems = make_source(cfg).next_batch()
    assert problems and all(p.meta["ops"] == ["*"] for p in problems)
    assert all(p.meta == ArithmeticTask(2, 1, False, 0, ops=("*",)).problem(p.meta["index"]).meta for p in problems)


def test_accept_ceiling_sums_workers_and_picks_the_most_used_strategy():
    parts = [{"3_2_4": (30, 10), "2_1_3": (12, 8)}, {"3_2_4": (10, 10), "2_1_3": (8, 2)}]
    pool = SimpleNamespace(size=2, call_all=lambda method, args: parts if method == "accept_ceiling" else None)
    got = heldout.accept_ceiling(pool, {"2_1_3": 40, "3_2_4": 3})
    assert got["accept_ceiling_by_strategy"] == {"3_2_4": 2.0, "2_1_3": 2.0} and got["accept_ceiling"] == 2.0
    parts[1]["2_1_3"] = (18, 2)
    assert heldout.accept_ceiling(pool, {"2_1_3": 40})["accept_ceiling"] == 3.0
    assert heldout.accept_ceiling(pool, {})["accept_ceiling"] == 2.0  # nothing used: the first strategy
    pool.call_all = lambda method, args: [{}, {}]
    assert heldout.accept_ceiling(pool, {"2_1_3": 1}) == {}


def test_oracle_counts_by_hand():
    # a target whose head is the identity on a 4-token vocabulary: the top-1 at row t is argmax(hidden[t])
    target = SimpleNamespace(model=SimpleNamespace(norm=lambda h: h), lm_head=SimpleNamespace(weight=torch.eye(4)))
    ids = torch.tensor([0, 1, 2, 3, 0, 1])
    hidden = torch.nn.functional.one_hot(torch.tensor([1, 2, 0, 0, 1, 3]), 4).float()  # rows predict x_{t+1}
    s = dict(ids=ids, hidden=hidden, prompt_len=1)
    # rows 0..4 predict 1 (hit), 2 (hit), 0 (miss: x3=3), 0 (hit), 1 (hit)
    assert oracle_counts(target, [s], 0.0, topk=1, depth=8) == (6, 2)  # [hit, hit, miss] + [hit, hit, end]
    assert oracle_counts(target, [s], 0.0, topk=1, depth=1) == (5, 3)  # [hit] [miss] [hit], then the end
    assert oracle_steps(target, [s], 0.0, topk=1, depth=8) == 3.0


def test_worker_ceiling_and_evaluate_stay_out_of_the_step(tiny, tmp_path):  # noqa: F811
    from tlt_rt.train.cluster.worker import Worker

    cfg = tiny_config(tiny, tmp_path, "w", "drafter.train_online=true", "rollout.strategies=[3_2_4,2_1_3]")
    w = Worker(0, 1, to_dict(cfg), str(tmp_path / "w"))
    prompts = [[1, 2, 3], [4, 5]]
    params = dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6, seed=3)
    res = w.rollout(0, prompts, params)
    # the ceiling on the rollout's own answers, from the engine's hidden rows, equals the one from a dense
    # forward of the same tokens
    ids = [torch.tensor(prompts[s.prompt_index] + s.token_ids[:-1]) for s in res.samples]
    dense = [dict(ids=i, hidden=h, prompt_len=len(prompts[s.prompt_index]))
             for i, h, s in zip(ids, collect_hidden(w.model, ids), res.samples, strict=True)]  # fmt: skip
    got = w.accept_ceiling()
    assert set(got) == {"3_2_4", "2_1_3"}
    assert got["3_2_4"] == oracle_counts(w.model, dense, 1.0, 2, 3)
    assert got["2_1_3"] == oracle_counts(w.model, dense, 1.0, 1, 2)
    tokens, steps = got["3_2_4"]
    assert steps >= 2 and steps <= tokens <= 4 * steps
    assert w.accept_ceiling() == {}  # read once per rollout
    # evaluation: nothing reaches the drafter's buffer or the engine's timeline
    n_buf, n_line = w.buffer.num_tokens, len(w.engine.timeline)
    greedy = dict(n=1, temperature=0.0, max_new_tokens=5, seed=0)
    out = w.evaluate(prompts, greedy)
    assert w.buffer.num_tokens == n_buf and len(w.engine.timeline) == n_line and w.accept_ceiling() == {}
    from tlt_rt.rollout import SamplingParams

    again = w.engine.generate(prompts, SamplingParams(**greedy))
    assert [s.token_ids for s in out] == [c.token_ids for c in again]
    assert w.evaluate([], greedy) == []


def test_loop_logs_held_out_accuracy_and_the_ceiling(ray_cluster, tiny, tmp_path):  # noqa: F811
    data = tiny / "data.jsonl"
    cfg = tiny_config(tiny, tmp_path, "ev", "cluster.num_workers=1", f"task.eval_path={data}", "logging.eval_every=1",
                      "logging.eval_prompts=3", "drafter.train_online=true")  # fmt: skip
    records = train(cfg)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert 0.0 <= r["heldout_accuracy"] <= 1.0 and r["eval_seconds"] > 0
        assert r["accept_ceiling"] >= 1.0 and set(r["accept_ceiling_by_strategy"]) == {"3_2_4"}
        assert len(r["response_lengths"]) == 12 and r["response_len_p99"] <= r["response_len_max"]
    assert "heldout_accuracy_end" in records[-1] and "heldout_accuracy_end" not in records[0]
    assert metrics(Path(tmp_path) / "ev")[1]["heldout_accuracy"] == records[1]["heldout_accuracy"]
    # a run with speculation off logs no ceiling: it keeps no hidden states
    off = train(tiny_config(tiny, tmp_path, "off", "cluster.num_workers=1", "rl.steps=1",
                            "rollout.speculative=off"))  # fmt: skip
    assert "accept_ceiling" not in off[0] and "heldout_accuracy" not in off[0]
