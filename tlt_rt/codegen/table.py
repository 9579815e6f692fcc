"""How each kernel of a step runs: one table from kernel name to its Triton kernel and its torch reference.

On CUDA a step runs the Triton kernels (each checked against its reference in tests/test_kernel_*.py, and under
TRITON_INTERPRET=1 on the CPU); everywhere else the references, which are the kernels' definitions. Every
choice between the two in the lowered steps and in the engine's eager paths goes through `kernel`; attention
has its own objects (codegen/backend.py `select_backend`, which asks `runs_triton` the same question), as do
the models' glue kernels (codegen/model_kernels.py).

torch.compile for the small device glue inside a captured step (`maybe_compiled`): a captured step replays
every kernel its eager run launched, so a handful of index computations written as a dozen torch ops cost a
dozen launches (each ~1 µs of gap plus ~1.5 µs of kernel on an H100) at every step. Compiled, Inductor fuses
each such function into one or two kernels. Functions compile once, on first use (the graph pool's warm-up
runs, outside any capture), with dynamic shapes so that one compiled graph serves every batch bucket. On CPU,
or outside captured steps, the plain function runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tlt_rt.codegen.kernels.accept import accept_tree
from tlt_rt.codegen.kernels.build_tree import build_tree_triton
from tlt_rt.codegen.kernels.draft_level import draft_level, draft_level_reference
from tlt_rt.codegen.kernels.kv_commit import kv_commit, kv_commit_reference
from tlt_rt.codegen.kernels.topk_lse import topk_logprobs, topk_logprobs_reference
from tlt_rt.ir.tree import build_tree

# name -> (Triton kernel, torch reference), each pair with one signature
KERNELS: dict[str, tuple[Callable, Callable]] = {
    "accept": (functools.partial(accept_tree, backend="triton"), functools.partial(accept_tree, backend="torch")),
    "kv_commit": (kv_commit, kv_commit_reference),
    "topk_logprobs": (topk_logprobs, topk_logprobs_reference),
    "draft_level": (draft_level, draft_level_reference),
    "build_tree": (build_tree_triton, build_tree),
}


def runs_triton(device: torch.device | str) -> bool:
    """Whether a step on `device` runs the Triton kernels: on CUDA."""
    return torch.device(device).type == "cuda"


def kernel(name: str, device: torch.device | str) -> Callable:
    """The implementation of kernel `name` for a step on `device`."""
    if name not in KERNELS:
        raise KeyError(f"no kernel {name!r} in the codegen table (has {', '.join(KERNELS)})")
    return KERNELS[name][0 if runs_triton(device) else 1]


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
