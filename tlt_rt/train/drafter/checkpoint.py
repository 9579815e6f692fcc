"""The drafter trainer's checkpoint files and their writer.

A checkpoint is a folder: drafter.safetensors (the drafter's own weights, plus `d2t` when the draft vocabulary
is reduced), optimizer.pt, trainer.pt (step count, buffer cursor, noise generator state) and info.json (step,
architecture, draft vocabulary size, feature layers). `CheckpointWriter.save` copies every tensor to the CPU
first, then writes, from a background thread when asked, into a temporary folder that is renamed into place;
`wait()` joins it and re-raises its error.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def cpu_copy(obj):
    """Deep copy of a (nested) state dict with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def write_checkpoint(folder: Path, weights: dict, optimizer: dict, meta: dict, info: dict) -> None:
    """Write the checkpoint's files to `folder`, replacing it whole only once they are all written."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "drafter.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(meta, tmp / "trainer.pt")
    (tmp / "info.json").write_text(json.dumps(info, indent=2))
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(folder: Path) -> tuple[dict, dict, dict]:
    """(weights, optimizer state, trainer meta) of the checkpoint in `folder`."""
    if not (folder / "drafter.safetensors").is_file():
        raise FileNotFoundError(f"no drafter checkpoint in {folder} (expected drafter.safetensors)")
    weights = load_file(str(folder / "drafter.safetensors"))
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    meta = torch.load(folder / "trainer.pt", weights_only=True)
    return weights, optimizer, meta


class CheckpointWriter:
    """Writes one checkpoint at a time; a background write's error is raised by the next `wait`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, folder: Path, weights: dict, optimizer: dict, meta: dict, info: dict, async_: bool) -> None:
        """Wait for the write before, copy the state dicts to the CPU, write them (in the background if async_)."""
        self.wait()
        weights = {k: v.contiguous() for k, v in cpu_copy(weights).items()}
        optimizer = cpu_copy(optimizer)
        if not async_:
            write_checkpoint(folder, weights, optimizer, meta, info)
            return

        def run() -> None:
            try:
                write_checkpoint(folder, weights, optimizer, meta, info)
            except BaseException as e:  # handed to the caller by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="drafter-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until a background write finishes; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("writing the drafter checkpoint failed") from err
