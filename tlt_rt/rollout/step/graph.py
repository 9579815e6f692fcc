"""One decode step, plain or speculative, as one program: captured as a single CUDA graph per key.

A step is the strategy's lowered StepProgram (ir/program.py; codegen/lower.py emits it): the drafter's catch-up
block, its levels and rerank, the target's verify, acceptance, the KV commit, and the output node, which gathers
the target hidden states of the root and the accepted path, moves the drafter's catch-up windows on by the
accepted length and packs everything the host needs into one tensor that reaches it in one copy. Plain decoding
is `StepProgram.plain_decode`: the root alone verified, an acceptance of depth 0. Nothing inside syncs with the
host, and every shape is fixed by the key, so the whole of it is one graph replay:

    key = ("step", B, option, mode)    option "off" (plain decoding) or a strategy ("8_4_32"),
                                       mode "greedy" | "sampled" | "filtered" (top-k / top-p)

Inputs are two packed buffers filled from the host in one copy each, and the windows (device):

    ints   [B, 2 + R + W] int64   prefix_len, ctx_len, ctx tokens (R rows; the last is the root), block table
    floats [B, 2(D+1) + 3] f32    the acceptance walk's uniforms, then temperature, top_k, top_p
    window [B, R, H]              target hidden rows of the catch-up block (SD only)

Padding rows (batch rows past the live batch) get the trash block as their whole block table, so every
write of theirs, verify and commit included, lands in the trash block. Sampling settings are per-row
inputs, so one graph serves every temperature of a mode.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from tlt_rt.codegen.lower import LoweredStep, StepModels, lower
from tlt_rt.codegen.table import maybe_compiled
from tlt_rt.ir.program import StepProgram
from tlt_rt.ir.strategy import Bucket, Strategy
from tlt_rt.rollout.policy.costs import OFF

Key = tuple


def mode_program(strategy: Strategy | None, mode: str, rows: int | None = None) -> StepProgram:
    """The StepProgram a mode's graph runs: its ACCEPT node's mode (greedy, sampled, filtered) picks the kernel
    variant; the sampling settings are per-row inputs of the step. rows: the drafter's catch-up block."""
    if strategy is None:
        return StepProgram.plain_decode(mode)
    return StepProgram.speculative(strategy, mode, rows)


@functools.cache
def parse_option(option: str) -> Strategy | None:
    return None if option == OFF else Strategy.parse(option)


@dataclass
class StepArgs:
    """One step's inputs for b live sequences (see the module docstring)."""

    ints: Tensor  # [b, 2 + R + w] int64 on the host, w <= the runner's table width
    floats: Tensor  # [b, 2(D+1) + 3] float32 on the host
    window: Tensor | None  # [b, R, H] on the device
    # [b] int64 on the device: the roots, made by the step before on the device (a plain step packed ahead of
    # it, step/io.py); they replace the ints' root column, queued after that step and before this one
    tokens: Tensor | None = None
    # [b, 1 + 2(D+1)] on the device: the host row of the speculative step before (a speculative step of the
    # same strategy queued ahead of it): its accept lengths and tokens move the ints' prefix_len, ctx_len
    # and ctx tokens on (`advance_ints`), packed as they were before that step
    after: Tensor | None = None


@dataclass
class StepValues:
    """A step's device outputs (the batch's rows)."""

    host: Tensor  # [b, 1 + 2(D+1)] float64: accept length, tokens (accepted, then the bonus), log-probs
    hidden: Tensor  # [b, D+1, H] target hidden at the root and each accepted node
    window: Tensor | None  # [b, R, H] the moved catch-up windows


def layout(runner, option: str) -> tuple[int, int]:
    """(R: catch-up rows, D: depth) of an option."""
    s = parse_option(option)
    if s is None:
        return 1, 0
    return runner.drafter.block_rows(s), s.depth


def advance_ints(ints: Tensor, after: Tensor, r: int) -> None:
    """ints [b, 2 + R + W] of a speculative step packed before the speculative step `after` (its host row
    [b, 1 + 2(D+1)]: accept length a, then D+1 tokens) ran, moved on in place to after it: prefix_len
    grows by a + 1, ctx_len is min(prefix_len, R) again, and the R ctx tokens are the last R of the old
    ones followed by the a + 1 emitted tokens. Device ops only: queued, no sync."""
    depth = (after.shape[1] - 1) // 2 - 1
    a = after[:, 0].long()
    emitted = after[:, 1 : 2 + depth].long()  # [b, D+1]; the first a+1 are the step's tokens
    ints[:, 0] += a + 1
    ints[:, 1] = ints[:, 0].clamp(max=r)
    joined = torch.cat([ints[:, 2 : 2 + r], emitted], 1)  # [b, R + D + 1]
    idx = (a + 1)[:, None] + torch.arange(r, device=ints.device)[None, :]
    ints[:, 2 : 2 + r] = joined.gather(1, idx)


def move_on(ints: Tensor, args: StepArgs, r: int) -> None:
    """Apply what a step queued ahead takes from the step before on the device (`StepArgs.tokens` or
    `StepArgs.after`) to its ints [b, 2 + R + W], in place."""
    if args.tokens is not None:
        ints[:, 1 + r].copy_(args.tokens)
    elif args.after is not None:
        advance_ints(ints, args.after, r)


def unpack_inputs(ints: Tensor, floats: Tensor, r: int, dlen: int) -> dict[str, Tensor]:
    """The packed step buffers (module docstring) -> the lowered program's named inputs, each contiguous
    (the kernels take their [B] inputs contiguous; the buffers' columns are strided views)."""
    ctx_tokens = ints[:, 2 : 2 + r].contiguous()
    settings = floats[:, -3:].t().contiguous()  # [3, B]: temperature, top_k, top_p
    return {
        "last_tokens": ctx_tokens[:, -1].contiguous(),
        "prefix_lens": ints[:, 0].contiguous(),
        "block_table": ints[:, 2 + r :].int(),
        "uniforms": floats[:, : 2 * (dlen + 1)].reshape(-1, dlen + 1, 2),
        "temperature": settings[0],
        "top_k": settings[1].int(),
        "top_p": settings[2],
        "ctx_tokens": ctx_tokens,
        "ctx_len": ints[:, 1].contiguous(),
    }


class StepGraphs:
    """The whole step as a `codegen.graphs.Program` for keys ("step", B, option, mode); also runs eagerly."""

    def __init__(self, runner):
        self.runner = runner
        self._lowered: dict[tuple, LoweredStep] = {}

    def lowered(self, batch: int, option: str, mode: str) -> LoweredStep:
        key = (batch, option, mode)
        if key not in self._lowered:
            r, s = self.runner, parse_option(option)
            a = r.target.model.arch
            bucket = Bucket(batch, s, r.width, r.block_size, a.vocab_size, r.target.model.feature_size, a.hidden_size)
            rows = None if s is None else layout(r, option)[0]
            self._lowered[key] = lower(mode_program(s, mode, rows), bucket, r.device)
        return self._lowered[key]

    # ---- the program itself -----------------------------------------------------------------------------
    def compute(self, batch: int, option: str, mode: str, ints: Tensor, floats: Tensor, window: Tensor | None):
        """The step on device tensors: (host [B, 1+2(D+1)] f64, hidden [B, D+1, H], moved window or None)."""
        r, dlen = layout(self.runner, option)
        run = self.runner
        values = maybe_compiled(unpack_inputs, run.compiled, ints.device)(ints, floats, r, dlen)
        if window is not None:
            values["ctx_hidden"] = window
        else:
            del values["ctx_tokens"], values["ctx_len"]
        d = run.drafter
        models = StepModels(run.target.model, run.target.cache, None if d is None else d.drafter,
                            None if d is None else d.cache, run.block_size, run.compiled)  # fmt: skip
        v = self.lowered(batch, option, mode)(models, values)
        return v["host"], v["out_hidden"], v.get("window")

    # ---- codegen.graphs.Program ---------------------------------------------------------------------------
    def static_inputs(self, key: Key) -> dict[str, Tensor]:
        _, b, option, _ = key
        run = self.runner
        r, dlen = layout(run, option)
        dev, h = run.device, run.target.model.feature_size  # the target hidden the drafter reads
        dtype = run.target.model.lm_head.weight.dtype
        ins = {
            "ints": torch.zeros(b, 2 + r + run.width, dtype=torch.long, device=dev),
            "floats": torch.zeros(b, 2 * (dlen + 1) + 3, dtype=torch.float32, device=dev),
            # outputs live outside the pool: they are read after other graphs of the pool replay
            "out.host": torch.zeros(b, 1 + 2 * (dlen + 1), dtype=torch.float64, device=dev),
            "out.hidden": torch.zeros(b, dlen + 1, h, dtype=dtype, device=dev),
        }
        ins["ints"][:, 2 + r :] = run.trash_block
        ins["floats"][:, -1] = 1.0  # top_p of padding rows
        ins["floats"][:, -2] = -1.0  # top_k
        if dlen:
            ins["window"] = torch.zeros(b, r, h, dtype=dtype, device=dev)
            ins["out.window"] = torch.zeros(b, r, h, dtype=dtype, device=dev)
        return ins

    def run(self, key: Key, ins: dict[str, Tensor]) -> StepValues:
        _, b, option, mode = key
        host, hid, moved = self.compute(b, option, mode, ins["ints"], ins["floats"], ins.get("window"))
        ins["out.host"].copy_(host)
        ins["out.hidden"].copy_(hid)
        if moved is not None:
            ins["out.window"].copy_(moved)
        return StepValues(ins["out.host"], ins["out.hidden"], ins.get("out.window"))

    def fill(self, key: Key, ins: dict[str, Tensor], args: StepArgs) -> None:
        b, c = args.ints.shape
        r, _ = layout(self.runner, key[2])
        ints = ins["ints"]
        ints[:b, :c].copy_(args.ints, non_blocking=True)
        move_on(ints[:b], args, r)
        if b < ints.shape[0]:  # padding rows: nothing cached, every write to the trash block
            ints[b:, : 2 + r].zero_()
            ints[b:, 2 + r :].fill_(self.runner.trash_block)
        ins["floats"][:b].copy_(args.floats, non_blocking=True)
        if args.window is not None:
            ins["window"][:b].copy_(args.window)

    def result(self, key: Key, out: StepValues, args: StepArgs) -> StepValues:
        b = args.ints.shape[0]
        return StepValues(out.host[:b], out.hidden[:b], None if out.window is None else out.window[:b])

    def eager(self, option: str, mode: str, args: StepArgs) -> StepValues:
        """The same step run eagerly on the live batch (CPU, enforce_eager, or a batch past every bucket)."""
        dev = self.runner.device
        ints, floats = args.ints.to(dev, non_blocking=True), args.floats.to(dev, non_blocking=True)
        if args.tokens is not None or args.after is not None:
            ints = ints.clone() if ints is args.ints else ints  # the host's array stays as packed
            move_on(ints, args, layout(self.runner, option)[0])
        b = ints.shape[0]
        host, hid, moved = self.compute(b, option, mode, ints, floats, args.window)
        return StepValues(host, hid, moved)
