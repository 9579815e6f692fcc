"""Optional metric loggers beside metrics.jsonl: TensorBoard (RUN/tb) and wandb (offline by default).

`check_loggers` runs before a run starts, so a logger that is asked for but not installed is a one-line
config error rather than a silent gap in the logs.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard (or 'tlt_rt[tensorboard]')"),
    "wandb": ("wandb", "pip install wandb (or 'tlt_rt[wandb]')"),
}


def check_loggers(names: Sequence[str]) -> None:
    """Raise ValueError for the first logger in `names` whose package is not installed."""
    for name in names:
        if name in INSTALL and importlib.util.find_spec(INSTALL[name][0]) is None:
            raise ValueError(f"{name} is not installed: {INSTALL[name][1]}, or drop it from logging.loggers")


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}


class TensorBoardLogger:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # local: optional extra (tlt_rt[tensorboard])

        self._w = SummaryWriter(str(folder))

    def log(self, record: dict[str, Any], step: int) -> None:
        for k, v in _scalars(record).items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbLogger:
    """One wandb run per tlt_rt run (its id from the run name, so a resumed run continues it)."""

    def __init__(self, run_dir: Path, name: str, project: str, mode: str) -> None:
        import wandb  # local: optional extra (tlt_rt[wandb])

        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:64]
        self._run = wandb.init(project=project, name=name, id=run_id, dir=str(run_dir), mode=mode, resume="allow")

    def log(self, record: dict[str, Any], step: int) -> None:
        self._run.log(_scalars(record), step=step)

    def close(self) -> None:
        self._run.finish()


def open_loggers(names: Sequence[str], run_dir: Path, run_name: str, project: str = "tlt_rt", mode: str = "offline"):
    """The loggers named (jsonl is MetricsWriter's own and needs none here)."""
    check_loggers(names)
    out: list = []
    if "tensorboard" in names:
        out.append(TensorBoardLogger(run_dir / "tb"))
    if "wandb" in names:
        out.append(WandbLogger(run_dir, run_name, project, mode))
    return out
