"""Spot drafter training: idle workers train the drafter while the rollout's tail runs elsewhere.

Per RL step the coordinator dispatches every worker's rollout share and waits for them one by one. A
worker whose share is done is idle: it is told to train its drafter replica (preemptible, on the
(token, hidden state) data of the last few steps that it generated itself). When the last share is
done, every trainer is stopped (the trainer drops a half-done optimizer step), and the replicas are
merged into one drafter: the average of the replicas weighted by the steps each trained (workers that
trained 0 steps carry weight 0), all-reduced among the workers and copied into every engine before the
next rollout. Any subset of workers may be idle at any time; a step where no one trained keeps the drafter.

With a single worker there is no idle peer, so the worker trains during its own tail instead
(train/drafter/tail.py).

A worker that dies is replaced (cluster/pool.py) and its rollout share is redone (same prompts and seed,
hence the same samples).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import ray

from tlt_rt.train.cluster.results import DrafterTraining, LearnResult, RolloutResult, StepRollout


class Coordinator:
    """Drives one step's rollout over the worker pool and schedules drafter training on idle workers."""

    def __init__(self, pool, spot: bool) -> None:
        self.pool, self.spot = pool, spot

    def rollout(self, step: int, shares: list[list[list[int]]], params: list[dict], progress=None) -> StepRollout:
        """Run every share; returns per-rank results, idle-time trainings and the rollout's wall window."""
        pool = self.pool
        start = time.time()
        pending = {pool.workers[r].rollout.remote(step, shares[r], params[r]): r for r in range(pool.size)}
        results: dict[int, RolloutResult] = {}
        training: dict[Any, int] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError:
                pool.replace(rank)
                pending[pool.workers[rank].rollout.remote(step, shares[rank], params[rank])] = rank
                continue
            if progress is not None:
                progress.update(len(results[rank].samples))
            # the last share's worker has no tail left to fill
            if self.spot and pending:
                training[pool.workers[rank].train_drafter.remote(step)] = rank
        end = time.time()
        for w in pool.workers:
            w.stop_drafter.remote(step)
        trainings = {r: DrafterTraining(r, "idle") for r in range(pool.size)}
        for ref, rank in training.items():
            try:
                trainings[rank] = ray.get(ref)
            except ray.exceptions.RayActorError:
                pool.replace(rank)  # its training is lost; the replacement holds a survivor's drafter
            except ray.exceptions.RayTaskError as e:  # drafter training is an extra: the RL step goes on
                warnings.warn(f"drafter training on worker {rank} failed, its steps are dropped: {e}", stacklevel=2)
        return StepRollout([results[r] for r in range(pool.size)], trainings, start, end)

    def merge(self, outcome: StepRollout) -> None:
        """Merge drafter replicas (collective over workers), then every engine serves the merged drafter."""
        steps = outcome.drafter_steps()
        total = sum(steps)
        # a lone worker's tail training was pushed to its engine when its rollout returned (a lone TP group
        # still merges: its peers' drafters must equal rank 0's to draft the same trees)
        if total > 0 and len(self.pool.actors) > 1:
            self.pool.collective("merge_drafter", [(s, total) for s in steps])

    def learn(self, step: int, minibatches: list[list], version: int) -> list[LearnResult]:
        """Run the learner on every worker; on a failure, redo the mini-batches not yet applied everywhere."""
        return self.pool.collective("learn", [(step, mbs) for mbs in minibatches], resume_from=version)
