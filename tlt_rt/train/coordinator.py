"""Spot drafter training: idle workers train the drafter while the rollout's tail runs elsewhere.

Per RL step the coordinator dispatches every worker's rollout share and waits for them one by one. A
worker whose share is done is idle: it is told to train its drafter replica (preemptible, on the
(token, hidden state) data of the last few steps that it generated itself). When the last share is
done, every trainer is stopped (the trainer drops a half-done optimizer step), and the replicas are
merged into one drafter: the average of the replicas weighted by the steps each trained (workers that
trained 0 steps carry weight 0), all-reduced among the workers and copied into every engine before the
next rollout. Any subset of workers may be idle at any time; a step where no one trained keeps the drafter.

With a single worker there is no idle peer, so the worker trains during its own tail instead
(`TailTrainer`): a background thread starts training once fewer than `tail_fraction` of its sequences
are still running and stops when generation returns. It competes with generation for the device (on
CPU for the same cores); the cost shows in the step's rollout seconds and tail share.

A worker that dies is replaced by a fresh actor that takes a survivor's state (weights, optimizer,
drafter); its rollout share is redone (same prompts and seed, hence the same samples).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import torch

from tlt_rt.config import TLTConfig


def tail_training_on(cfg: TLTConfig) -> bool:
    mode = cfg.drafter.tail_training
    return cfg.drafter.train_online and (mode == "on" or (mode == "auto" and cfg.cluster.num_workers == 1))


class TailTrainer:
    """Trains the drafter in a background thread while the engine's running batch is in its tail."""

    def __init__(self, engine, trainer, first_entry: int, capacity: int, fraction: float,
                 max_steps: int | None, poll_s: float = 0.01) -> None:  # fmt: skip
        self.engine, self.trainer = engine, trainer
        self.first_entry, self.threshold = first_entry, fraction * capacity
        self.max_steps, self.poll_s = max_steps, poll_s
        self.stop = threading.Event()
        self.result: dict[str, Any] = {"steps": 0, "where": "tail"}
        self._thread = threading.Thread(target=self._run, name="drafter-tail", daemon=True)

    def _in_tail(self) -> bool:
        tl = self.engine.timeline
        if len(tl) <= self.first_entry:
            return False
        last = tl[-1]
        return last["kind"] != "prefill" and 0 < last["running"] < self.threshold

    def _run(self) -> None:
        while not self.stop.is_set() and not self._in_tail():
            self.stop.wait(self.poll_s)
        if self.stop.is_set():
            return
        start = time.time()
        device = self.trainer.device
        if device.type == "cuda":
            # its own stream: training kernels interleave with the engine's replays instead of queueing
            # behind them on the default stream; the buffer's tensors were written on the default stream
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.default_stream(device))
            with torch.cuda.stream(stream):
                out = self.trainer.train(self.stop, max_steps=self.max_steps)
            stream.synchronize()
        else:
            out = self.trainer.train(self.stop, max_steps=self.max_steps)
        end = time.time()
        self.result = {"steps": int(out["steps"]), "loss": out["loss"], "top1": out["top1"], "start": start,
                       "end": end, "seconds": end - start, "where": "tail"}  # fmt: skip

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        self._thread.join()
        return self.result


class WorkerLost(RuntimeError):
    """A worker died and `cluster.max_restarts` replacements have been used up."""


class Coordinator:
    """Drives one step's rollout over the worker pool and schedules drafter training on idle workers."""

    def __init__(self, pool, spot: bool) -> None:
        self.pool, self.spot = pool, spot

    def rollout(self, step: int, shares: list[list[list[int]]], params: list[dict], progress=None) -> dict:
        """Run every share; returns per-rank results, idle-time trainings and the rollout's wall window."""
        import ray

        pool = self.pool
        start = time.time()
        pending = {pool.workers[r].rollout.remote(step, shares[r], params[r]): r for r in range(pool.size)}
        results: dict[int, dict] = {}
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
                progress.update(len(results[rank]["completions"]))
            # the last share's worker has no tail left to fill
            if self.spot and pending:
                training[pool.workers[rank].train_drafter.remote(step)] = rank
        end = time.time()
        for w in pool.workers:
            w.stop_drafter.remote(step)
        trainings = {r: {"rank": r, "steps": 0, "where": "idle"} for r in range(pool.size)}
        for ref, rank in training.items():
            try:
                trainings[rank] = ray.get(ref)
            except ray.exceptions.RayActorError:
                pool.replace(rank)  # its training is lost; the replacement holds a survivor's drafter
            except ray.exceptions.RayTaskError as e:  # drafter training is an extra: the RL step goes on
                warnings.warn(f"drafter training on worker {rank} failed, its steps are dropped: {e}", stacklevel=2)
        return {"results": [results[r] for r in range(pool.size)], "trainings": trainings,
                "start": start, "end": end}  # fmt: skip

    def merge(self, outcome: dict) -> None:
        """Merge drafter replicas (collective over workers), then every engine serves the merged drafter."""
        tail = [(res.get("tail") or {}).get("steps", 0) for res in outcome["results"]]
        steps = [outcome["trainings"][r]["steps"] + tail[r] for r in range(self.pool.size)]
        total = sum(steps)
        # a lone worker's tail training was pushed to its engine when its rollout returned (a lone TP group
        # still merges: its peers' drafters must equal rank 0's to draft the same trees)
        if total > 0 and len(self.pool.actors) > 1:
            self.pool.collective("merge_drafter", [(s, total) for s in steps])

    def learn(self, step: int, minibatches: list[list], version: int) -> list[dict]:
        """Run the learner on every worker; on a failure, redo the mini-batches not yet applied everywhere."""
        return self.pool.collective("learn", [(step, mbs) for mbs in minibatches], resume_from=version)


class WorkerPool:
    """The worker actors, their gradient group, and replacement of dead ones."""

    def __init__(self, cfg: TLTConfig, run_dir, policy_path: str | None = None) -> None:
        import ray

        self.cfg, self.run_dir = cfg, run_dir
        self.size = cfg.cluster.num_workers
        self.restarts = 0
        self.version = 0  # learner steps every worker has applied (kept by the driver)
        self.workers = [self._spawn(r, policy_path) for r in range(self.size)]
        ray.get([w.ping.remote() for w in self.workers])  # surfaces construction errors here
        self._dirty = False
        self.form_group()

    @property
    def actors(self) -> list:
        """Every worker process (a sharded pool adds the TP peers)."""
        return list(self.workers)

    def _spawn(self, rank: int, policy_path: str | None = None):
        import ray

        from tlt_rt.config import to_dict
        from tlt_rt.train.worker import Worker

        c = self.cfg.cluster
        actor = ray.remote(Worker).options(
            num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_worker, max_concurrency=4, max_restarts=0
        )
        return actor.remote(rank, self.size, to_dict(self.cfg), str(self.run_dir), policy_path)

    def form_group(self) -> None:
        import ray

        self._dirty = False
        if self.size == 1:
            return
        addr, port = ray.get(self.workers[0].group_address.remote())
        ray.get([w.form_group.remote(addr, port, self.size) for w in self.workers])

    def load_checkpoint(self, folder) -> None:
        import ray

        ray.get([w.load_checkpoint.remote(str(folder)) for w in self.workers])

    def _alive(self, rank: int) -> bool:
        import ray

        try:
            ray.get(self.workers[rank].ping.remote(), timeout=60)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def replace(self, rank: int, src: int | None = None) -> None:
        """Start a fresh actor for `rank` holding a survivor's state (or the last checkpoint's, alone)."""
        import ray

        from tlt_rt.train.checkpoint import latest_checkpoint

        self.restarts += 1
        if self.restarts > self.cfg.cluster.max_restarts:
            raise WorkerLost(f"worker {rank} died and cluster.max_restarts={self.cfg.cluster.max_restarts} "
                             "replacements are used up; resume=true continues from the last checkpoint")  # fmt: skip
        ray.kill(self.workers[rank], no_restart=True)
        if src is None:
            src = next((r for r in range(self.size) if r != rank and self._alive(r)), None)
        if src is not None:
            new = self._spawn(rank)
            ray.get(new.import_state.remote(self.workers[src].export_state.remote()))
        else:
            ckpt = latest_checkpoint(self.run_dir)
            new = self._spawn(rank, str(ckpt / "policy") if ckpt else None)
            if ckpt is not None:
                ray.get(new.load_checkpoint.remote(str(ckpt)))
            if ray.get(new.version.remote()) != self.version:
                raise WorkerLost(f"the only worker died and its last checkpoint is not the current step's start; "
                                 f"resume=true continues from {ckpt}")  # fmt: skip
        self.workers[rank] = new
        self._dirty = True

    def call_all(self, method: str, args: list[tuple]) -> list:
        import ray

        return ray.get([getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)])

    def collective(self, method: str, args: list[tuple], resume_from: int | None = None) -> list:
        """Call `method` on every worker at once (they all-reduce among themselves), recovering from deaths.

        After a failure the dead are replaced, every worker takes the state of the worker that got furthest
        (highest learner version: a step some finished is complete, its all-reduce having included
        everyone), the group is re-formed, and a `learn` call is redone for the mini-batches not yet applied
        (`resume_from` is the version before the call); any other collective is not retried.
        """
        import ray

        if self._dirty:
            self.form_group()
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)]
        results, dead, failed = [], [], False
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                dead.append(rank)
                failed = True
            except ray.exceptions.RayTaskError:  # a survivor whose collective lost its peer
                failed = True
        if not failed:
            return results
        alive = [r for r in range(self.size) if r not in dead]
        versions = dict(zip(alive, ray.get([self.workers[r].version.remote() for r in alive]), strict=True))
        src = max(versions, key=lambda r: (versions[r], -r)) if versions else None
        for rank in dead:
            self.replace(rank, src)
        if src is not None:
            state = self.workers[src].export_state.remote()
            ray.get([self.workers[r].import_state.remote(state) for r in range(self.size) if r != src])
        self.form_group()
        if method != "learn" or resume_from is None:
            return []
        done = (versions[src] if src is not None else self.version) - resume_from
        rest = [(a[0], a[1][done:]) for a in args]
        if not rest[0][1]:
            return [{"rank": r, "optimizer_steps": 0.0} for r in range(self.size)]
        return self.collective(method, rest, resume_from + done)
