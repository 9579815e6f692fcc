"""Bad input on the command line: one `config error:` line naming the key and the file, no traceback, and no
run folder left behind. Most cases call the CLI's main in-process (an uncaught exception fails the test);
the ones that would start a run go through a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tlt_rt.models import save_target
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM
from tlt_rt.train.__main__ import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ArchConfig(
    model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128, eos_token_ids=(1,),
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_target(CausalLM(TINY), tmp_path_factory.mktemp("tiny") / "policy")


@pytest.fixture
def truncated(model_dir, tmp_path):
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    data = (model_dir / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # a copy cut short
    return bad


def one_line_error(capsys, argv: list[str], prefix: str = "config error: ") -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(prefix), err
    return err


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tlt_rt.train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def test_truncated_safetensors_named_by_dry_run(capsys, truncated):
    err = one_line_error(capsys, ["--dry-run", f"model.path={truncated}"])
    assert f"model.path: {truncated / 'model.safetensors'}: truncated safetensors file" in err


def test_truncated_safetensors_fails_before_the_run(truncated, tmp_path):
    proc = run_cli(f"model.path={truncated}", f"output_dir={tmp_path / 'runs'}", "name=r", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: model.path: {truncated / 'model.safetensors'}: ")
    assert "truncated safetensors file" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # no run folder left behind


def test_missing_model_path_leaves_no_run_folder(tmp_path):
    proc = run_cli("model.path=/nonexistent/model", f"output_dir={tmp_path / 'runs'}", "name=r", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["config error: model.path: /nonexistent/model does not exist"]
    assert not (tmp_path / "runs").exists()


def test_missing_dataset_caught_by_dry_run(capsys, tmp_path):
    err = one_line_error(capsys, ["--dry-run", "task.kind=jsonl", f"task.path={tmp_path / 'nope.jsonl'}"])
    assert err == f"config error: task.path: dataset file not found: {tmp_path / 'nope.jsonl'}"


def test_non_utf8_dataset_named(capsys, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"question": "caf\u00e9", "answer": "1"}, ensure_ascii=False).encode("latin-1"))
    err = one_line_error(capsys, ["--dry-run", "task.kind=jsonl", f"task.path={path}"])
    assert f"task.path: {path}: not UTF-8 text (byte 0xe9 at offset" in err and "line 1" in err


def test_bad_dataset_record_named(capsys, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n{"question": "b"\n')
    err = one_line_error(capsys, ["--dry-run", "task.kind=jsonl", f"task.path={path}"])
    assert f"task.path: {path}: line 2 is not valid JSON" in err


def test_resume_with_a_misspelt_name(capsys, tmp_path):
    (tmp_path / "smollm2-arith").mkdir()
    err = one_line_error(capsys, ["--dry-run", f"output_dir={tmp_path}", "name=smolm2-arith", "resume=true"])
    assert "resume: is true but there is no run" in err and "did you mean name=smollm2-arith?" in err


def test_reward_and_logger_errors(capsys, monkeypatch):
    err = one_line_error(capsys, ["--dry-run", "task.reward=no_such_module_xyz:score"])
    assert err.startswith("config error: task.reward: cannot import 'no_such_module_xyz'")
    err = one_line_error(capsys, ["--dry-run", "task.reward=json:no_such_function"])
    assert (
        err == "config error: task.reward: 'json' has no function 'no_such_function' (reward 'json:no_such_function')"
    )
    err = one_line_error(capsys, ["--dry-run", "task.reward=exact"])
    assert "task.reward: must be 'numeric', 'math_verify' or 'module:function'" in err
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # nothing optional is installed
    err = one_line_error(capsys, ["--dry-run", "logging.loggers=[jsonl, wandb]"])
    assert err == ("config error: logging.loggers: wandb is not installed: pip install wandb (or 'tlt_rt[wandb]'), "
                   "or drop it from logging.loggers")  # fmt: skip
    err = one_line_error(capsys, ["--dry-run", "task.reward=math_verify"])
    assert "math_verify needs the math-verify package: pip install 'tlt_rt[math]'" in err


@pytest.mark.parametrize(
    "override, ours",
    [
        ("actor_rollout_ref.rollout.n=8", "rl.group_size"),
        ("rl.num_generations=8", "rl.group_size"),
        ("rl.epsilon_high=0.28", "rl.clip_high"),
        ("rollout.max_tokens=64", "rollout.max_new_tokens"),
        ("rl.beta=0.01", "rl.kl_coef"),
        ("model.torch_dtype=bfloat16", "model.dtype"),
        ("actor_rollout_ref.rollout.temperature=1.0", "rollout.temperature"),
    ],
)
def test_other_trainers_knob_names(capsys, override, ours):
    err = one_line_error(capsys, ["--dry-run", override])
    assert f"unknown key; did you mean '{ours}'?" in err


def test_knob_names_in_a_yaml_file(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("rl:\n  num_generations: 8\n")
    err = one_line_error(capsys, [str(tmp_path / "c.yaml"), "--dry-run"])
    assert err == "config error: rl.num_generations: unknown key; did you mean 'rl.group_size'? " \
                  "('num_generations' is TRL's name for it)"  # fmt: skip
