"""Programmatic dependent launch (PDL) for the decode step's chain of Triton kernels, each loading its weight slab
while the kernel before still runs.

A small model's decode step at batch 1 is a chain of ~150 short kernels, each a few microseconds, most of which
read one weight from HBM. Launched one after another, every kernel starts cold: its CTAs are placed only when the
kernel before has drained, and its first weight bytes arrive a DRAM latency later. On Hopper and later a kernel
launched with PDL (`launch_pdl=True`) is placed on the SMs while the kernel before it still runs, as soon as
every program of that one has signalled (`griddepcontrol.launch_dependents`); it then waits
(`griddepcontrol.wait`) until that kernel has finished and its writes are visible. What it does before the wait
overlaps the kernel before: here a one-tile matmul loads its whole weight slab into registers (`load_weight`).
Measured on an H200 (benchmarks/RESULTS.md): that pays on Qwen2.5-Coder-0.5B's step (1.07x over the same kernels
without PDL) and is even on the 1.5B's; prefetching the slab into L2 instead (`prefetch_rows`, the kernels'
PREFETCH) was slower, and signalling at the start with nothing to load early slower still.

The contract every kernel taking PDL keeps (tests/kernel_compile_check.py checks it in the PTX of each):
- before `enter` it writes nothing and reads only what no kernel of the step before it writes (`load_early`):
  weights (constant within a step: the learner updates them between steps, outside any graph), as L2 prefetches or
  loads through `load_weight` (a one-tile matmul's whole slab, in registers when the wait returns); and in decode
  attention the step's lengths, positions and block tables (filled before the step's first kernel) and the first
  tile of the cache's earlier positions (written by earlier steps; the kernel before, the q/k/v projection, writes
  no cache). That holds because a waiting kernel is placed only once the kernel before has passed its own wait:
  everything before that one has finished;
- `enter` (the wait) runs in every program, unconditionally, and the signal comes after it: right after
  (SIGNAL_AT_START) or once the program's main loop is done (`leave`, SIGNAL_AT_END), so the next kernel is placed
  only once this one runs (a chain of waiting kernels never runs more than one kernel ahead, nor prefetches
  weights an L2 cannot hold). Placed early, the next kernel's programs go wherever there is room, which may
  crowd them onto the SMs that freed first; placed at the end they spread as this kernel's programs finish.
  Launches of the classes named in SIGNAL_FIRST (off by default; `benchmarks/step_costs.py --compare pdl-first-*`
  times them) signal before their wait instead (SIGNAL_BEFORE_WAIT): the next kernel is placed while the one
  before this still runs, its early loads overlapping two kernels. That stays within the first rule, which names
  what no kernel of the step writes, and a waiting program holds no resource the kernels before it need: those
  were all placed before it (a kernel is placed only once every program of the one before has signalled).
The wait covers every earlier kernel: the one before this finished, and it had itself waited for its own.

Off the GPU (the interpreter) and before Hopper the flags are off (`pdl_supported`): the kernels run as before.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "LINE_BYTES",
    "load_early",
    "load_weight",
    "SIGNAL_AT_END",
    "SIGNAL_AT_START",
    "SIGNAL_BEFORE_WAIT",
    "SIGNAL_FIRST",
    "enter",
    "interpreting",
    "launch_meta",
    "leave",
    "line_elems",
    "pdl_supported",
    "prefetch_rows",
]

LINE_BYTES = 128  # one L2 prefetch per 128-byte line
# where a program signals that the next kernel may be placed (the kernels' PDL constexpr; 0 = no PDL)
SIGNAL_AT_START = 1  # right after its wait: the next kernel's programs placed while this one runs
SIGNAL_AT_END = 2  # once its main loop is done: placed as this kernel's programs finish
SIGNAL_BEFORE_WAIT = 3  # before its wait: placed as soon as every program of this one is
# Launch classes whose PDL launches (SIGNAL_AT_START) signal before their wait instead: "attention" (decode
# attention), "norm" (the add + norm + projection), "narrow" / "wide" (one-row matmuls of weights under / from
# skinny_gemm.NARROW_N rows, their rows within one tile), "long" (rows wider than one tile), "tp" (the TP sum).
SIGNAL_FIRST: frozenset[str] = frozenset()


def interpreting() -> bool:
    """True under Triton's interpreter (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_supported(device: torch.device | str) -> bool:
    """True where a kernel may be launched with PDL: a CUDA device of compute capability 9.0 or later, outside
    the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def line_elems(dtype: torch.dtype) -> int:
    """Elements of `dtype` in one prefetched line."""
    return max(1, LINE_BYTES // dtype.itemsize)


def launch_meta(
    device: torch.device,
    pdl: bool | int,
    dtype: torch.dtype | None = None,
    block_k: int = 0,
    prefetch: bool = False,
    kind: str = "",
) -> dict:
    """The PDL keywords of a launch: the kernel's PDL mode (0, or where the programs signal: True is
    SIGNAL_AT_START, SIGNAL_BEFORE_WAIT instead for a launch class `kind` in SIGNAL_FIRST) and Triton's
    launch_pdl, both off where PDL cannot run (`pdl_supported`); with a weight's dtype also PREFETCH (needs pdl)
    and the prefetch's LINE / LINES (lines a BLOCK_K tile spans)."""
    if int(pdl) not in (0, SIGNAL_AT_START, SIGNAL_AT_END, SIGNAL_BEFORE_WAIT):
        raise ValueError(
            f"pdl must be False, True / {SIGNAL_AT_START}, {SIGNAL_AT_END} or {SIGNAL_BEFORE_WAIT}, got {pdl!r}"
        )
    mode = int(pdl) if pdl and pdl_supported(device) else 0
    if mode == SIGNAL_AT_START and kind in SIGNAL_FIRST:
        mode = SIGNAL_BEFORE_WAIT
    on = mode != 0
    meta = {"PDL": mode, "launch_pdl": on}
    if dtype is not None:
        line = line_elems(dtype)
        meta.update(PREFETCH=on and prefetch, LINE=line, LINES=max(1, block_k // line))
    return meta


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernel before (and so for every earlier one); with PDL == SIGNAL_AT_START also let the next
    kernel be placed now, with SIGNAL_BEFORE_WAIT before waiting. A no-op without PDL."""
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def leave(PDL: tl.constexpr):
    """With PDL == SIGNAL_AT_END, let the next kernel be placed: called where a program's main loop is done."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def load_early(ptrs, mask, other):
    """A load a kernel may issue before `enter`: of what no kernel of the step before it writes (weights; a decode
    attention's lengths, positions, block tables and the cache's earlier positions), marked evict-first, the mark
    the PTX check tells such loads by."""
    return tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_first")


@triton.jit
def load_weight(ptrs, mask):
    """A load of weight elements (read once a step, constant within it) before `enter` (`load_early`)."""
    return load_early(ptrs, mask, 0.0)


@triton.jit
def prefetch_rows(base, rows, stride_row, K, LINE: tl.constexpr, LINES: tl.constexpr):
    """Pull rows `rows` [R] (row indices already inside the matrix) of the row-major matrix at `base`, K elements
    each, into L2: one prefetch per LINE elements, LINES lines of every row per round. Addresses past a row's end
    are clamped to its last element, so only bytes of the matrix are named."""
    offs = tl.arange(0, LINES) * LINE
    row_start = base + rows.to(tl.int64)[:, None] * stride_row
    for k0 in range(0, K, LINES * LINE):
        cols = tl.minimum(k0 + offs, K - 1)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0", "=r,l", [row_start + cols[None, :]], dtype=tl.int32, is_pure=False, pack=1
        )
