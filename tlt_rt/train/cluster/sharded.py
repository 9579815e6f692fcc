"""Sharded workers: tensor-parallel engines (`cluster.tensor_parallel`) and the FSDP learner (`rl.learner_shard`).

A DP replica with tensor_parallel=T is T Ray actors, one per bundle of its TP group's placement group. The
driver talks to rank 0 (the pool's `workers` are the TP ranks 0, so the coordinator is unchanged); rank 0
forwards every lockstep call (rollout, learn, drafter merge, checkpoints) to its peers and only it returns
outputs. Every process of every replica is in one torch.distributed world (gloo on CPU, NCCL on GPU with
NVLink multicast off), with one subgroup per TP group for the engine's collectives:

    global rank = dp_rank * T + tp_rank        TP group of replica d = ranks [d*T, (d+1)*T)

Engine and learner hold separate copies of the policy. The engine holds this rank's TP shard (in lockstep,
rollout/lockstep.py) and a replicated drafter bound to the full embedding and head (`TargetHeads`). The
learner is every process: rank 0 splits its replica's mini-batches over its peers, so each process learns
on a slice and gradients are summed over the whole world, either as an all-reduce of full replicas
(`learner_shard=none`) or by FSDP2 (`fsdp`: fp32 master shards, bf16 compute on GPU). After each optimizer
step every process walks the full state one tensor at a time (FSDP all-gathers each), copies the
embedding/norm/head into `TargetHeads` and its `reshard_for_tp` slice into the engine in place. No weights
pass through the driver: on GPU the gather runs over NCCL, on CPU the same code runs over gloo.

A sharded worker that dies is not replaced (its TP peers and the FSDP shards would have to be rebuilt):
the run stops with WorkerLost and resume=true continues from the last checkpoint.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from tlt_rt.models import save_target
from tlt_rt.models.tensor_parallel import check_tp_divisible, shard_for_tp, use_allreduce
from tlt_rt.rollout import Engine
from tlt_rt.rollout.lockstep import TargetHeads, host_group_for, lockstep_engine
from tlt_rt.train.cluster.comm import all_reduce_sum, check_same_drafter
from tlt_rt.train.cluster.fsdp import full_state_for_engine, iter_full_state, reshard_for_tp, shard_learner
from tlt_rt.train.cluster.learner_role import copy_tokenizer_files
from tlt_rt.train.cluster.results import RolloutResult, Sample
from tlt_rt.train.cluster.worker import Worker
from tlt_rt.train.rl.checkpoint import load_pt, rng_state, set_rng_state
from tlt_rt.train.rl.learner import Learner, LearnResult, MiniBatch


def uses_sharded_workers(cfg) -> bool:
    return cfg.cluster.tensor_parallel > 1 or cfg.rl.learner_shard == "fsdp"


class _SavedPolicy:
    """What `save_target` reads from a model, for a gathered state dict."""

    def __init__(self, arch, state: dict) -> None:
        self.arch, self._state = arch, state
        self.lm_head = type("Head", (), {"weight": state["lm_head.weight"]})

    def state_dict(self) -> dict:
        return self._state


class ShardedWorker(Worker):
    def __init__(self, rank: int, world_size: int, cfg: dict, run_dir: str, policy_path: str | None = None,
                 tp_rank: int = 0, peers: tuple = ()) -> None:  # fmt: skip
        self.tp_rank, self.peers = tp_rank, list(peers)
        super().__init__(rank, world_size, cfg, run_dir, policy_path)
        self.tp = self.cfg.cluster.tensor_parallel
        self.fsdp = self.cfg.rl.learner_shard == "fsdp"
        self.rollout_role.collects = tp_rank == 0  # peers generate the same tokens; rank 0 keeps and trains on them
        arch = self.learner_role.model.arch
        check_tp_divisible(arch, self.tp)
        if arch.vocab_size % self.tp:
            raise ValueError(f"arch.vocab_size={arch.vocab_size} must divide by the tensor-parallel "
                             f"world {self.tp} for the weight handoff")  # fmt: skip
        self.global_rank = rank * self.tp + tp_rank

    def _drafter_target(self, model):
        self.engine_model = copy.deepcopy(model)
        self.heads = TargetHeads(self.engine_model)  # kept whole when the engine model is sharded
        return self.heads

    def _make_engine(self, model, serving):
        return None  # built in form_group, once the TP group exists

    # ----------------------------------------------------------------------------- process group
    def form_group(self, addr: str, port: int, world_size: int) -> None:
        if self.rollout_role.engine is not None:
            raise RuntimeError("sharded workers form their groups once; resume=true restarts from a checkpoint")
        tp, total = self.tp, world_size * self.tp
        self.world_size = total  # the drafter merge and gradient sums run over every process
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (read at NCCL init)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.global_rank, world_size=total,
            timeout=timedelta(seconds=self.cfg.cluster.collective_timeout_s),
        )  # fmt: skip
        # every process creates every subgroup, in the same order
        groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(world_size)] if tp > 1 else []
        # and each one's gloo twin, which the SD policy's choices travel through (lockstep.py)
        host_groups = [host_group_for(list(range(d * tp, (d + 1) * tp))) for d in range(world_size)] if tp > 1 else []
        if tp > 1:
            self.tp_group = groups[self.rank]
            shard_for_tp(self.engine_model, self.tp_group)
            if self.cfg.cluster.tp_allreduce != "nccl":  # collective: every rank of the group sets it up alike
                use_allreduce(self.engine_model, self.cfg.cluster.tp_allreduce)
            engine = lockstep_engine(self.engine_model, self.tp_group, drafter_tp=self.cfg.cluster.drafter_tp,
                                     host_group=host_groups[self.rank], **self.engine_options())  # fmt: skip
        else:
            engine = Engine(self.engine_model, **self.engine_options())
        self.rollout_role.engine = engine
        if self.device.type == "cuda":  # every rank captures the same keys in the same order
            engine.capture()
        learner = self.learner_role
        if self.fsdp:
            shard_learner(learner.model, mixed_precision=self.device.type == "cuda")
            learner.learner = Learner(learner.model, self.cfg.rl, learner.sampling, None, learner.learner.ref_model,
                                      lockstep=True)  # fmt: skip
        elif total > 1:
            learner.learner.grad_sync = all_reduce_sum

    # ----------------------------------------------------------------------------------- lockstep
    def rollout(self, step: int, prompts: list[list[int]], params: dict) -> RolloutResult:
        refs = [p.rollout.remote(step, prompts, params) for p in self.peers]
        out = super().rollout(step, prompts, params)
        ray.get(refs)  # surfaces a peer's failure; its tokens are rank 0's
        return out

    def evaluate(self, prompts: list[list[int]], params: dict) -> list[Sample]:
        refs = [p.evaluate.remote(prompts, params) for p in self.peers]
        out = super().evaluate(prompts, params)
        ray.get(refs)
        return out

    def learn(self, step: int, minibatches: list[MiniBatch]) -> LearnResult:
        if not self.peers:
            return super().learn(step, minibatches)
        n = len(self.peers) + 1
        parts = [[MiniBatch(mb.samples[t::n], mb.num_tokens, mb.num_seqs) for mb in minibatches] for t in range(n)]
        refs = [p.learn.remote(step, parts[t + 1]) for t, p in enumerate(self.peers)]
        out = super().learn(step, parts[0])
        for other in ray.get(refs):
            out.add(other)
        return out

    def merge_drafter(self, my_steps: int, total_steps: int) -> None:
        refs = [p.merge_drafter.remote(0, total_steps) for p in self.peers]  # peers' replicas weigh nothing
        super().merge_drafter(my_steps, total_steps)
        if self.tp > 1 and total_steps > 0:  # every rank of the group is here (rank 0 and, called by it, its peers)
            check_same_drafter(self.drafter_role.serving, self.tp_group, "serving drafter")
        ray.get(refs)

    def _policy_updated(self) -> None:
        self._sync_engine()
        super()._policy_updated()

    @torch.no_grad()
    def _sync_engine(self) -> None:
        """Copy the learner's new weights into the engine's TP slice and the drafter's full heads, in place."""
        engine = self.engine_model.state_dict(keep_vars=True)
        heads = self.heads.state_dict(keep_vars=True)
        model = self.learner_role.model
        source = iter_full_state(model) if self.fsdp else model.state_dict().items()
        for name, full in source:  # FSDP: every process gathers every tensor (a collective each)
            if name in heads:
                heads[name].copy_(full)
            if name in engine:
                engine[name].copy_(reshard_for_tp({name: full}, self.tp_rank, self.tp)[name] if self.tp > 1 else full)

    # ---------------------------------------------------------------------------- state transfer
    def export_state(self) -> dict:
        raise NotImplementedError("sharded workers are not replaced; resume=true continues from a checkpoint")

    def import_state(self, state: dict) -> None:
        raise NotImplementedError("sharded workers are not replaced; resume=true continues from a checkpoint")

    def save_checkpoint(self, folder: str) -> None:
        """Collective over every process: the policy is gathered (FSDP) and written by global rank 0, the
        learner state by each process (its own shard), the drafter and SD policy by each replica's rank 0."""
        refs = [p.save_checkpoint.remote(folder) for p in self.peers]
        folder, model = Path(folder), self.learner_role.model
        state = full_state_for_engine(model) if self.fsdp else None
        if self.global_rank == 0:
            save_target(_SavedPolicy(model.arch, state) if self.fsdp else model, folder / "policy")
            copy_tokenizer_files(self.cfg.model.path, folder / "policy")
            self.drafter_role.trainer.save_checkpoint(folder / "drafter", async_=False)
        torch.save(self.learner_role.learner.state_dict(), folder / f"learner_{self.global_rank}.pt")
        if self.tp_rank == 0:
            torch.save({"rng": rng_state(), "sd_policy": self.rollout_role.engine.policy.state_dict()},
                       folder / f"worker_{self.rank}.pt")  # fmt: skip
        ray.get(refs)

    def load_checkpoint(self, folder: str) -> None:
        refs = [p.load_checkpoint.remote(folder) for p in self.peers]
        folder = Path(folder)
        self.learner_role.learner.load_state_dict(load_pt(folder / f"learner_{self.global_rank}.pt"))
        self.drafter_role.trainer.load_checkpoint(folder / "drafter")
        self.drafter_role.push()
        own = folder / f"worker_{self.rank}.pt"
        if self.tp_rank == 0 and own.is_file():
            state = load_pt(own)
            set_rng_state(state["rng"])
            self.rollout_role.engine.policy.load_state_dict(state["sd_policy"])
        ray.get(refs)
