"""A prefill step: chunks of waiting prompts through the target, then the fork of every prompt that finished
into its samples (shared prompt blocks, one private last block each, first tokens drawn in one batch)."""

from __future__ import annotations

import torch

from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.scheduler import Scheduler
from tlt_rt.rollout.sequence import PrefillJob, Sequence
from tlt_rt.rollout.step.target import Layout, draw


def prefill(runner, sched: Scheduler, jobs: list[tuple[PrefillJob, int]], params: SamplingParams, keep_hidden: bool):
    """Run one prefill step of `jobs` ((job, chunk) pairs from `Scheduler.admit`); returns the tokens run."""
    layout = Layout([], [], [])
    tokens, last_rows, finishing = [], [], []
    for job, chunk in jobs:
        s, e = job.done, job.done + chunk
        tokens += job.tokens[s:e]
        layout.tables.append(sched.blocks.block_table(job.seq_id))
        layout.starts.append(s)
        layout.q_lens.append(chunk)
        if e == len(job.tokens):
            last_rows.append(len(tokens) - 1)
            finishing.append(job)
    out = runner.prefill(tokens, layout, last_rows or [0])
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
            seq.step_rows = sched.step_rows
            sched.running.append(seq)
            continue
        groups.append((row, job))
    if groups:
        fork_groups(runner, sched, groups, out.logits, params, keep_hidden)
    sched.stats["prefill_steps"] += 1
    sched.stats["prefill_tokens"] += len(tokens)
    return len(tokens)


def fork_groups(runner, sched: Scheduler, groups, logits, params: SamplingParams, keep_hidden: bool) -> None:
    """Fork every prompt that finished prefilling into its samples. The device work is queued before the
    host waits for any of it: the first tokens of every sample drawn in one batch, the drafter rows of the
    shared prompts in one forward, every sample's private block copied in one gather per cache; then one
    device-to-host copy brings the first tokens. (Per-prompt copies, each waiting for an upload, cost ~10 ms
    at 128 prompts on an H100.)"""
    rows = [row for row, job in groups for _ in job.group]
    seqs = [seq for _, job in groups for seq in job.group]
    per_row = [params if s.params is None else s.params for s in seqs]
    tok, lp = draw(logits[rows], per_row, [s.seed for s in seqs], [0] * len(seqs))
    hiddens = [h[0] if len(h := job.hidden_chunks) == 1 else torch.cat(h) for _, job in groups]
    drafted = [(job, h) for (_, job), h in zip(groups, hiddens, strict=True) if len(job.tokens) > 1]
    drafter = runner.drafter
    if drafter is not None and drafted:
        # drafter rows of each shared prompt once, before its samples diverge
        parents = [
            Sequence(job.seq_id, -1, -1, job.tokens, 0, 1, num_cached=len(job.tokens) - 1, hidden_chunks=[h])
            for job, h in drafted
        ]
        drafter.catch_up(parents, [sched.blocks.block_table(job.seq_id) for job, _ in drafted])
    caches = [runner.target.cache] + ([drafter.cache] if drafter is not None else [])
    pending = _Pending(runner, sched, caches, tok, lp)
    k = 0
    for (_, job), hidden in zip(groups, hiddens, strict=True):
        p = len(job.tokens)
        draft_cached = p - 1 if drafter is not None and p > 1 else 0
        group = job.group
        if sched.blocks.num_free < len(group):  # a preemption frees blocks and requeues samples by their tokens:
            pending.settle()  # no pending copy may write a freed block, no forked sample may lack its first token
        sched.make_room(len(group))  # each sample takes a private last block
        for seq in group:
            pending.copies += sched.blocks.fork(job.seq_id, seq.seq_id, p - 1)
        sched.blocks.free(job.seq_id)  # its last block may be a later fork's destination: copies read first
        for seq in group:
            seq.num_cached, seq.draft_cached = p, draft_cached
            seq.hidden_chunks = [hidden] if keep_hidden else []
            seq.counter = 1
            seq.step_rows = sched.step_rows
            sched.running.append(seq)
            pending.forked.append((k, seq))
            k += 1
    pending.settle()


class _Pending:
    """The fork's deferred work: block copies not yet applied, forked samples whose first token is not yet
    appended (`settle` does both: the copies in one call, the tokens after the one host copy)."""

    def __init__(self, runner, sched: Scheduler, caches, tok, lp):
        self.runner, self.sched, self.caches = runner, sched, caches
        self.drawn, self.host = (tok, lp), None
        self.copies: list[tuple[int, int]] = []
        self.forked: list[tuple[int, Sequence]] = []

    def settle(self) -> None:
        self.runner.target.copy_blocks(self.copies, self.caches)
        self.copies = []
        if not self.forked:
            return
        if self.host is None:
            tok, lp = self.drawn
            self.host = torch.stack([tok.double(), lp.double()]).tolist()  # one device-to-host copy
        tok, lp = self.host
        for k, seq in self.forked:
            self.sched.emit(seq, [int(tok[k])], [lp[k]])
        self.forked = []
