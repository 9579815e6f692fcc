"""The drafter's learning-rate schedule (`drafter.lr_schedule`), a function of the optimizer step count alone
so that a resumed trainer goes on where the schedule was."""

from __future__ import annotations

import math

from tlt_rt.train.drafter.config import DrafterConfig


def scheduled_lr(cfg: DrafterConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based) under `cfg.lr_schedule`: constant, or a linear rise
    over lr_warmup_steps then a cosine fall to lr_min_ratio * lr at lr_total_steps (held there after)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    span = cfg.lr_total_steps - cfg.lr_warmup_steps
    frac = min(1.0, (step - cfg.lr_warmup_steps) / max(span - 1, 1))
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
