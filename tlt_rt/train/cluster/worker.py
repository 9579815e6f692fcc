"""A rollout worker (one Ray actor per worker: a process on CPU, one per GPU): a thin actor over its engine
(`RolloutRole`), its share of the data-parallel learner (`LearnerRole`) and a drafter replica with its trainer
(`DrafterRole`).

The engine and the learner hold the same model object, so an optimizer step is the engine's new policy.
Gradients are all-reduced through a torch.distributed group made inside the actors (gloo on CPU, NCCL on
GPU; the collectives live in comm.py), so every worker holds identical weights after an update without a round
trip through the driver. The actor keeps that group and the failure injection; everything else is a role's.

Methods run on a small thread pool (the actor's max_concurrency), so `stop_drafter` can preempt a
running `train_drafter`, and `export_state` can copy weights out while the engine generates.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tlt_rt.config_loader import from_dict
from tlt_rt.models import load_target
from tlt_rt.rollout import Engine
from tlt_rt.train.cluster.comm import all_reduce_sum, node_address_and_port
from tlt_rt.train.cluster.drafter_role import DrafterRole, serving_drafters
from tlt_rt.train.cluster.learner_role import LearnerRole
from tlt_rt.train.cluster.results import RolloutResult, Sample
from tlt_rt.train.cluster.rollout_role import RolloutRole
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.drafter.tail import DrafterTraining
from tlt_rt.train.rl.learner import LearnResult, MiniBatch


class Worker:
    """The actor: builds the roles in a fixed order (the random draws and the engine's share of GPU memory
    depend on it) and hands each call to the role that owns it."""

    def __init__(self, rank: int, world_size: int, cfg: dict, run_dir: str, policy_path: str | None = None) -> None:
        self.cfg: TLTConfig = from_dict(TLTConfig, cfg)
        self.rank, self.world_size, self.run_dir = rank, world_size, Path(run_dir)
        c = self.cfg
        gpu = c.cluster.gpus_per_worker > 0
        self.device = torch.device("cuda" if gpu else "cpu")
        if not gpu:
            torch.set_num_threads(c.cluster.cpus_per_worker)
        # the same seed on every worker: drafter replicas must start equal to be averaged
        torch.manual_seed(c.rl.seed)
        model = load_target(policy_path or c.model.path, dtype=c.model.dtype, device=self.device)
        heads = self._drafter_target(model)  # what the drafters take embedding, final norm and LM head from
        serving, frozen = serving_drafters(c, heads, self.device, model.lm_head.weight.dtype, rank)
        # the engine's target is the learner's policy model: None for a sharded worker (built in form_group)
        engine = self._make_engine(model, serving)
        if engine is not None and self.device.type == "cuda":
            engine.capture()  # every graph now: no capture later beside a spot-training thread
        self.drafter_role = DrafterRole(serving, frozen, heads, c, rank, self.device)
        self.rollout_role = RolloutRole(engine, self.drafter_role, c, rank, self.device)
        self.learner_role = LearnerRole(model, c, rank, world_size, self.device, self.run_dir, self.rollout_role)

    def _drafter_target(self, model):
        return model

    def _make_engine(self, model, serving):
        return Engine(model, **RolloutRole.engine_options(self.cfg, serving))

    def engine_options(self) -> dict:
        return RolloutRole.engine_options(self.cfg, self.drafter_role.serving)

    def ping(self) -> int:
        return self.rank

    def group_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        return node_address_and_port()

    def form_group(self, addr: str, port: int, world_size: int) -> None:
        """(Re)create the gradient group; called on every worker at once, e.g. after a worker was replaced."""
        self.world_size = world_size
        if dist.is_initialized():
            dist.destroy_process_group()
        if world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=world_size,
            timeout=timedelta(seconds=self.cfg.cluster.collective_timeout_s),
        )  # fmt: skip
        self.learner_role.learner.grad_sync = all_reduce_sum

    def _maybe_fail(self, phase: str, step: int) -> None:
        """The `cluster.debug_fail` testing aid: exit this process once at PHASE:RANK:STEP."""
        marker = self.run_dir / f".debug_fail.{phase}.{self.rank}.{step}"
        if self.cfg.cluster.debug_fail != f"{phase}:{self.rank}:{step}" or marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("failed once\n")
        os._exit(1)

    def rollout(self, step: int, prompts: list[list[int]], params: dict) -> RolloutResult:
        self._maybe_fail("rollout", step)
        return self.rollout_role.rollout(step, prompts, params)

    def accept_ceiling(self) -> dict[str, tuple[int, int]]:
        return self.rollout_role.accept_ceiling()

    def drafter_curve(self, n_answers: int | None) -> dict[str, dict[str, tuple[int, int]]]:
        return self.rollout_role.drafter_curve(n_answers)

    def evaluate(self, prompts: list[list[int]], params: dict) -> list[Sample]:
        return self.rollout_role.evaluate(prompts, params)

    def train_drafter(self, epoch: int) -> DrafterTraining:
        """Train the drafter replica until `stop_drafter(epoch)`; the coordinator calls this on idle workers."""
        return self.drafter_role.train(epoch)

    def stop_drafter(self, epoch: int) -> None:
        self.drafter_role.stop(epoch)

    def merge_drafter(self, my_steps: int, total_steps: int) -> None:
        """Collective: average the replicas weighted by their steps and serve the result."""
        self.drafter_role.merge(my_steps, total_steps, self.world_size)

    def learn(self, step: int, minibatches: list[MiniBatch]) -> LearnResult:
        self._maybe_fail("learn", step)
        out = self.learner_role.learn(step, minibatches)
        self._policy_updated()
        return out

    def _policy_updated(self) -> None:
        self.drafter_role.refresh_heads()

    def version(self) -> int:
        return self.learner_role.version

    def export_state(self) -> dict:
        """Everything a replacement worker needs to continue as this one (weights, optimizer, drafter)."""
        return {**self.learner_role.export_state(), **self.drafter_role.export_state()}

    def import_state(self, state: dict) -> None:
        self.learner_role.import_state(state)
        self.drafter_role.import_state(state)

    def save_checkpoint(self, folder: str) -> None:
        """Rank 0 writes the shared state (policy in HF layout, optimizer, drafter); every rank its own RNG and
        SD policy. `folder` must be on a file system every worker sees."""
        for role in (self.learner_role, self.drafter_role, self.rollout_role):
            role.save_checkpoint(Path(folder))

    def load_checkpoint(self, folder: str) -> None:
        """Restore what `save_checkpoint` wrote (the policy weights were loaded at construction)."""
        for role in (self.learner_role, self.drafter_role, self.rollout_role):
            role.load_checkpoint(Path(folder))
