"""Where the workers run: tensor-parallel (TP) groups kept inside one node, data-parallel (DP) replicas
spread round-robin over the nodes, and the Ray placement groups that reserve them.

`plan_layout` is pure (no Ray): `--dry-run` prints it for the declared nodes, a run plans over the live
Ray cluster's nodes. Each TP group is one DP replica (one engine) and becomes one STRICT_PACK placement
group with a bundle per rank ({"GPU": 1, "CPU": c}, or {"CPU": c} on CPU), so its ranks share a node.
Ray has no SPREAD across placement groups, so the DP replicas are spread by soft-targeting each group at
the node the plan gave it; Ray places a group elsewhere when that node is full or gone.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

import ray
from ray.util import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tlt_rt.options import ConfigError
from tlt_rt.train.cluster.config import ClusterConfig

MAX_LISTED_GROUPS = 32  # the dry run lists at most this many TP groups


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    gpus: int
    cpus: int | None  # None: not checked
    node_id: str | None = None  # Ray's hex node id, on a live cluster


@dataclasses.dataclass(frozen=True)
class TPGroup:
    index: int  # also its DP replica index
    node: int  # index into Layout.nodes
    worker: int
    ranks: tuple[int, ...]  # global ranks, tensor_parallel of them
    gpus: tuple[int, ...]  # GPU slots on its node; empty on CPU
    bundles: tuple[dict[str, int], ...]  # one per rank
    strategy: str = "STRICT_PACK"


@dataclasses.dataclass(frozen=True)
class Layout:
    nodes: tuple[Node, ...]
    tensor_parallel: int
    groups_per_worker: int
    groups: tuple[TPGroup, ...]
    dp_strategy: str = "SPREAD"  # how DP replicas are laid over nodes (round-robin, soft-targeted)

    @property
    def dp_replicas(self) -> int:
        return len(self.groups)

    def groups_on(self, node: int) -> list[TPGroup]:
        return [g for g in self.groups if g.node == node]

    def worker_bundle(self, worker: int, tp_rank: int = 0) -> tuple[int, int]:
        """(placement group, bundle) of TP rank `tp_rank` of a worker (one TP group per worker)."""
        if self.groups_per_worker != 1:
            raise NotImplementedError("a worker holding several TP groups (gpus_per_worker > tensor_parallel) "
                                      "is not launched")  # fmt: skip
        if not 0 <= tp_rank < self.tensor_parallel:
            raise ValueError(f"tp_rank {tp_rank} outside a tensor-parallel group of {self.tensor_parallel}")
        return worker, tp_rank

    def describe(self) -> list[str]:
        gpu = any(g.gpus for g in self.groups)
        lines = [f"nodes      {_nodes_text(self.nodes, gpu)}"]
        b = self.groups[0].bundles[0]
        lines.append(
            f"layout     {len(self.groups)} TP group(s) of {self.tensor_parallel} {'GPU' if gpu else 'CPU worker'}"
            f"(s), each a STRICT_PACK placement group of {self.tensor_parallel} x {b}; {self.dp_replicas} DP "
            f"replica(s) spread round-robin over {len(self.nodes)} node(s)"
        )
        for g in self.groups[:MAX_LISTED_GROUPS]:
            where = f"GPUs {_span(g.gpus)}" if g.gpus else "CPU"
            lines.append(f"  tp{g.index:<4} DP replica {g.index:<4} on {self.nodes[g.node].name:<16} {where:<10} "
                         f"ranks {_span(g.ranks):<8} worker {g.worker}")  # fmt: skip
        if len(self.groups) > MAX_LISTED_GROUPS:
            lines.append(f"  ... {len(self.groups) - MAX_LISTED_GROUPS} more")
        per_node = ", ".join(f"{n.name}: {len(self.groups_on(i))}" for i, n in enumerate(self.nodes))
        lines.append(f"  groups per node: {per_node}")
        return lines


def _span(xs: tuple[int, ...]) -> str:
    return str(xs[0]) if len(xs) == 1 else f"{xs[0]}-{xs[-1]}"


def _nodes_text(nodes: tuple[Node, ...], gpu: bool) -> str:
    def one(n: Node) -> str:
        parts = ([f"{n.gpus} GPUs"] if gpu else []) + ([f"{n.cpus} CPUs"] if n.cpus is not None else [])
        return ", ".join(parts) or "CPU"

    kinds = {one(n) for n in nodes}
    if len(kinds) == 1:
        return f"{len(nodes)} x {kinds.pop()} ({nodes[0].name}{' .. ' + nodes[-1].name if len(nodes) > 1 else ''})"
    return "; ".join(f"{n.name}: {one(n)}" for n in nodes)


def _nodes_from(c: ClusterConfig, nodes: list[dict] | None) -> tuple[tuple[Node, ...], str]:
    """The nodes to plan over, and the config key that an error about their number should name."""
    if nodes is not None:
        if not nodes:
            raise ConfigError("cluster.nodes", "the cluster has no nodes to place workers on")
        out = tuple(
            Node(str(d.get("name") or f"node-{i}"), int(d.get("gpus") or 0),
                 None if d.get("cpus") is None else int(d["cpus"]), d.get("node_id"))
            for i, d in enumerate(nodes)
        )  # fmt: skip
        return out, "cluster.num_workers"
    gpus = c.gpus_per_node if c.gpus_per_worker else 0
    count = c.nodes or (math.ceil(c.num_workers * c.gpus_per_worker / c.gpus_per_node) if gpus else 1)
    return tuple(Node(f"node-{i}", gpus, c.cpus_per_node or None) for i in range(count)), "cluster.nodes"


def plan_layout(cluster_cfg: ClusterConfig, nodes: list[dict] | None = None) -> Layout:
    """TP groups (never crossing a node), spread round-robin over `nodes` ([{gpus, cpus, name}], None = the
    nodes the config declares); raises ConfigError when the workers cannot be placed."""
    c = cluster_cfg
    node_list, count_key = _nodes_from(c, nodes)
    tp, cpus = c.tensor_parallel, c.cpus_per_worker
    gpu = c.gpus_per_worker > 0
    per_worker = max(1, c.gpus_per_worker // tp) if gpu else 1
    n_groups = c.num_workers * per_worker
    if gpu:
        most = max(node_list, key=lambda n: n.gpus)
        if tp > most.gpus:
            raise ConfigError("cluster.tensor_parallel", f"{tp} is larger than any node's GPUs (most: {most.gpus}, "
                              f"on {most.name}); a tensor-parallel group must fit inside one node")  # fmt: skip
        for n in node_list:
            if n.gpus % tp:
                raise ConfigError(
                    "cluster.tensor_parallel",
                    f"{tp} does not divide the {n.gpus} GPUs of {n.name}; "
                    "TP groups may not cross nodes, so every node's GPUs must split into whole groups",
                )
    bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
    free = []
    for n in node_list:
        slots = n.gpus // tp if gpu else math.inf
        if n.cpus is not None:
            slots = min(slots, n.cpus // (cpus * tp))
        free.append(slots)
    if sum(free) < n_groups:
        need = f"{n_groups * tp} GPUs" if gpu else f"{n_groups * cpus} CPUs"
        have = [f"{sum(n.gpus for n in node_list)} GPUs"] if gpu else []
        if any(n.cpus is not None for n in node_list):
            have.append(f"{sum(n.cpus or 0 for n in node_list)} CPUs")
        raise ConfigError(
            count_key,
            f"{c.num_workers} worker(s) need {n_groups} group(s) of {tp} x {bundle} = {need}, but the "
            f"{len(node_list)} node(s) hold {', '.join(have)}: room for {int(sum(free))} group(s)",
        )
    used = [0] * len(node_list)
    groups, cursor = [], 0
    for g in range(n_groups):
        while free[cursor % len(node_list)] <= 0:
            cursor += 1
        i = cursor % len(node_list)
        free[i] -= 1
        slot = used[i]
        used[i] += 1
        cursor += 1
        ranks, gpus = tuple(range(g * tp, (g + 1) * tp)), tuple(range(slot * tp, (slot + 1) * tp)) if gpu else ()
        groups.append(TPGroup(g, i, g // per_worker, ranks, gpus, tuple(dict(bundle) for _ in range(tp))))
    return Layout(node_list, tp, per_worker, tuple(groups))


# ------------------------------------------------------------------------------------------ Ray side
class PlacementError(RuntimeError):
    """The cluster did not reserve a placement group in time."""


def ray_nodes() -> list[dict]:
    """The live Ray cluster's nodes as `plan_layout` takes them (with their node ids for soft targeting)."""
    out = []
    for n in ray.nodes():
        if n.get("Alive"):
            res = n.get("Resources", {})
            out.append(dict(name=n.get("NodeManagerAddress") or n["NodeID"][:8], gpus=int(res.get("GPU", 0)),
                            cpus=int(res.get("CPU", 0)), node_id=n["NodeID"]))  # fmt: skip
    return out


def create_placement_groups(layout: Layout, timeout_s: float = 120.0, name: str = "tlt") -> list[Any]:
    """One STRICT_PACK placement group per TP group, soft-targeted at its planned node; waits until all are
    reserved, or removes them and raises PlacementError naming the group that was not."""
    name = f"{name}-{uuid.uuid4().hex[:6]}"  # placement group names are unique cluster-wide
    pgs = [
        placement_group(list(g.bundles), strategy=g.strategy, name=f"{name}-tp{g.index}",
                        _soft_target_node_id=layout.nodes[g.node].node_id)
        for g in layout.groups
    ]  # fmt: skip
    deadline = time.monotonic() + timeout_s
    for g, pg in zip(layout.groups, pgs, strict=True):
        if not pg.wait(max(0.0, deadline - time.monotonic())):
            free = ray.available_resources()
            for p in pgs:
                remove_placement_group(p)
            raise PlacementError(
                f"placement group {name}-tp{g.index} ({len(g.bundles)} x {g.bundles[0]} on one node, planned on "
                f"{layout.nodes[g.node].name}) was not reserved within {timeout_s:.0f} s; free in the cluster: "
                f"{ {k: v for k, v in free.items() if k in ('CPU', 'GPU')} }. Fewer free resources than the "
                "layout, or no node that holds a whole TP group; raise cluster.placement_timeout_s if nodes are "
                "still joining"
            )
    return pgs


def scheduling_strategy(pgs: list[Any], layout: Layout, worker: int, tp_rank: int = 0) -> Any:
    """What a worker's actor (its TP rank's) is launched with: its bundle in its TP group's placement group."""
    group, bundle = layout.worker_bundle(worker, tp_rank)
    return PlacementGroupSchedulingStrategy(placement_group=pgs[group], placement_group_bundle_index=bundle)


def remove_placement_groups(pgs: list[Any]) -> None:
    for pg in pgs:
        remove_placement_group(pg)
