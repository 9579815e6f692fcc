"""The cluster's section of the config (`cluster.`): workers, devices, placement, recovery."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tlt_rt.options import check, check_min, option, register


@register
@dataclasses.dataclass
class ClusterConfig:
    num_workers: int = option(2, help="Rollout workers (Ray actors); idle ones train the drafter.")
    gpus_per_worker: int = option(0, help="GPUs per rollout worker; 0 = CPU workers.")
    tensor_parallel: int = option(
        1,
        help="Ranks one engine shards the target over (one process each, in lockstep): GPUs, equal to "
        "gpus_per_worker; on CPU workers, processes of cpus_per_worker cores each.",
    )
    tp_allreduce: Literal["nccl", "oneshot"] = option(
        "nccl",
        help="With tensor_parallel > 1 on GPU workers, the engine's sums: NCCL, or a one-shot all-reduce over "
        "symmetric memory for those of decode size (GPUs with peer access; 1.3-1.4x TP=1's tokens/s against "
        "NCCL's 1.3x on two H200s, Qwen2.5-7B shape, batch 1).",
    )
    drafter_tp: Literal["auto", "shard", "replicate"] = option(
        "auto",
        help="With tensor_parallel > 1, the engine's drafter: its decoder layer cut over the ranks like the "
        "target's (shard: half its weights read a draft level on TP=2, two small sums), whole on every rank "
        "(replicate), or sharded where that layer holds at least 128 MiB (auto: Qwen2.5-7B's and up).",
    )
    ray_address: str | None = option(None, help="Ray cluster to join; null = start a local one.")
    cpus_per_worker: int = option(1, help="CPU cores reserved per worker (its torch thread count on CPU workers).")
    gpus_per_node: int = option(8, help="GPUs per machine, for the placement plan (--dry-run).")
    nodes: int = option(
        0,
        help="Machines the --dry-run placement plan lays the workers over (each with gpus_per_node GPUs); "
        "0 = as many as the workers need (one on CPU). A live run plans over the Ray cluster's own nodes.",
    )
    cpus_per_node: int = option(0, help="CPU cores per machine for the --dry-run placement plan; 0 = not checked.")
    placement_timeout_s: float = option(
        120.0,
        help="Seconds to wait for the workers' Ray placement groups (one per tensor-parallel group) to be "
        "reserved before failing with the resources that were missing.",
    )
    gpu_memory_gb: float = option(80.0, help="Memory of one GPU in GiB, for the placement plan's fit check.")
    collective_timeout_s: float = option(
        600.0, help="Seconds a gradient/drafter all-reduce may wait for a peer before failing the step."
    )
    split: Literal["prompts", "samples"] = option(
        "prompts",
        help="How a step's work spreads over workers: 'prompts' = each takes a range of prompts with all their "
        "answers; 'samples' = each takes every prompt with rl.group_size / num_workers of its answers, so every "
        "worker sees the same mix of short and long prompts and they finish closer together (each prefills "
        "every prompt). 'samples' needs rl.group_size divisible by num_workers.",
    )
    max_restarts: int = option(3, help="Worker restarts allowed per run; a dead worker's share is redone.")
    debug_fail: str | None = option(
        None,
        help="Testing aid: 'PHASE:RANK:STEP' (PHASE rollout or learn) makes that worker's process exit once, "
        "at that phase of that RL step, to exercise recovery.",
    )

    def __post_init__(self) -> None:
        check_min(self, "num_workers", 1)
        check_min(self, "cpus_per_worker", 1)
        check_min(self, "gpus_per_node", 1)
        check_min(self, "nodes", 0)
        check_min(self, "cpus_per_node", 0)
        check(self.placement_timeout_s > 0, "placement_timeout_s", f"must be > 0, got {self.placement_timeout_s}")
        check(self.gpu_memory_gb > 0, "gpu_memory_gb", f"must be > 0, got {self.gpu_memory_gb}")
        check(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0")
        check_min(self, "max_restarts", 0)
        if self.debug_fail is not None:
            parts = self.debug_fail.split(":")
            check(
                len(parts) == 3 and parts[0] in ("rollout", "learn") and all(p.isdigit() for p in parts[1:]),
                "debug_fail",
                f"must look like 'rollout:RANK:STEP' or 'learn:RANK:STEP', got {self.debug_fail!r}",
            )
        check_min(self, "gpus_per_worker", 0)
        check_min(self, "tensor_parallel", 1)
        gpus, tp = self.gpus_per_worker, self.tensor_parallel
        check(gpus == 0 or gpus % tp == 0, "tensor_parallel", f"must divide gpus_per_worker ({gpus}); got {tp}")
        gpu_only = f"{self.tp_allreduce!r} needs GPU workers (gpus_per_worker > 0); CPU workers sum through gloo"
        check(self.tp_allreduce == "nccl" or gpus > 0, "tp_allreduce", gpu_only)
