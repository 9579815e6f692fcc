"""Formats users bring: verl's parquet and TRL's datasets as they are, task.instruction and task.reward,
sharded policy checkpoints, metrics files cut short by a crash, and the optional loggers."""

from __future__ import annotations

import json
import sys
import types
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers.runs import metrics, tiny_config
from tlt_rt.models import load_target, save_target
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM
from tlt_rt.report import write_report
from tlt_rt.train.loop import train
from tlt_rt.train.rl.data import Problem, format_prompt_text, load_dataset_file
from tlt_rt.train.rl.loggers import check_loggers, open_loggers
from tlt_rt.train.rl.metrics import MetricsWriter, read_jsonl
from tlt_rt.train.rl.reward import math_verify_reward, resolve_reward

VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "Reply with the number one. Let's think step by step and output the "
                                          "final answer after \"####\"."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "1"},
    "extra_info": {"split": "train", "index": 0, "answer": "One.\n#### 1", "question": "Reply with one."},
}  # fmt: skip
TRL_ROW = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say one."}],
           "solution": "$1$"}  # fmt: skip


def write_verl(path, n=6):
    pq.write_table(pa.Table.from_pylist([{**VERL_ROW, "extra_info": {**VERL_ROW["extra_info"], "index": i}}
                                         for i in range(n)]), path)  # fmt: skip
    return path


def write_trl(path, n=6):
    path.write_text("".join(json.dumps(TRL_ROW) + "\n" for _ in range(n)))
    return path


def length_reward(text: str, answer: str) -> float:
    """A user's own reward (task.reward=tests.test_formats:length_reward)."""
    return min(len(text), 10) / 10


# ----------------------------------------------------------------------------- datasets
def test_verl_parquet_loads_as_it_is(tmp_path):
    problems = load_dataset_file(write_verl(tmp_path / "gsm8k.parquet"))
    p = problems[0]
    assert p.answer == "1" and p.messages == VERL_ROW["prompt"]
    assert p.question.startswith("Reply with the number one.")


def test_trl_datasets_load_as_they_are(tmp_path):
    p = load_dataset_file(write_trl(tmp_path / "trl.jsonl"))[0]
    assert p.messages == TRL_ROW["prompt"] and p.question == "Say one." and p.answer == "$1$"
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "What is 2+2?", "ground_truth": "4"}) + "\n")
    p = load_dataset_file(tmp_path / "plain.jsonl")[0]
    assert p.messages is None and p.question == "What is 2+2?" and p.answer == "4"
    (tmp_path / "nested.jsonl").write_text(json.dumps({"q": {"text": "x?"}, "meta": {"gold": 7}}) + "\n")
    p = load_dataset_file(tmp_path / "nested.jsonl", "q.text", "meta.gold")[0]
    assert (p.question, p.answer) == ("x?", "7")


class _Tok:
    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " | ".join(f"{m['role']}: {m['content']}" for m in messages)


def test_instruction_is_appended_to_questions_not_to_chats():
    q = Problem("What is 2+2?", "4")
    assert format_prompt_text(q, _Tok(), instruction="Box it.") == "user: What is 2+2?\nBox it."
    assert format_prompt_text(q, _Tok(), instruction=None) == "user: What is 2+2?"
    chat = Problem("Say one.", "1", messages=TRL_ROW["prompt"])
    assert format_prompt_text(chat, _Tok(), instruction="Box it.") == "system: Be brief. | user: Say one."
    assert format_prompt_text(chat, object(), instruction="x") == "System: Be brief.\n\nUser: Say one.\n\nAssistant:"


# ----------------------------------------------------------------------------- rewards
def test_rewards_by_name_and_import_path():
    assert resolve_reward("numeric")("The answer is 72.", "72") == 1.0
    assert resolve_reward("tests.test_formats:length_reward") is length_reward
    pytest.importorskip("math_verify")
    assert math_verify_reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_verify_reward("it is 3", "$\\frac{1}{2}$") == 0.0
    assert math_verify_reward("", "1") == 0.0


# ----------------------------------------------------------------------------- one CPU step each
def test_verl_parquet_trains_one_step(ray_cluster, tiny, tmp_path, capsys):
    data = write_verl(tmp_path / "gsm8k.parquet")
    records = train(tiny_config(tiny, tmp_path, "verl", "rl.steps=1", "cluster.num_workers=1", "task.kind=parquet",
                                f"task.path={data}", "task.reward=tests.test_formats:length_reward"))  # fmt: skip
    assert len(records) == 1 and records[0]["samples_trained"] > 0  # the length reward differs within groups
    assert 0 < records[0]["reward_mean"] <= 1
    out = capsys.readouterr().out  # the step line, why SD ran or not, and the closing summary
    assert "[step 1/1 |" in out and "done: 1 step(s)" in out and "SD " in out and "why " in out
    assert f"report    python -m tlt_rt.report {tmp_path / 'verl'}" in out
    assert f"checkpoint {tmp_path / 'verl' / 'checkpoints' / 'step_000001'}" in out


def test_trl_dataset_trains_one_step(ray_cluster, tiny, tmp_path):
    pytest.importorskip("math_verify")
    data = write_trl(tmp_path / "trl.jsonl")
    records = train(tiny_config(tiny, tmp_path, "trl", "rl.steps=1", "cluster.num_workers=1", f"task.path={data}",
                                "task.reward=math_verify"))  # fmt: skip
    # the policy moves only when a group's rewards differed (GRPO drops the others)
    assert len(records) == 1 and records[0]["policy_version"] == int(records[0]["samples_trained"] > 0)
    assert metrics(tmp_path / "trl")[0]["step"] == 0


# ----------------------------------------------------------------------------- checkpoints
def test_policy_checkpoint_is_sharded_with_an_index(tmp_path):
    arch = ArchConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM(arch)
    folder = save_target(model, tmp_path / "policy", max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / s).is_file() for s in shards)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["dtype"] == "float32" and "torch_dtype" not in cfg
    loaded = load_target(folder)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    save_target(model, folder)  # saving again unsharded leaves no stale shards or index behind
    assert sorted(p.name for p in folder.glob("model*")) == ["model.safetensors"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(save_target(model, tmp_path / "hf", max_shard_size="20KB"))
    assert torch.equal(hf.model.norm.weight, model.model.norm.weight)


# ----------------------------------------------------------------------------- metrics files
def test_metrics_line_cut_short_is_tolerated(tmp_path):
    w = MetricsWriter(tmp_path)
    for s in range(3):
        w.write({"step": s, "reward_mean": 0.5, "accuracy": 0.5, "rollout_seconds": 1.0, "learner_seconds": 1.0})
    w.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')  # the crash came mid-write
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: line 4 was cut short"):
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (write_report(tmp_path)).is_file()  # the report reads it
        MetricsWriter(tmp_path, start_step=2).close()  # resume rewrites it whole
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert not list(tmp_path.glob("*.tmp"))


def test_metrics_line_broken_in_the_middle_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1,\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2 is not valid JSON"):
        read_jsonl(tmp_path / "metrics.jsonl")


# ----------------------------------------------------------------------------- loggers
def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    w = MetricsWriter(tmp_path, loggers=open_loggers(["jsonl", "tensorboard"], tmp_path, "run"))
    w.write({"step": 0, "reward_mean": 0.25, "note": "text is skipped"})
    w.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_wandb_logger_is_offline_by_default(tmp_path, monkeypatch):
    calls = {}

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((data, step))

        def finish(self):
            calls["finished"] = True

    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")
    fake.init = lambda **kw: calls.update(init=kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("tlt_rt.train.rl.loggers.importlib.util.find_spec", lambda name: object())
    w = MetricsWriter(tmp_path, loggers=open_loggers(["jsonl", "wandb"], tmp_path, "my run"))
    w.write({"step": 4, "reward_mean": 0.5, "flag": True})
    w.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["id"] == "my-run"
    assert calls["log"] == [({"reward_mean": 0.5}, 4)] and calls["finished"]


def test_missing_logger_says_how_to_install(monkeypatch):
    monkeypatch.setattr("tlt_rt.train.rl.loggers.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"tensorboard is not installed: pip install tensorboard"):
        check_loggers(["jsonl", "tensorboard"])
    check_loggers(["jsonl"])
