"""Held-out evaluation, the per-step perfect-drafter ceiling and the drafter curve (train/heldout.py,
Worker.evaluate / Worker.accept_ceiling / Worker.drafter_curve): what they measure, that they stay out of the
RL step, and their errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.runs import metrics, tiny_config
from tlt_rt.config import ConfigError, TLTConfig, load_config, to_dict
from tlt_rt.train import heldout
from tlt_rt.train.drafter.data import collect_hidden
from tlt_rt.train.drafter.eval import drafter_counts_by_shape, oracle_counts, oracle_steps
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


def test_drafter_curve_sums_workers_and_spreads_the_answers(monkeypatch):
    parts = [
        {"online": {"3_2_4": (30, 10), "2_1_3": (12, 8)}, "frozen": {"3_2_4": (20, 10), "2_1_3": (9, 8)}},
        {"online": {"3_2_4": (10, 10), "2_1_3": (8, 2)}, "frozen": {"3_2_4": (10, 10), "2_1_3": (3, 2)}},
    ]
    asked = []

    clock = [100.0]  # the workers' call takes 2.5 s of a fake clock; nothing else moves it

    def call_all(method, args):
        asked.append((method, args))
        clock[0] += 2.5
        return parts

    monkeypatch.setattr(heldout.time, "time", lambda: clock[0])
    pool = SimpleNamespace(size=2, call_all=call_all)
    got = heldout.drafter_curve(pool, 5, {"2_1_3": 40, "3_2_4": 3})
    assert asked == [("drafter_curve", [(3,), (2,)])]  # 5 answers over 2 workers
    assert got["drafter_accept_online_by_strategy"] == {"3_2_4": 2.0, "2_1_3": 2.0}
    assert got["drafter_accept_frozen_by_strategy"] == {"3_2_4": 1.5, "2_1_3": 1.2}
    assert got["drafter_accept_online"] == 2.0 and got["drafter_accept_frozen"] == 1.2  # the most used: 2_1_3
    assert heldout.drafter_curve(pool, 5, {"3_2_4": 1})["drafter_accept_frozen"] == 1.5
    assert got["drafter_curve_seconds"] == 2.5  # seconds (not ms) of that call, nothing else
    assert heldout.drafter_curve(pool, 0, {})["drafter_accept_online"] == 2.0  # nothing used: the first strategy
    assert asked[-1] == ("drafter_curve", [(None,), (None,)])  # 0: every answer
    parts[1] = {}  # a worker with no answers (a share of none) adds nothing
    assert heldout.drafter_curve(pool, 1, {})["drafter_accept_online_by_strategy"] == {"3_2_4": 3.0, "2_1_3": 1.5}
    pool.call_all = lambda method, args: [{}, {}]
    assert heldout.drafter_curve(pool, 5, {"2_1_3": 1}) == {}


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
    # without id 0 in the draft vocabulary, rows 2 and 3 (whose best is 0) rank 1 first: misses at x3=3 and
    # x4=0 (never drafted); rows 0, 1 and 4 still hit
    assert oracle_counts(target, [s], 0.0, topk=1, depth=8, vocab=torch.tensor([1, 2, 3])) == (6, 3)
    assert oracle_counts(target, [s], 0.0, topk=1, depth=8, vocab=torch.arange(4)) == (6, 2)


def test_worker_ceiling_and_evaluate_stay_out_of_the_step(tiny, tmp_path):
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
             for i, h, s in zip(ids, collect_hidden(w.learner_role.model, ids), res.samples, strict=True)]  # fmt: skip
    got = w.accept_ceiling()
    assert set(got) == {"3_2_4", "2_1_3"}
    assert got["3_2_4"] == oracle_counts(w.learner_role.model, dense, 1.0, 2, 3)
    assert got["2_1_3"] == oracle_counts(w.learner_role.model, dense, 1.0, 1, 2)
    tokens, steps = got["3_2_4"]
    assert steps >= 2 and steps <= tokens <= 4 * steps
    assert w.accept_ceiling() == {}  # read once per rollout
    # evaluation: nothing reaches the drafter's buffer or the engine's timeline
    buffer, engine = w.drafter_role.buffer, w.rollout_role.engine
    n_buf, n_line = buffer.num_tokens, len(engine.timeline)
    greedy = dict(n=1, temperature=0.0, max_new_tokens=5, seed=0)
    out = w.evaluate(prompts, greedy)
    assert buffer.num_tokens == n_buf and len(engine.timeline) == n_line and w.accept_ceiling() == {}
    from tlt_rt.rollout import SamplingParams

    again = engine.generate(prompts, SamplingParams(**greedy))
    assert [s.token_ids for s in out] == [c.token_ids for c in again]
    assert w.evaluate([], greedy) == []


def test_loop_logs_held_out_accuracy_the_ceiling_and_the_drafter_curve(ray_cluster, tiny, tmp_path):
    data = tiny / "data.jsonl"
    cfg = tiny_config(tiny, tmp_path, "ev", "cluster.num_workers=1", f"task.eval_path={data}", "logging.eval_every=1",
                      "logging.eval_prompts=3", "drafter.train_online=true", "logging.drafter_curve=true",
                      "logging.drafter_curve_answers=5")  # fmt: skip
    records = train(cfg)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert 0.0 <= r["heldout_accuracy"] <= 1.0 and r["eval_seconds"] > 0
        assert r["accept_ceiling"] >= 1.0 and set(r["accept_ceiling_by_strategy"]) == {"3_2_4"}
        assert len(r["response_lengths"]) == 12 and r["response_len_p99"] <= r["response_len_max"]
        for key in ("drafter_accept_online", "drafter_accept_frozen"):
            assert 1.0 <= r[key] <= 4.0 and r[f"{key}_by_strategy"] == {"3_2_4": r[key]}
        assert r["drafter_curve_seconds"] > 0
    # the frozen drafter is the run's untrained one: about one token per step; the online one is the same
    # drafter until it has trained
    assert all(r["drafter_accept_frozen"] < 1.5 for r in records)
    trained = [sum(r["spot_steps"] for r in records[: i + 1]) for i in range(len(records))]
    for r, steps in zip(records, trained, strict=True):
        if not steps:
            assert r["drafter_accept_online_by_strategy"] == r["drafter_accept_frozen_by_strategy"]
    assert metrics(Path(tmp_path) / "ev")[1]["drafter_accept_online"] == records[1]["drafter_accept_online"]
    assert "heldout_accuracy_end" in records[-1] and "heldout_accuracy_end" not in records[0]
    assert metrics(Path(tmp_path) / "ev")[1]["heldout_accuracy"] == records[1]["heldout_accuracy"]
    # a run with speculation off logs no ceiling and no drafter curve: it keeps no hidden states
    off = train(tiny_config(tiny, tmp_path, "off", "cluster.num_workers=1", "rl.steps=1",
                            "rollout.speculative=off", "logging.drafter_curve=true"))  # fmt: skip
    assert "accept_ceiling" not in off[0] and "heldout_accuracy" not in off[0]
    assert not any(k.startswith(("drafter_accept", "drafter_curve")) for k in off[0])


def test_loop_logs_no_drafter_curve_unless_asked(ray_cluster, tiny, tmp_path):
    plain = train(tiny_config(tiny, tmp_path, "plain", "cluster.num_workers=1", "rl.steps=1",
                              "drafter.train_online=true"))  # fmt: skip
    assert plain[0]["accept_ceiling"] >= 1.0
    assert not any(k.startswith(("drafter_accept", "drafter_curve")) for k in plain[0])


def curve_worker(tiny, tmp_path, name="w"):
    from tlt_rt.train.cluster.worker import Worker

    cfg = tiny_config(tiny, tmp_path, name, "drafter.train_online=true", "logging.drafter_curve=true",
                      "rollout.strategies=[3_2_4,2_1_3]", "drafter.lr=1e-2", "drafter.batch_tokens=64",
                      "drafter.tail_training=off")  # fmt: skip
    return Worker(0, 1, to_dict(cfg), str(tmp_path / name))


CURVE_SHAPES = {"3_2_4": (2, 3), "2_1_3": (1, 2)}
CURVE_PROMPTS = [[1, 2, 3], [4, 5]]
CURVE_PARAMS = dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=12, seed=3)


def test_worker_drafter_curve_online_moves_and_frozen_stays(tiny, tmp_path):
    w = curve_worker(tiny, tmp_path)
    start = {k: v.clone() for k, v in w.drafter_role.frozen.state_dict().items()}
    w.rollout(0, CURVE_PROMPTS, CURVE_PARAMS)
    fixed = list(w.rollout_role._answers["curve"])  # the step's answers, as the worker keeps them
    assert len(fixed) == 4
    got = w.drafter_curve(None)
    # the values are the evaluation's own, of the serving drafter and of the frozen copy, on those answers
    assert got == {"online": drafter_counts_by_shape(w.drafter_role.serving, fixed, CURVE_SHAPES),
                   "frozen": drafter_counts_by_shape(w.drafter_role.frozen, fixed, CURVE_SHAPES)}  # fmt: skip
    assert got["online"] == got["frozen"]  # nothing trained yet
    tokens, steps = got["frozen"]["3_2_4"]
    assert tokens / steps < 1.5  # an untrained drafter: about one token per step
    assert w.drafter_curve(None) == {}  # read once per rollout
    assert set(w.accept_ceiling()) == set(CURVE_SHAPES)  # the ceiling reads the same answers on its own
    # the online drafter learns this policy's "1", "2" and spaces; the frozen copy stays where the run started
    for _ in range(30):
        w.drafter_role.trainer.step()
    w.merge_drafter(30, 30)
    online = drafter_counts_by_shape(w.drafter_role.serving, fixed, CURVE_SHAPES)
    frozen = drafter_counts_by_shape(w.drafter_role.frozen, fixed, CURVE_SHAPES)
    assert frozen == got["frozen"]
    assert all(torch.equal(v, start[k]) for k, v in w.drafter_role.frozen.state_dict().items())
    accept = {name: {k: e / n for k, (e, n) in c.items()} for name, c in (("online", online), ("frozen", frozen))}
    # of at most ~1.5 (top-1) and ~2.3 (top-2) here: the policy picks among three tokens at T = 1
    assert all(accept["online"][k] > accept["frozen"][k] + 0.3 for k in CURVE_SHAPES), accept
    # the next step's answers, sub-sampled evenly: 2 of 4
    w.rollout(1, CURVE_PROMPTS, CURVE_PARAMS)
    answers = list(w.rollout_role._answers["curve"])
    picked = [answers[0], answers[2]]
    got = w.drafter_curve(2)
    assert got == {"online": drafter_counts_by_shape(w.drafter_role.serving, picked, CURVE_SHAPES),
                   "frozen": drafter_counts_by_shape(w.drafter_role.frozen, picked, CURVE_SHAPES)}  # fmt: skip
    assert got["online"]["3_2_4"][0] / got["online"]["3_2_4"][1] > got["frozen"]["3_2_4"][0] / got["frozen"]["3_2_4"][1]


def test_resumed_worker_keeps_the_runs_starting_drafter_frozen(tiny, tmp_path):
    w = curve_worker(tiny, tmp_path)
    w.rollout(0, CURVE_PROMPTS, CURVE_PARAMS)
    for _ in range(3):
        w.drafter_role.trainer.step()
    w.merge_drafter(3, 3)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    w.save_checkpoint(str(folder))
    from tlt_rt.train.cluster.worker import Worker

    again = Worker(0, 1, to_dict(w.cfg), str(tmp_path / "w"), policy_path=str(folder / "policy"))
    again.load_checkpoint(str(folder))
    frozen, resumed = again.drafter_role.frozen.state_dict(), again.drafter_role.serving.state_dict()
    assert all(torch.equal(v, w.drafter_role.frozen.state_dict()[k]) for k, v in frozen.items())
    assert all(torch.equal(v, w.drafter_role.serving.state_dict()[k]) for k, v in resumed.items())
    assert not torch.equal(frozen["fc.weight"], resumed["fc.weight"])
    assert curve_worker(tiny, tmp_path, "plain").drafter_role.frozen is not None
    off = tiny_config(tiny, tmp_path, "off", "drafter.train_online=true")
    assert Worker(0, 1, to_dict(off), str(tmp_path / "off")).drafter_role.frozen is None
