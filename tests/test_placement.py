"""Placement: TP groups never cross a node, DP replicas spread round-robin, Ray placement groups reserved."""

from __future__ import annotations

import os

import pytest

from tlt_rt.config import ClusterConfig, ConfigError
from tlt_rt.train.__main__ import main as train_main
from tlt_rt.train.cluster.placement import (
    create_placement_groups,
    plan_layout,
    remove_placement_groups,
    scheduling_strategy,
)


def nodes(count: int, gpus: int, cpus: int | None = None) -> list[dict]:
    return [dict(name=f"n{i}", gpus=gpus, cpus=cpus) for i in range(count)]


def check_never_split(layout, tp: int) -> None:
    for g in layout.groups:
        assert len(g.bundles) == len(g.ranks) == len(g.gpus) == tp
        assert g.gpus[-1] < layout.nodes[g.node].gpus  # every rank on its group's node
    slots = [(g.node, s) for g in layout.groups for s in g.gpus]
    assert len(slots) == len(set(slots))  # no GPU taken twice
    assert [r for g in layout.groups for r in g.ranks] == list(range(len(layout.groups) * tp))


# (workers, gpus_per_worker, tp, node count, gpus per node) -> node of each TP group
PLANS = [
    ((4, 8, 8, 4, 8), [0, 1, 2, 3]),
    ((4, 2, 2, 2, 4), [0, 1, 0, 1]),
    ((8, 4, 4, 4, 8), [0, 1, 2, 3, 0, 1, 2, 3]),
    ((3, 1, 1, 2, 8), [0, 1, 0]),
    ((2, 4, 2, 2, 4), [0, 1, 0, 1]),  # two engines per worker
]


@pytest.mark.parametrize(("shape", "expect"), PLANS, ids=lambda x: str(x))
def test_plan_table(shape, expect):
    workers, per_worker, tp, n, gpus = shape
    c = ClusterConfig(num_workers=workers, gpus_per_worker=per_worker, tensor_parallel=tp)
    layout = plan_layout(c, nodes(n, gpus))
    assert [g.node for g in layout.groups] == expect
    assert layout.dp_replicas == len(expect)
    check_never_split(layout, tp)
    assert all(g.strategy == "STRICT_PACK" and g.bundles[0] == {"GPU": 1, "CPU": 1} for g in layout.groups)
    assert [g.worker for g in layout.groups] == [i // (per_worker // tp) for i in range(len(expect))]


def test_llama_shape_from_config_nodes():
    c = ClusterConfig(num_workers=4, gpus_per_worker=8, tensor_parallel=8, nodes=4, gpus_per_node=8)
    layout = plan_layout(c)
    assert [(g.node, g.gpus) for g in layout.groups] == [(i, tuple(range(8))) for i in range(4)]
    assert [n.name for n in layout.nodes] == ["node-0", "node-1", "node-2", "node-3"]
    # nodes=0: as many as the GPUs need
    assert len(plan_layout(ClusterConfig(num_workers=3, gpus_per_worker=4, tensor_parallel=4)).nodes) == 2


def test_full_nodes_are_skipped_and_cpu_counts():
    c = ClusterConfig(num_workers=3, gpus_per_worker=2, tensor_parallel=2, cpus_per_worker=4)
    layout = plan_layout(c, [dict(name="a", gpus=2, cpus=8), dict(name="b", gpus=8, cpus=64)])
    assert [g.node for g in layout.groups] == [0, 1, 1]
    check_never_split(layout, 2)
    assert layout.groups[0].bundles == ({"GPU": 1, "CPU": 4},) * 2


def test_cpu_layout():
    c = ClusterConfig(num_workers=5, cpus_per_worker=2)
    layout = plan_layout(c, nodes(2, 0, cpus=6))
    assert [g.node for g in layout.groups] == [0, 1, 0, 1, 0]
    assert all(g.bundles == ({"CPU": 2},) and g.gpus == () for g in layout.groups)
    assert layout.worker_bundle(3) == (3, 0)
    assert len(plan_layout(ClusterConfig(num_workers=2)).nodes) == 1


@pytest.mark.parametrize(
    ("cluster", "node_list", "key", "words"),
    [
        (dict(num_workers=1, gpus_per_worker=16, tensor_parallel=16), nodes(4, 8), "tensor_parallel", "larger"),
        (dict(num_workers=5, gpus_per_worker=8, tensor_parallel=8), nodes(4, 8), "num_workers", "40 GPUs"),
        (dict(num_workers=2, gpus_per_worker=4, tensor_parallel=4), nodes(2, 6), "tensor_parallel", "divide"),
        (dict(num_workers=4, cpus_per_worker=2), nodes(1, 0, cpus=6), "num_workers", "8 CPUs"),
        (dict(num_workers=5, gpus_per_worker=8, tensor_parallel=8, nodes=4), None, "nodes", "room for 4"),
        (dict(num_workers=1), [], "nodes", "no nodes"),
    ],
)
def test_plan_errors(cluster, node_list, key, words):
    with pytest.raises(ConfigError) as e:
        plan_layout(ClusterConfig(**cluster), node_list)
    assert e.value.key == f"cluster.{key}" and words in e.value.msg


def test_tp_ranks_take_their_bundles():
    layout = plan_layout(ClusterConfig(num_workers=2, gpus_per_worker=2, tensor_parallel=2), nodes(1, 8))
    assert [layout.worker_bundle(1, t) for t in range(2)] == [(1, 0), (1, 1)]
    with pytest.raises(ValueError, match="tp_rank 2"):
        layout.worker_bundle(0, 2)
    cpu = plan_layout(ClusterConfig(num_workers=1, tensor_parallel=2, cpus_per_worker=2), nodes(1, 0, cpus=4))
    assert cpu.groups[0].bundles == ({"CPU": 2},) * 2
    # several TP groups in one worker (gpus_per_worker > tensor_parallel) stay unlaunched
    layout = plan_layout(ClusterConfig(num_workers=1, gpus_per_worker=4, tensor_parallel=2), nodes(1, 8))
    with pytest.raises(NotImplementedError):
        layout.worker_bundle(0)


def test_dry_run_prints_the_layout(capsys):
    assert train_main(["configs/llama70b.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 x 8 GPUs" in out and "4 TP group(s) of 8" in out and "STRICT_PACK" in out
    for i in range(4):
        assert f"tp{i}" in out and f"on node-{i}" in out
    assert train_main(["configs/llama70b.yaml", "--dry-run", "cluster.num_workers=5"]) == 2
    assert "cluster.nodes" in capsys.readouterr().err


def test_actors_run_in_their_placement_groups():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        layout = plan_layout(ClusterConfig(num_workers=2), [dict(name="local", gpus=0, cpus=2)])
        pgs = create_placement_groups(layout, timeout_s=30)

        @ray.remote(num_cpus=1)
        class Tiny:
            def where(self) -> tuple[str, str]:
                ctx = ray.get_runtime_context()
                return ctx.get_placement_group_id(), ctx.get_node_id()

        actors = [Tiny.options(scheduling_strategy=scheduling_strategy(pgs, layout, r)).remote() for r in range(2)]
        got = ray.get([a.where.remote() for a in actors], timeout=30)
        assert [g for g, _ in got] == [pg.id.hex() for pg in pgs]
        # the 2 CPUs are all reserved: a third group cannot be placed, and says so in time
        from tlt_rt.train.cluster.placement import PlacementError

        with pytest.raises(PlacementError, match="not reserved within"):
            create_placement_groups(plan_layout(ClusterConfig(num_workers=1), None), timeout_s=1)
        for a in actors:
            ray.kill(a)
        remove_placement_groups(pgs)
    finally:
        ray.shutdown()
