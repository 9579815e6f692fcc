"""Run checkpoints: one folder per saved RL step, written to a staging folder and renamed into place.

    runs/<name>/checkpoints/step_000002/     (the number of completed RL steps)
        policy/          the policy in HF layout (config.json, model.safetensors, tokenizer)
        learner.pt       policy optimizer state (+ fp32 master weights), learner version
        drafter/         drafter weights (safetensors), its optimizer, trainer step count and noise RNG
        worker_<r>.pt    per worker: RNG states and the SD policy's learned state
        state.json       next step, prompt cursor, driver RNG, learner version
        COMPLETE         written last: a folder without it is ignored

The .pt files hold tensors and plain containers only and are read with `torch.load(weights_only=True)`:
a checkpoint from someone else (a shared run folder, a download) cannot run code when it is resumed.

Workers write their parts directly, so output_dir must be on a file system every worker sees.
Not saved: the drafter's training buffer (hidden states of recent steps; refilled by the next rollouts).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint file that cannot or must not be loaded; the message names the file."""


def load_pt(path: str | Path, mmap: bool = False) -> Any:
    """A .pt file of tensors and plain containers; a file that pickles anything else is refused, since
    unpickling it could run code."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it holds pickled Python objects ({_offending_global(str(e))}), and "
            "unpickling them could run code; tlt_rt checkpoints hold only tensors and plain containers"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read as a checkpoint file: {str(e).splitlines()[0]}") from e


def _offending_global(text: str) -> str:
    """The line of torch's weights-only error that names what was refused (the rest advises switching the check off)."""
    for line in text.splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip().removeprefix("WeightsUnpickler error: ").rstrip(".")
    return "not plain tensors and containers"


def verify_pt_files(folder: str | Path) -> None:
    """Check, without reading the tensor data (mmap), that every .pt file under `folder` loads safely."""
    for f in sorted(Path(folder).rglob("*.pt")):
        load_pt(f, mmap=True)


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
    """Every RNG's state as tensors and plain containers (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "python": python_rng_state(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    set_python_rng_state(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
