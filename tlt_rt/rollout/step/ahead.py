"""A step queued ahead of the one before it: while step N runs, step N+1 is queued before N's results reach
the host, so the host's postprocessing of N overlaps the device's N+1 (`EngineConfig.overlap`).

N+1's inputs are packed from the sequences as they are before N and moved on by N's results on the device: a
plain step's root is N's sampled token (`StepArgs.tokens`); a speculative step of N's strategy moves its prefix,
ctx tokens and windows on by N's accept lengths and tokens (`StepArgs.after`, `graph.advance_ints`). The engine
keeps N+1 only where it is the step it would have run after postprocessing N (`keeps`), else it is discarded
and run again on the samples left; so the tokens are those of one step at a time.

    step = runner.launch(seqs, tables, strategy, params)            # N, queued
    nxt = launch_ahead(engine, sched, step, params, keep_hidden)     # N+1 queued, or None
    out = runner.collect(step)                                       # N's results; the host postprocesses
    if nxt is not None and not keeps(engine, sched, nxt, params): runner.discard(nxt)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tlt_rt.ir.strategy import Strategy, scratch_tokens
from tlt_rt.rollout.block_manager import Tables
from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.policy.catchup import rows_once
from tlt_rt.rollout.policy.costs import option_name
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.graph import StepArgs, StepValues
from tlt_rt.rollout.step.io import distinct, pack_floats, pack_ints, row_params
from tlt_rt.rollout.step.target import batch_mode

if TYPE_CHECKING:
    from tlt_rt.rollout.engine import Engine
    from tlt_rt.rollout.model_runner import ModelRunner
    from tlt_rt.rollout.scheduler import Scheduler


@dataclass
class Launched:
    """A step queued on the device and not yet collected (`ModelRunner.launch`)."""

    seqs: list[Sequence]
    strategy: Strategy | None
    mode: str
    out: StepValues  # the step's device outputs (a captured step's are overwritten by its next replay)
    hidden: torch.Tensor | None  # a copy of out.hidden, when kept
    t0: float  # perf_counter when it was queued
    ahead: bool = False  # queued before the step it continues was collected
    behind: int = 0  # drafter rows the policy counted behind for it (the engine's stats)
    host: torch.Tensor | None = None  # pinned copy of out.host, once stashed
    done: torch.cuda.Event | None = None  # recorded after that copy


def args_after(
    runner: ModelRunner,
    seqs: list[Sequence],
    tables,
    strategy: Strategy | None,
    rows: list[SamplingParams],
    after: Launched,
    keep: list[int] | None,
) -> StepArgs:
    """The inputs of a step continuing `after` (queued, not collected; `ModelRunner.launch`), packed from the
    sequences as they are and moved on by `after`'s results on the device."""
    tables = tables if isinstance(tables, Tables) else Tables.of(tables)
    pick = None
    if keep is not None:
        idx = runner.ring.stage("roots", torch.tensor(keep, dtype=torch.long))
        pick = idx.to(runner.device, non_blocking=True)
    host = after.out.host if pick is None else after.out.host[pick]
    if strategy is None:  # one token on: the root is the token `after` sampled
        depth, window, roots, moved = 0, None, host[:, 1], None
        ints = pack_ints(seqs, tables, 1, 0, ahead=1)
    else:  # packed as before `after`; the device moves prefix, ctx tokens on, and `after` moved the windows
        depth, r, roots, moved = strategy.depth, runner.drafter.block_rows(strategy), None, host
        ints = pack_ints(seqs, tables, r, depth)
        window = (after.out.window if pick is None else after.out.window[pick])[:, -r:]
    floats = pack_floats(seqs, rows, depth, runner.uniforms, ahead=1)
    return StepArgs(runner.ring.stage("ints", ints), runner.ring.stage("floats", floats), window, roots, moved)


def launch_ahead(
    engine: Engine, sched: Scheduler, step: Launched, params: SamplingParams, keep_hidden: bool
) -> tuple[Launched | None, tuple | None]:
    """Queue the step after `step` (not yet collected) before collecting it, so the host's postprocessing
    overlaps the device's next step: a plain step after a plain one, a speculative step after one of the
    same strategy (`EngineConfig.overlap_speculative`). Returns (the step queued, or None; the SD policy's
    choice for the next step when it is of another kind, as (strategy, sequence ids), else None). No step
    is queued where it could differ from the one the engine would run after postprocessing: a sample
    preempted for blocks, or a prefill that could come first.

    After a plain step its batch is `step`'s less the samples `step` ends by a limit of length or context
    (known on the host before its results); after a speculative step, which may or may not reach a
    sample's limit, none is queued while one is that close. Whether `step` ends a sample with a stop token
    is known only after, and `keeps` decides then."""
    strategy = step.strategy
    if strategy is not None and not engine.config.overlap_speculative:
        return None, None
    emits = 1 if strategy is None else strategy.depth + 1  # the most tokens `step` gives a sample
    stop_ctx = engine.max_context
    seqs, rows = [], []
    for i, s in enumerate(step.seqs):  # still running after `step` whatever it samples
        n = len(s.output)
        if not s.finished and min(s.max_new_tokens - n, stop_ctx - len(s.prompt) - n) > emits:
            seqs.append(s)
            rows.append(i)
    alive = sum(not s.finished for s in step.seqs)
    if not seqs or (len(seqs) < alive and (sched.waiting or strategy is not None)):
        return None, None  # samples end and a prefill may run next; or a speculative step may end some, or not
    nxt = None
    if engine.runner.drafter is not None:  # the policy decides the next step now, `step` counted in
        drafter = engine.runner.drafter
        nxt = engine.policy.decide(len(seqs), rows_once(functools.partial(drafter.rows_behind, seqs, emits)))
        if option_name(nxt) != option_name(strategy):
            return None, (nxt, [s.seq_id for s in seqs])
    ids = [s.seq_id for s in seqs]
    need = [s.num_cached + emits + (1 if nxt is None else scratch_tokens(nxt)) for s in seqs]
    if engine.blocks.blocks_short(ids, need) > engine.blocks.num_free:  # it would preempt
        return None, None
    if engine.blocks.ensure_many(ids, need) != len(ids):
        raise RuntimeError("blocks counted free for the step ahead were not")
    roots = None if len(rows) == len(step.seqs) else rows
    launched = engine.runner.launch(seqs, engine.blocks.packed(ids), nxt, params, keep_hidden, after=step, roots=roots)
    return launched, None


def keeps(engine: Engine, sched: Scheduler, ahead: Launched, params: SamplingParams) -> bool:
    """Whether the step queued ahead stands after the step before it was postprocessed: its batch is the one
    running, or (plain captured steps) the running samples are its own less some that stopped, run in the
    same graph, with no prefill before them (a captured plain step's rows do not depend on one another, so
    they get the same results)."""
    ids = [s.seq_id for s in ahead.seqs]
    if ids == [s.seq_id for s in sched.running]:
        return True
    alive = [s for s in ahead.seqs if not s.finished]
    if ahead.strategy is not None or not alive or sched.waiting or engine.runner.pool is None:
        return False
    if [s.seq_id for s in alive] != [s.seq_id for s in sched.running]:
        return False
    ran = engine.runner.key(len(ahead.seqs), option_name(None), ahead.mode, 0)
    mode = batch_mode(distinct(row_params(alive, params)))
    return ran is not None and ran == engine.runner.key(len(alive), option_name(None), mode, 0)
