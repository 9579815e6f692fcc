"""Training runs with the tiny policy of conftest.py's `tiny` fixture: their config, and what a run wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tlt_rt.config import TLTConfig, load_config


def tiny_config(tiny: Path, out: Path, name: str, *extra: str) -> TLTConfig:
    return load_config(TLTConfig, overrides=[
        f"name={name}", f"output_dir={out}", f"model.path={tiny / 'policy'}", "model.max_context=256",
        "task.kind=jsonl", f"task.path={tiny / 'data.jsonl'}", "rollout.max_new_tokens=4",
        "rollout.speculative=on", "rollout.strategies=[3_2_4]", "rl.prompts_per_step=3", "rl.group_size=4",
        "rl.lr=1e-3", "rl.micro_batch=3", "rl.steps=2", "drafter.train_online=false", "tensorboard=false",
        *extra,
    ])  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def policy_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))
