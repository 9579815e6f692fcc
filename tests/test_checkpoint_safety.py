"""Checkpoint files hold tensors and plain containers only: they load with weights_only=True, and a file that
pickles anything else is refused with an error naming it, before it can run code."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tlt_rt.train.rl import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Stands in for what an attacker pickles: unpickling it would call `os.system`."""

    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_rng_state_round_trips_through_weights_only(tmp_path):
    path = tmp_path / "worker_0.pt"
    torch.save({"rng": ckpt.rng_state(), "sd_policy": {"version": 1, "hist": {"a": {"1": 2}}}}, path)
    want = (torch.rand(3), random.random(), np.random.rand(3))
    torch.rand(5), random.random(), np.random.rand(7)  # move every stream on
    state = ckpt.load_pt(path)
    ckpt.set_rng_state(state["rng"])
    got = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])


def test_optimizer_state_loads_with_weights_only(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save({"optimizer": opt.state_dict(), "version": 3, "master": [p.detach() for p in model.parameters()]},
               tmp_path / "learner.pt")  # fmt: skip
    state = ckpt.load_pt(tmp_path / "learner.pt")
    assert state["version"] == 3
    torch.optim.AdamW(model.parameters(), lr=1e-3).load_state_dict(state["optimizer"])


def test_pickled_object_is_refused(tmp_path):
    path = tmp_path / "learner.pt"
    torch.save({"optimizer": {}, "evil": Payload()}, path)
    with pytest.raises(ckpt.CheckpointError, match=r"learner\.pt: refused to load: it holds pickled Python objects"):
        ckpt.load_pt(path)
    with pytest.raises(ckpt.CheckpointError, match="posix.system|os.system|nt.system"):
        ckpt.verify_pt_files(tmp_path)


def test_garbage_file_is_named(tmp_path):
    (tmp_path / "worker_0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match=r"worker_0\.pt"):
        ckpt.load_pt(tmp_path / "worker_0.pt")


def test_no_unsafe_load_in_the_package():
    for f in (ROOT / "tlt_rt").rglob("*.py"):
        assert "weights_only=False" not in f.read_text(), f


def _fake_run(tmp_path: Path, name: str, payload: bool) -> Path:
    step = tmp_path / name / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"step": 1}')
    (step / ckpt.MARKER).write_text("ok\n")
    torch.save({"optimizer": {}, "version": 1, **({"evil": Payload()} if payload else {})}, step / "learner.pt")
    return step


def test_resume_from_a_pickled_checkpoint_is_refused_by_the_cli(tmp_path):
    _fake_run(tmp_path, "shared", payload=True)
    proc = subprocess.run(
        [sys.executable, "-m", "tlt_rt.train", f"output_dir={tmp_path}", "name=shared", "resume=true"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: ") and "learner.pt: refused to load" in lines[0]
    assert "pwned" not in proc.stdout


def test_resume_from_a_truncated_policy_is_refused(capsys, tmp_path):
    from tlt_rt.models import save_target
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.llama import CausalLM
    from tlt_rt.train.__main__ import main as train_main

    step = _fake_run(tmp_path, "cut", payload=False)
    arch = ArchConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)  # fmt: skip
    weights = save_target(CausalLM(arch), step / "policy") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert train_main([f"output_dir={tmp_path}", "name=cut", "resume=true", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: checkpoint {step} cannot be resumed: {weights}: ")
    assert "truncated safetensors file" in err
