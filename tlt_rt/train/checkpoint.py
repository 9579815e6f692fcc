"""Run checkpoints: one folder per saved RL step, written to a staging folder and renamed into place.

    runs/<name>/checkpoints/step_000002/     (the number of completed RL steps)
        policy/          the policy in HF layout (config.json, model.safetensors, tokenizer)
        learner.pt       policy optimizer state (+ fp32 master weights), learner version
        drafter/         drafter weights (safetensors), its optimizer, trainer step count and noise RNG
        worker_<r>.pt    per worker: RNG states and the SD policy's learned state
        state.json       next step, prompt cursor, driver RNG, learner version
        COMPLETE         written last: a folder without it is ignored

Workers write their parts directly, so output_dir must be on a file system every worker sees.
Not saved: the drafter's training buffer (hidden states of recent steps; refilled by the next rollouts).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def staging_dir(run_dir: str | Path, step: int) -> Path:
    """An empty folder to write step `step`'s checkpoint into before `commit`."""
    tmp = checkpoint_root(run_dir) / f".staging_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, run_dir: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write state.json, mark complete, rename into place and drop all but the newest `keep` checkpoints."""
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (tmp / MARKER).write_text("ok\n")
    final = step_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "state.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no state.json")
    return json.loads(path.read_text())


def python_rng_state() -> list:
    """The driver's `random` state as JSON-safe data."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
