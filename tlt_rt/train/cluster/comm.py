"""The workers' collectives: the rendezvous address rank 0 hosts, and the bucketed in-place all-reduce that
syncs gradients and averages drafter replicas."""

from __future__ import annotations

import socket

import ray
import torch
import torch.distributed as dist

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
