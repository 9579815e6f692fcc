"""Checks that read the file system, run before a run folder, a Ray cluster or a worker exists: the model
folder is whole, the dataset reads, the reward and loggers import, a resumed run exists and its checkpoint
files load safely. Each failure is one `ConfigError` naming the key and the file, so the command line prints
one line (`config error: task.path: data.jsonl: not UTF-8 ...`) instead of a traceback from a worker.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from tlt_rt.models.default import default_gguf, fetched_gguf, not_fetched
from tlt_rt.models.loader import check_model_folder
from tlt_rt.models.registry import MODELS
from tlt_rt.options import ConfigError
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.rl import checkpoint as ckpt
from tlt_rt.train.rl.data import ReasoningGymTask, load_dataset_file
from tlt_rt.train.rl.loggers import check_loggers as check_logger_names
from tlt_rt.train.rl.reasoning_gym_task import UnknownDatasetError
from tlt_rt.train.rl.reward import resolve_reward


def check_model(cfg: TLTConfig, dry_run: bool = False) -> None:
    """model.path names a whole model: config.json parses, every safetensors file is complete. A dry run
    of a checkpoint that is not on this machine is allowed when model.arch gives its shape, and of a
    registered model not fetched yet (the registry gives its shape)."""
    path = cfg.model.path
    if path == "smollm2":
        try:
            default_gguf()
        except FileNotFoundError as e:
            raise ConfigError("model.path", str(e)) from e
        return
    if path in MODELS:  # its fetch checked the file's size and SHA-256; the first load converts it
        if not dry_run and not fetched_gguf(path).is_file():
            raise ConfigError("model.path", not_fetched(path))
        return
    p = Path(path).expanduser()
    if not p.exists():
        if dry_run and cfg.model.arch is not None:
            return
        hint = "; for a dry run of a checkpoint that is not on this machine set model.arch (see --help-config)"
        raise ConfigError("model.path", f"{p} does not exist{hint if dry_run else ''}")
    if p.suffix == ".gguf":
        return  # converted (and checked) on first load; a dry run must not dequantise it
    try:
        check_model_folder(p)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError("model.path", str(e)) from e


def planned_elsewhere(cfg: TLTConfig) -> bool:
    """A dry run for another machine: the model is not here and model.arch gives its shape."""
    return cfg.model.arch is not None and cfg.model.path != "smollm2" and not Path(cfg.model.path).expanduser().exists()


def check_dataset(cfg: TLTConfig, dry_run: bool = False) -> int:
    """The dataset file reads into problems; returns how many (0 for a generated task, -1 for a dry run planned
    for another machine, whose dataset is not here either). A reasoning-gym task must import, build with its
    options and make its first problem."""
    t = cfg.task
    if t.kind == "arithmetic":
        return 0
    if t.kind == "reasoning_gym":
        try:
            task = ReasoningGymTask.from_config(t)
        except ImportError as e:
            raise ConfigError("task.kind", str(e)) from e
        except UnknownDatasetError as e:
            raise ConfigError("task.rg_dataset", str(e)) from e
        except ValueError as e:
            raise ConfigError("task.rg_config", str(e)) from e
        try:
            task.problem(0)
        except Exception as e:  # the dataset's own generator, on options its config let through
            raise ConfigError("task.rg_config", f"{t.rg_dataset} cannot make a problem: {type(e).__name__}: {e}") from e
        return 0
    if dry_run and planned_elsewhere(cfg) and not Path(t.path).expanduser().exists():
        return -1
    try:
        return len(load_dataset_file(t.path, t.question_field, t.answer_field))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError("task.path", str(e)) from e


def check_reward(cfg: TLTConfig) -> None:
    try:
        resolve_reward(cfg.task.reward)
    except ValueError as e:
        raise ConfigError("task.reward", str(e)) from e


def check_loggers(cfg: TLTConfig) -> None:
    names = list(cfg.logging.loggers) + (["tensorboard"] if cfg.tensorboard else [])
    try:
        check_logger_names(names)
    except ValueError as e:
        raise ConfigError("logging.loggers", str(e)) from e


def check_resume(cfg: TLTConfig) -> None:
    """resume=true needs the run folder (a misspelt name must not quietly start a new run); its latest
    checkpoint's .pt files must load without running code and its policy folder must be whole."""
    if not cfg.resume:
        return
    run_dir = Path(cfg.output_dir) / cfg.name
    if not run_dir.is_dir():
        out = Path(cfg.output_dir)
        runs = sorted(p.name for p in out.iterdir() if p.is_dir()) if out.is_dir() else []
        close = difflib.get_close_matches(cfg.name, runs, n=1, cutoff=0.6)
        hint = f"; did you mean name={close[0]}?" if close else (f"; runs there: {', '.join(runs[:8])}" if runs else "")
        raise ConfigError("resume", f"is true but there is no run {run_dir} to resume{hint}")
    last = ckpt.latest_checkpoint(run_dir)
    if last is not None:
        ckpt.verify_pt_files(last)
        try:
            check_model_folder(last / "policy")
        except (FileNotFoundError, ValueError) as e:
            raise ckpt.CheckpointError(f"checkpoint {last} cannot be resumed: {e}") from e


def preflight(cfg: TLTConfig, dry_run: bool = False) -> list[str]:
    """Every check above, cheapest first; returns notes on what a dry run could not check here."""
    check_reward(cfg)
    check_loggers(cfg)
    check_resume(cfg)
    check_model(cfg, dry_run)
    if check_dataset(cfg, dry_run) < 0:
        return [f"note: task.path {cfg.task.path} is not on this machine either (not checked)"]
    return []
