"""torch.compile for the small device glue inside a captured step.

A captured step replays every kernel its eager run launched, so a handful of index computations written
as a dozen torch ops cost a dozen launches (each ~1 µs of gap plus ~1.5 µs of kernel on an H100) at every
step. Compiled, Inductor fuses each such function into one or two kernels. Functions compile once, on
first use (the graph pool's warm-up runs, outside any capture), with dynamic shapes so that one compiled
graph serves every batch bucket. On CPU, or outside captured steps, the plain function runs.
"""

from __future__ import annotations

import torch

_compiled: dict[str, object] = {}


def maybe_compiled(fn, compiled: bool, device: torch.device):
    """`fn` itself, or (on CUDA, when `compiled`) its torch.compile'd version."""
    if not compiled or device.type != "cuda":
        return fn
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name not in _compiled:
        # dynamo's default recompile limit (8 a function) stays: past it the remaining variants run eagerly
        # (still inside the captured step); raising it made capture compile for minutes cold
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]
