"""Training runs with the tiny policy of conftest.py's `tiny` fixture: their config, and what a run wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tlt_rt.config import TLTConfig, load_config
from tlt_rt.train.rl.checkpoint import latest_checkpoint


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


# outcome of a step, equal between runs that must be equal (timings and drafter numbers excluded)
EXACT_KEYS = ("reward_mean", "accuracy", "response_len_p50", "response_len_max", "groups_dropped",
              "samples_trained", "loss", "grad_norm", "clip_low_share", "clip_high_share", "policy_version",
              "accept_length_hist", "generated_tokens")  # fmt: skip


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = (policy_weights(latest_checkpoint(run) / "policy") for run in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb, strict=True):
        assert {k: ra[k] for k in EXACT_KEYS} == {k: rb[k] for k in EXACT_KEYS}, ra["step"]
