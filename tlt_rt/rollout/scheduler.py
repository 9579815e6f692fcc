"""What runs next: prefill chunks first (first come, first served), then every running sample.

One Scheduler lives for one `Engine.generate` call. It owns the queues and the block bookkeeping of
admission, completion and preemption; the engine turns its choices into forwards. When blocks run out the
youngest running sample is preempted: its blocks are freed and it waits at the front of the queue to be
recomputed from its tokens.
"""

from __future__ import annotations

from collections import Counter, deque

from tlt_rt.rollout.block_manager import BlockManager
from tlt_rt.rollout.sequence import PrefillJob, Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int, stats: Counter):
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = stats
        self.waiting: deque[PrefillJob] = deque()
        self.running: list[Sequence] = []
        self.done: list[Sequence] = []
        self._allocated: set[int] = set()  # prefill jobs that hold blocks

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[tuple[PrefillJob, int]]:
        """Prefill chunks for this step, allocating blocks for jobs as they are first admitted."""
        jobs, budget = [], self.max_prefill_tokens
        slots = self.max_batch - len(self.running)
        for job in self.waiting:
            n = len(job.group) if job.group else 1
            if budget <= 0 or n > slots:
                break
            if job.done == 0 and job.seq_id not in self._allocated:
                # room for the prompt and one private block per sample it forks into
                if not self.blocks.can_allocate(len(job.tokens) + n * self.blocks.block_size):
                    break
                self.blocks.allocate(job.seq_id, len(job.tokens))
                self._allocated.add(job.seq_id)
            chunk = min(job.remaining, budget)
            jobs.append((job, chunk))
            budget -= chunk
            slots -= n
        return jobs

    def prefilled(self, job: PrefillJob) -> None:
        """A job's last chunk ran: it leaves the queue (its blocks now belong to its sequences)."""
        self.waiting.remove(job)
        self._allocated.discard(job.seq_id)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        self.done.append(seq)

    def preempt_youngest(self) -> Sequence:
        """Free the most recently admitted sample's blocks; it will be recomputed from its tokens."""
        victim = self.running.pop()
        self.blocks.free(victim.seq_id)
        victim.reset_for_recompute()
        self.stats["preemptions"] += 1
        self.waiting.appendleft(PrefillJob(victim.seq_id, victim.tokens[:-1], seq=victim))
        return victim

    def make_room(self, blocks: int) -> None:
        """Preempt until `blocks` blocks are free (or nothing runs)."""
        while self.blocks.num_free < blocks and self.running:
            self.preempt_youngest()

    def reserve(self, extra: int) -> None:
        """Every running sample gets blocks for `extra` more positions; the youngest make way if needed."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self.blocks.ensure(seq.seq_id, seq.num_cached + extra):
                i += 1
            else:
                self.preempt_youngest()
