"""Time stamps from inside a kernel: where a program's time goes between its launch and its end.

`stamp(BUF, i, dep)` writes the GPU's global nanosecond timer (`%globaltimer`) to BUF[i] once `dep` (a scalar of
the program's data: a sum of what it loaded, a count it got back) is in registers, so a stamp after a load is
the time its data arrived, not the time it was asked for. Stamps cost a few instructions and one store each;
kernels take them only under a constexpr (decode attention's PROBE_ON), compiled out otherwise, and never under
the interpreter (it has no timer). `benchmarks/attention_timeline.py` reads them for decode attention inside a
captured step.

A launcher takes its stamps' place in a buffer from `Stamps.take(programs, per_program)`: `per_program` int64
for each of its programs, in launch order, so the launches of a captured step (one per layer) land side by side
and a replay overwrites them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["Stamps", "as_dep", "clock", "put", "stamp"]


@triton.jit
def as_dep(x):
    """A float scalar's bits as int32: a dependency for `stamp` that no compiler can drop."""
    return x.to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def clock(dep):
    """The global timer (ns) as a [1] int64 block, read once the int32 scalar `dep` is ready."""
    d = tl.full([1], 0, tl.int32) + dep
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [d], dtype=tl.int64, is_pure=False,
                                     pack=1)  # fmt: skip


@triton.jit
def put(BUF, i, t):
    """BUF[i] = t, a `clock` read earlier (before a PDL kernel's wait, where it may not store yet)."""
    tl.store(BUF + i + tl.arange(0, 1), t)


@triton.jit
def stamp(BUF, i, dep):
    """BUF[i] = the global timer (ns), read once the int32 scalar `dep` is ready."""
    put(BUF, i, clock(dep))


class Stamps:
    """A buffer of int64 stamps on `device` and the next free offset in it: launchers `take` slots in order."""

    def __init__(self, device: torch.device | str, size: int = 1 << 20):
        self.buf = torch.zeros(size, dtype=torch.int64, device=device)
        self.next = 0
        self.launches: list[tuple[int, int, int]] = []  # (offset, programs, stamps per program)

    def take(self, programs: int, per_program: int) -> int:
        """The offset of a launch's `programs` x `per_program` stamps; ValueError once the buffer is full."""
        off = self.next
        if off + programs * per_program > self.buf.numel():
            raise ValueError(f"Stamps: {self.buf.numel()} stamps are full ({len(self.launches)} launches)")
        self.next += programs * per_program
        self.launches.append((off, programs, per_program))
        return off

    def read(self) -> list[torch.Tensor]:
        """Each launch's stamps as an int64 CPU tensor [programs, per_program], in launch order."""
        host = self.buf.cpu()
        return [host[o : o + p * k].view(p, k) for o, p, k in self.launches]
