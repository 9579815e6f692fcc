"""The workers' collectives: the rendezvous address rank 0 hosts, and the bucketed in-place all-reduce that
syncs gradients and averages drafter replicas."""

from __future__ import annotations

import socket

import ray
import torch
import torch.distributed as dist

from tlt_rt.models.tensor_parallel import replicated_state

BUCKET_BYTES = 64 << 20  # gradient all-reduce bucket


def node_address_and_port() -> tuple[str, int]:
    """This node's address and a free port on it."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Sum `tensors` over the default process group in place, in flat buckets of about BUCKET_BYTES."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in [*tensors, None]:
        if t is not None:
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket and (t is None or size >= BUCKET_BYTES):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0


def busiest_rank(my_steps: int, device: torch.device) -> int:
    """The global rank that took the most steps (the lowest of those tied), the same answer on every rank.

    Collective over the default process group."""
    steps = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    steps[dist.get_rank()] = my_steps
    dist.all_reduce(steps)
    return int(steps.argmax())


@torch.no_grad()
def check_same_drafter(drafter, group, what: str = "drafter") -> None:
    """Raise where the ranks of `group` hold different drafters (their draft vocabularies, or the sums of their
    weights, differ; a drafter sharded like the target compares the weights every rank holds whole). Collective
    over `group`. The ranks of a tensor-parallel engine draft alike only with equal drafters; one that differs
    makes its rank verify another tree, and the engines leave lockstep silently (a collective that never
    completes, or tokens drawn from sums of the ranks' different forwards)."""
    device = next(drafter.parameters()).device
    d2t = drafter.d2t
    ids = torch.zeros(2, dtype=torch.float64, device=device)
    if d2t is not None:
        d = d2t.to(device, torch.float64)
        ids[0], ids[1] = d.sum(), (d * torch.arange(1, d.numel() + 1, device=device, dtype=torch.float64)).sum()
    sums = torch.stack(
        [t.detach().sum(dtype=torch.float64) for t in replicated_state(drafter).values() if t.is_floating_point()]
    )
    mine = torch.cat([ids, sums, torch.tensor([-1.0 if d2t is None else d2t.numel()], device=device,
                                              dtype=torch.float64)])  # fmt: skip
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differ = [r for r, other in enumerate(every) if not torch.equal(other, every[0])]
    if differ:
        raise RuntimeError(f"the {what} differs between tensor-parallel ranks (group ranks {differ} against rank 0: "
                           "draft vocabulary or weights); their engines would leave lockstep")  # fmt: skip
