"""One phase of a run under the torch profiler, summarised as text: where an update's wall time went.

`logging.profile_learner_step: N` wraps step N's learner update on every worker in `profiled`, which writes
RUN/profile/learner-step{N}-rank{r}.txt: the wall seconds against the kernels' summed seconds (a large gap
means the device waited on the host), the kernels by kind and the top kernels by time, and the host-side
operators that took longest. On a CPU worker the table has no kernels, only the host operators.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

__all__ = ["KINDS", "kernel_kinds", "kernel_rows", "profiled", "summary"]

KINDS = (  # kernel name fragments -> what the time went to (first match wins)
    ("collectives", ("nccl", "all_reduce", "allreduce")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_")),
    ("triton (fused glue)", ("triton",)),
    ("copies", ("copy", "memcpy", "memset", "fill", "cat")),
)


def kernel_rows(events, device: bool = True) -> list[tuple[str, float, int]]:
    """(name, microseconds, count) summed by name over a finished profiler's events, largest first: device
    kernels (`device=True`) or host operators (their own time, children excluded)."""
    rows: dict[str, list[float]] = {}
    for e in events:
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device != device:
            continue
        us = e.device_time if device else e.self_cpu_time_total
        r = rows.setdefault(e.name, [0.0, 0])
        r[0] += us
        r[1] += 1
    return sorted(((k, us, int(n)) for k, (us, n) in rows.items()), key=lambda r: -r[1])


def exposed_by(events, key) -> list[tuple[str, float, float, int]]:
    """(row, exposed us, busy us, count) over a finished profiler's device kernels, largest exposed first, a
    kernel's row key(name, k) with k the kernels of its name before it in start order (the name itself, or e.g. a
    decode step's matmul told apart by its place in the layer). A kernel's exposed time is how far it moves the
    device timeline's end: its end minus the later of its start and every earlier kernel's end. Kernels that
    overlap (programmatic dependent launch places one while the one before runs) count only what they add; summed
    over a step, exposed times give the step's kernel time without the overlaps, and a kernel's own time (busy)
    includes what it spent placed but waiting."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    rows: dict[str, list[float]] = {}
    seen: dict[str, int] = {}
    frontier = float("-inf")
    for start, end, kernel in kernels:
        name = key(kernel, seen.get(kernel, 0))
        seen[kernel] = seen.get(kernel, 0) + 1
        r = rows.setdefault(name, [0.0, 0.0, 0])
        r[0] += max(0.0, end - max(frontier, start))
        r[1] += end - start
        r[2] += 1
        frontier = max(frontier, end)
    return sorted(((k, ex, busy, int(n)) for k, (ex, busy, n) in rows.items()), key=lambda r: -r[1])


def kernel_kinds(rows: list[tuple[str, float, int]]) -> dict[str, float]:
    """Microseconds by kind (KINDS; the rest 'other'), largest first."""
    out: dict[str, float] = {}
    for name, us, _ in rows:
        low = name.lower()
        kind = next((k for k, frags in KINDS if any(f in low for f in frags)), "other")
        out[kind] = out.get(kind, 0.0) + us
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summary(title: str, wall_s: float, kernels: list[tuple[str, float, int]], host: list[tuple[str, float, int]],
            top: int = 20) -> str:  # fmt: skip
    """The text `profiled` writes."""
    busy = sum(us for _, us, _ in kernels) / 1e6
    lines = [f"# {title}", f"wall {wall_s:.3f} s; kernels {busy:.3f} s in {sum(n for *_, n in kernels)} launches "
             f"({busy / wall_s:.0%} of the wall time busy)" if wall_s > 0 else "wall 0 s"]  # fmt: skip
    if kernels:
        lines.append("by kind: " + ", ".join(f"{k} {v / 1e6:.3f} s" for k, v in kernel_kinds(kernels).items()))
        lines.append("top kernels (ms, launches, name):")
        lines += [f"  {us / 1e3:9.2f} {n:7d}  {name[:110]}" for name, us, n in kernels[:top]]
    lines.append("top host operators by own time (ms, calls, name):")
    lines += [f"  {us / 1e3:9.2f} {n:7d}  {name[:110]}" for name, us, n in host[:top]]
    return "\n".join(lines) + "\n"


# host operators that wait for the device (a scalar read, a blocking copy) or that a loop may call once per
# sequence: `profiled(..., callers=CALLER_OPS)` lists where in the package they were called from
CALLER_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::copy_", "aten::cat", "aten::nonzero", "aten::to")


def caller_rows(events, names, root: str = "tlt_rt") -> list[tuple[str, str, float, int]]:
    """(operator, calling line, microseconds, calls) for the host operators `names`, by the innermost stack frame
    inside `root` (the profile must be taken with stacks), largest first."""
    rows: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.name not in names or e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        frames = list(getattr(e, "stack", None) or [])
        site = next((f for f in frames if f"{root}/" in f or f"{root}\\" in f), frames[0] if frames else "?")
        r = rows.setdefault((e.name, site), [0.0, 0])
        r[0] += e.cpu_time_total
        r[1] += 1
    return sorted(((n, site, us, int(c)) for (n, site), (us, c) in rows.items()), key=lambda r: -r[2])


@contextlib.contextmanager
def profiled(path: Path | None, title: str, device: torch.device, callers: tuple[str, ...] = ()):
    """Profile the block and write `summary` to `path`; a no-op when path is None. `callers`: host operators whose
    calls are also listed by the line of the package that made them (`caller_rows`; records Python stacks)."""
    if path is None:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    stacks = {}
    if callers:  # Python frames on the host events (torch fills `FunctionEvent.stack` only when verbose)
        stacks = {"with_stack": True, "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)}
    prof = torch.profiler.profile(activities=acts, **stacks)
    t0 = time.perf_counter()
    with prof:
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    events = prof.events()
    text = summary(title, wall, kernel_rows(events, device=True), kernel_rows(events, device=False))
    if callers:
        rows = caller_rows(events, set(callers))
        text += "where they were called (ms, calls, operator, line):\n"
        text += "".join(f"  {us / 1e3:9.2f} {n:7d}  {name}  {site[:120]}\n" for name, site, us, n in rows[:25])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
