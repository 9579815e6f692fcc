"""The engine's step bodies: a prefill step (chunks of waiting prompts, then the fork of finished prompts into
their samples) and a decode step (plain, or speculative as the SD policy decides), with the bookkeeping of
emitted tokens. Functions of the `Engine` they advance, kept apart from its set-up and public API."""

from __future__ import annotations

import time

import torch

from tlt_rt.rollout.runner import Layout
from tlt_rt.rollout.scheduler import Scheduler
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.speculative import scratch_tokens, speculative_step


def prefill(engine, jobs, sched: Scheduler, sampler, stop, keep_hidden) -> None:
    t0 = time.perf_counter()
    layout = Layout([], [], [], [], [])
    tokens, last_rows, finishing = [], [], []
    for job, chunk in jobs:
        s, e = job.done, job.done + chunk
        tokens += job.tokens[s:e]
        layout.tables.append(engine.blocks.block_table(job.seq_id))
        layout.q_lens.append(chunk)
        layout.seq_lens.append(e)
        layout.positions.append(list(range(s, e)))
        layout.cache_pos.append(list(range(s, e)))
        if e == len(job.tokens):
            last_rows.append(len(tokens) - 1)
            finishing.append(job)
    out = engine.runner.forward(tokens, layout, "prefill", logits_rows=last_rows or [0])
    offset = 0
    for job, chunk in jobs:
        job.hidden_chunks.append(out.hidden[offset : offset + chunk])
        job.done += chunk
        offset += chunk
    groups = []
    for row, job in enumerate(finishing):
        sched.prefilled(job)
        if job.seq is not None:  # a recomputed sample resumes where it was
            seq = job.seq
            seq.num_cached, seq.hidden_chunks = len(job.tokens), [torch.cat(job.hidden_chunks)]
            sched.running.append(seq)
            continue
        groups.append((row, job))
    if groups:
        fork_groups(engine, groups, out.logits, sched, sampler, stop, keep_hidden)
    engine._stats["prefill_steps"] += 1
    engine._stats["prefill_tokens"] += len(tokens)
    engine.timeline.append(
        {
            "kind": "prefill",
            "batch": len(jobs),
            "tokens": len(tokens),
            "start": t0 - engine._t_start,
            "seconds": time.perf_counter() - t0,
            "running": len(sched.running),
        }
    )


def fork_groups(engine, groups, logits, sched: Scheduler, sampler, stop, keep_hidden) -> None:
    """Fork every prompt that finished prefilling into its samples; first tokens are drawn for all of them
    in one batch (one host sync), and the drafter rows of the shared prompts are run in one forward."""
    rows = [row for row, job in groups for _ in job.group]
    seqs = [seq for _, job in groups for seq in job.group]
    tok, lp = sampler.sample(logits[rows], [s.seed for s in seqs], [0] * len(seqs))
    tok, lp = torch.stack([tok.double(), lp.double()]).tolist()  # one device-to-host copy
    hiddens = [torch.cat(job.hidden_chunks) for _, job in groups]
    drafted = [(job, h) for (_, job), h in zip(groups, hiddens, strict=True) if len(job.tokens) > 1]
    if engine.drafter_runner is not None and drafted:
        # drafter rows of each shared prompt once, before its samples diverge
        parents = [
            Sequence(job.seq_id, -1, -1, job.tokens, 0, 1, num_cached=len(job.tokens) - 1, hidden_chunks=[h])
            for job, h in drafted
        ]
        engine.drafter_runner.catch_up(parents, [engine.blocks.block_table(job.seq_id) for job, _ in drafted])
    caches = [engine.runner.cache] + ([engine.drafter_runner.cache] if engine.drafter_runner else [])
    k = 0
    for (_, job), hidden in zip(groups, hiddens, strict=True):
        p = len(job.tokens)
        draft_cached = p - 1 if engine.drafter_runner is not None and p > 1 else 0
        group = job.group
        sched.make_room(len(group))  # each sample takes a private last block
        copies = []
        for seq in group:
            copies += engine.blocks.fork(job.seq_id, seq.seq_id, p - 1)
        engine.blocks.free(job.seq_id)
        engine.runner.copy_blocks(copies, caches)
        for seq in group:
            seq.num_cached, seq.draft_cached = p, draft_cached
            seq.hidden_chunks = [hidden] if keep_hidden else []
            seq.counter = 1
            sched.running.append(seq)
            emit(engine, seq, [int(tok[k])], [lp[k]], stop, sched)
            k += 1


def emit(engine, seq: Sequence, toks: list[int], lps: list[float], stop, sched: Scheduler) -> int:
    """Append tokens until a stop token or a limit; returns how many were kept."""
    kept = 0
    for t, lp in zip(toks, lps, strict=False):
        seq.output.append(t)
        seq.logprobs.append(lp)
        kept += 1
        if t in stop:
            seq.finish_reason = "stop"
        elif len(seq.output) >= seq.max_new_tokens or seq.length >= engine.max_context:
            seq.finish_reason = "length"
        if seq.finished:
            sched.finish(seq)
            break
    engine._stats["generated_tokens"] += kept
    return kept


def decode_or_speculate(engine, sched: Scheduler, sampler, stop, keep_hidden) -> None:
    running = sched.running
    b = len(running)
    behind = 0
    if engine.drafter_runner is not None:
        if engine.speculative == "auto":  # drafter rows the next SD step would catch up eagerly first
            rows = engine.drafter_runner.window_rows
            behind = sum(max(0, s.num_cached - s.draft_cached - rows) for s in running)
        strategy = engine.policy.decide(b, behind)
    else:
        strategy = None
    extra = 1 if strategy is None else scratch_tokens(strategy)
    sched.reserve(extra)
    if not running:
        return
    b = len(running)
    seqs = list(running)
    tables = [engine.blocks.block_table(s.seq_id) for s in seqs]
    t0 = time.perf_counter()
    if strategy is None:
        layout = Layout(
            tables,
            [1] * b,
            [s.num_cached + 1 for s in seqs],
            [[s.num_cached] for s in seqs],
            [[s.num_cached] for s in seqs],
        )
        out = engine.runner.forward([s.tokens[-1] for s in seqs], layout, "decode")
        tok, lp = sampler.sample(out.logits, [s.seed for s in seqs], [s.counter for s in seqs])
        if keep_hidden:  # queued before the host waits for the tokens, so it overlaps the step
            # a replayed graph's output is overwritten by the next replay: keep a copy of this step's rows
            hidden = out.hidden.clone()
            for i, seq in enumerate(seqs):
                seq.add_hidden_row(hidden, i)
        tok, lp = torch.stack([tok.double(), lp.double()]).tolist()  # one device-to-host copy
        for i, seq in enumerate(seqs):
            seq.counter += 1
            seq.num_cached += 1
            emit(engine, seq, [int(tok[i])], [lp[i]], stop, sched)
        emitted = b
    else:
        res = speculative_step(
            seqs,
            tables,
            strategy,
            engine.runner,
            engine.drafter_runner,
            sampler,
            engine._lowered_step(b, strategy, sampler.params),
        )
        acc = res.accept
        emitted = 0
        for i, seq in enumerate(seqs):
            a = int(acc.accept_len[i])
            seq.counter += 1
            L = seq.num_cached
            toks = acc.accepted_tokens[i, : a + 1].tolist()
            lps = acc.logprobs[i, : a + 1].tolist()
            kept = emit(engine, seq, toks, lps, stop, sched)
            if keep_hidden:
                seq.add_hidden(res.hidden[i, :kept])
            seq.num_cached = L + kept
            emitted += kept
            engine._accept_hist[a + 1] += 1
        engine._strategy_use[str(strategy)] += 1
        engine._stats["sd_steps"] += 1
    if engine.device.type == "cuda":
        # this thread's stream only: a drafter trainer on its own stream (spot training in the tail) is
        # neither waited for nor counted in the step's cost, which the SD policy compares across options
        torch.cuda.current_stream(engine.device).synchronize()
    dt = time.perf_counter() - t0
    engine.policy.observe(b, strategy, dt, emitted / b, behind if strategy is not None else 0)
    engine._stats["steps"] += 1
    engine.timeline.append(
        {
            "kind": "sd" if strategy else "decode",
            "strategy": str(strategy) if strategy else None,
            "batch": b,
            "tokens": emitted,
            "start": t0 - engine._t_start,
            "seconds": dt,
            "running": len(running),
        }
    )
