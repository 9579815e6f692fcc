"""Step costs for the SD policy: the key a measured cost table is valid for, where it is kept, and the
profile that measures it (every batch bucket x option, each a whole step as the engine runs it).

`python -m tlt_rt.compile` profiles ahead and saves the table; an engine built for the same key loads it at
start (`load_costs`), so the policy decides from measured costs from its first step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_rt.models.default import cache_dir
from tlt_rt.rollout.policy.costs import CostTable, cost_key

log = logging.getLogger(__name__)
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def engine_cost_key(engine) -> dict:
    a = engine.target.arch
    shape = {k: getattr(a, k) for k in SHAPE_FIELDS}
    shape["block_size"] = engine.block_size
    return cost_key(shape, engine.target.lm_head.weight.dtype, engine.device)


def cost_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{digest}.json"


def load_costs(engine) -> CostTable:
    """The cost table measured for this engine's model, dtype and device, else an empty one."""
    key = engine_cost_key(engine)
    path = cost_path(key)
    table = CostTable.load(path, key) if path.is_file() else None
    if table is None:
        return CostTable(key)
    log.info("loaded step costs from %s", path)
    return table


def _time(fn, iters: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()  # ends with the step's copy to the host: the device work is inside
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def profile(engine, ctx: int = 512, iters: int = 10, progress: bool = True, mode: str = "greedy"):
    """Measure the step cost of every (bucket, option) of `engine` on synthetic sequences of `ctx` cached
    tokens: fill, replay (or eager run) and the host copy, as a real step. Returns the table and printable
    rows. Runs between generate calls only (the synthetic steps write to the cache's first blocks)."""
    table = CostTable(engine_cost_key(engine))
    rows: list[dict] = []
    options = [None] + (list(engine.strategies) if engine.runner.drafter is not None else [])
    work = [(b, s) for b in sorted(engine.buckets, reverse=True) for s in options]
    for b, s in tqdm(work, desc="profiling buckets", disable=not progress, file=sys.stderr):
        total = _time(engine.runner.synthetic_step(b, s, mode, ctx), iters, engine.device)
        table.set(b, s, total)
        rows.append({"bucket": b, "option": str(s) if s else "off", "ms": total * 1e3})
    return table, rows
