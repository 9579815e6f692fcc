"""The pool of worker actors: launching them (each into its bundle of the placement layout), their
gradient group, calls on all of them at once, and replacing dead ones.

A worker that dies is replaced by a fresh actor that takes a survivor's state (weights, optimizer, drafter),
or, alone, the last checkpoint's.
"""

from __future__ import annotations

from typing import Any

import ray

from tlt_rt.options import to_dict
from tlt_rt.train.cluster.placement import Layout, scheduling_strategy
from tlt_rt.train.cluster.results import LearnResult
from tlt_rt.train.cluster.sharded import ShardedWorker, uses_sharded_workers
from tlt_rt.train.cluster.worker import Worker
from tlt_rt.train.rl.checkpoint import latest_checkpoint


class WorkerLost(RuntimeError):
    """A worker died and `cluster.max_restarts` replacements have been used up."""


class WorkerPool:
    """The worker actors, their gradient group, and replacement of dead ones."""

    def __init__(self, cfg, run_dir, policy_path: str | None = None, layout: Layout | None = None,
                 pgs: list[Any] | None = None) -> None:  # fmt: skip
        self.layout, self.pgs = layout, pgs  # with a layout, each actor goes into its bundle of `pgs`
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
        """The actor for `rank` (a sharded pool launches its TP peers too)."""
        return self._launch(Worker, rank, policy_path)

    def _launch(self, cls: type, rank: int, policy_path: str | None, *extra: Any, tp_rank: int = 0, gpus=None):
        """The one place an actor starts: `cls(rank, size, cfg, run_dir, policy_path, *extra)` as a Ray actor
        with the worker's resources, in its placement bundle when the pool has a layout."""
        c = self.cfg.cluster
        options: dict[str, Any] = dict(num_cpus=c.cpus_per_worker, max_concurrency=4, max_restarts=0,
                                       num_gpus=c.gpus_per_worker if gpus is None else gpus)  # fmt: skip
        if self.layout is not None:
            options["scheduling_strategy"] = scheduling_strategy(self.pgs, self.layout, rank, tp_rank)
        actor = ray.remote(cls).options(**options)
        return actor.remote(rank, self.size, to_dict(self.cfg), str(self.run_dir), policy_path, *extra)

    def form_group(self) -> None:
        self._dirty = False
        if self.size == 1:
            return
        addr, port = ray.get(self.workers[0].group_address.remote())
        ray.get([w.form_group.remote(addr, port, self.size) for w in self.workers])

    def load_checkpoint(self, folder) -> None:
        ray.get([w.load_checkpoint.remote(str(folder)) for w in self.workers])

    def _alive(self, rank: int) -> bool:
        try:
            ray.get(self.workers[rank].ping.remote(), timeout=60)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def replace(self, rank: int, src: int | None = None) -> None:
        """Start a fresh actor for `rank` holding a survivor's state (or the last checkpoint's, alone)."""
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
        return ray.get([getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)])

    def collective(self, method: str, args: list[tuple], resume_from: int | None = None) -> list:
        """Call `method` on every worker at once (they all-reduce among themselves), recovering from deaths.

        After a failure the dead are replaced, every worker takes the state of the worker that got furthest
        (highest learner version: a step some finished is complete, its all-reduce having included
        everyone), the group is re-formed, and a `learn` call is redone for the mini-batches not yet applied
        (`resume_from` is the version before the call); any other collective is not retried.
        """
        if self._dirty:
            self.form_group()
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)]
        results, dead, failed, raised = [], [], False, None
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                dead.append(rank)
                failed = True
            except ray.exceptions.RayTaskError as e:  # a survivor whose collective lost its peer, or a bug
                failed, raised = True, raised or e
        if not failed:
            return results
        if not dead:  # every worker lives: the call itself failed (out of memory, a bug), and would again
            raise raised
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
            return [LearnResult(rank=r) for r in range(self.size)]
        return self.collective(method, rest, resume_from + done)


class ShardedWorkerPool(WorkerPool):
    """The pool of sharded workers: `workers` are the TP ranks 0, `peers[r]` the other ranks of replica r."""

    def __init__(self, cfg, run_dir, policy_path, layout, pgs) -> None:
        self.peers: dict[int, list] = {}
        super().__init__(cfg, run_dir, policy_path, layout, pgs)

    @property
    def actors(self) -> list:
        return [a for r in range(len(self.workers)) for a in [self.workers[r], *self.peers.get(r, [])]]

    def _spawn(self, rank: int, policy_path: str | None = None):
        followers = [
            self._launch(ShardedWorker, rank, policy_path, t, [], tp_rank=t, gpus=self._gpus())
            for t in range(1, self.cfg.cluster.tensor_parallel)
        ]
        self.peers[rank] = followers
        return self._launch(ShardedWorker, rank, policy_path, 0, followers, gpus=self._gpus())

    def _gpus(self) -> int:
        return 1 if self.cfg.cluster.gpus_per_worker else 0  # one GPU per TP rank

    def form_group(self) -> None:
        self._dirty = False
        ray.get([a.ping.remote() for a in self.actors])  # surfaces the peers' construction errors
        addr, port = ray.get(self.workers[0].group_address.remote())
        ray.get([a.form_group.remote(addr, port, self.size) for a in self.actors])

    def replace(self, rank: int, src: int | None = None) -> None:
        self.restarts += 1
        raise WorkerLost(f"worker {rank} (tensor-parallel or FSDP-sharded) died; sharded workers are not replaced "
                         "in a run: resume=true continues from the last checkpoint")  # fmt: skip


def make_pool(cfg, run_dir, policy_path: str | None, layout: Layout, pgs: list[Any]) -> WorkerPool:
    """The pool a run needs: sharded workers for tensor-parallel engines or the FSDP learner, else plain ones."""
    cls = ShardedWorkerPool if uses_sharded_workers(cfg) else WorkerPool
    return cls(cfg, run_dir, policy_path, layout, pgs)
