"""Tensor-parallel engines in lockstep: every rank of a TP group runs the same `Engine` loop on its shard.

Each collective inside the target's forward must be entered by every rank with the same shapes, so every
rank must take the same scheduling and speculative decisions. Most of the loop is a pure function of the
inputs and so agrees by itself: the scheduler and block manager are deterministic, logits are all-gathered
(identical on every rank), sampling draws counter-based uniforms from per-sequence seeds (rollout/step/rng.py),
and the drafter sees identical hidden states (whole on every rank, or sharded like the target with `drafter_tp`:
its sums give every rank the same rows). Two things are not:

- the KV block count: sized from the free GPU memory of each rank, so the ranks agree on the smallest;
- the SD policy: its `CostTable` is refined online from each rank's own wall-clock timings, so the ranks'
  choices would drift apart. `LockstepPolicy` lets rank 0 of the group decide and broadcasts the choice
  (one int64 per decode step); the other ranks' tables still learn from their timings but are never read.
  Given a CPU (gloo) group over the same ranks (`host_group`), the choice travels between the hosts: a
  broadcast on the device would be read back with a sync that waits for the step in flight, and the engine
  decides the step after a plain one while that one runs (`EngineConfig.overlap`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tlt_rt.models.llama import CausalLM
from tlt_rt.models.tensor_parallel import (
    DRAFTER_TP_KINDS,
    SHARD_DRAFTER_MIN_BYTES,
    drafter_layer_bytes,
    shard_drafter_for_tp,
)
from tlt_rt.rollout.block_manager import auto_num_blocks
from tlt_rt.rollout.config import EngineConfig, engine_config
from tlt_rt.rollout.engine import Engine
from tlt_rt.rollout.policy import SDPolicy
from tlt_rt.rollout.policy.costs import option_name


def _group_src(group) -> int:
    """The global rank of `group`'s rank 0 (broadcast takes global ranks)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


class LockstepPolicy:
    """An `SDPolicy` whose decisions come from rank 0 of `group`; everything else is the wrapped policy's.
    host_group: a gloo group of the same ranks to send them through (None: `group` itself, on `device`)."""

    def __init__(self, inner: SDPolicy, group, device: torch.device, host_group=None) -> None:
        self.inner, self.group, self.device = inner, group, device
        self.host_group = host_group
        self.src = _group_src(group)
        self.is_src = dist.get_rank() == self.src

    def decide(self, batch_size: int, behind: int = 0):
        inner = self.inner
        if inner.mode == "off":  # every rank knows this without asking
            return None
        if inner.mode == "on" and len(inner.options) == 1:  # nor this: the one strategy
            return inner.decide(batch_size, behind)
        on_host = self.host_group is not None
        code = torch.zeros(1, dtype=torch.long, device="cpu" if on_host else self.device)
        if self.is_src:
            choice = inner.decide(batch_size, behind)
            names = [option_name(o) for o in inner.options]
            code[0] = names.index(option_name(choice))
        dist.broadcast(code, src=self.src, group=self.host_group if on_host else self.group)
        return inner.options[int(code.item())]

    def observe(
        self, batch_size: int, strategy, seconds: float, tokens_per_seq: float, behind: int = 0, switched: bool = False
    ) -> None:
        self.inner.observe(batch_size, strategy, seconds, tokens_per_seq, behind, switched)

    def __getattr__(self, name: str) -> Any:  # stats, state_dict, load_state_dict, costs, ...
        if name == "inner":  # not set yet (unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.inner, name)


class TargetHeads(nn.Module):
    """The full (unsharded) embedding, final norm and LM head of a target, for a replicated drafter.

    Take it before `shard_for_tp`: the shard replaces the target's embedding and head with vocab slices, while
    this keeps the original modules. Its state names are the target's (`model.embed_tokens.weight`,
    `model.norm.weight`, `lm_head.weight`), so a full policy state updates it entry by entry.
    """

    def __init__(self, target: CausalLM) -> None:
        super().__init__()
        if getattr(target, "tp", None) is not None:
            raise ValueError("TargetHeads needs the unsharded target (take it before shard_for_tp)")
        self.arch = target.arch
        self.model = nn.Module()
        self.model.embed_tokens = target.model.embed_tokens
        self.model.norm = target.model.norm
        self.lm_head = target.lm_head


def agreed_num_blocks(target: CausalLM, block_size: int, group) -> int:
    """The automatic KV block count, the smallest over the ranks of `group` (collective)."""
    device = target.lm_head.weight.device
    n = torch.tensor([auto_num_blocks(target, block_size)], dtype=torch.long, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
    return int(n.item())


def lockstep_engine(
    target: CausalLM,
    group,
    drafter=None,
    config: EngineConfig | None = None,
    *,
    max_context: int | None = None,
    drafter_tp: str = "auto",
    host_group=None,
    **options,
) -> Engine:
    """An `Engine` on this rank's TP shard `target` that stays in lockstep with the other ranks of `group`.

    Collective: every rank of `group` calls it with the same options (and the same drafter, if any). `drafter_tp`:
    "shard" cuts the drafter's decoder layer like the target's (`shard_drafter_for_tp`, in place; its sums go
    through the target's), "replicate" keeps it whole on every rank, "auto" shards a layer of at least
    `SHARD_DRAFTER_MIN_BYTES`. host_group: a gloo group of `group`'s ranks that the SD policy's choices travel
    through (`LockstepPolicy`; `host_group_for` makes one), else they go over `group` on the device.
    """
    if drafter_tp not in DRAFTER_TP_KINDS:
        raise ValueError(f"drafter_tp must be one of {DRAFTER_TP_KINDS}, got {drafter_tp!r}")
    tp = getattr(target, "tp", None)
    if drafter is not None and tp is not None and getattr(drafter, "tp", None) is None:
        if drafter_tp == "shard" or (drafter_tp == "auto" and drafter_layer_bytes(drafter) >= SHARD_DRAFTER_MIN_BYTES):
            shard_drafter_for_tp(drafter, group, fast=tp.fast)
    cfg = engine_config(config, **options)
    if cfg.num_blocks <= 0:
        cfg = dataclasses.replace(cfg, num_blocks=agreed_num_blocks(target, cfg.block_size, group))
    engine = Engine(target, drafter, cfg, max_context=max_context)
    engine.policy = LockstepPolicy(engine.policy, group, engine.device, host_group)
    return engine


def host_group_for(ranks: list[int] | None = None):
    """A gloo group over `ranks` (None: the world) for `lockstep_engine(host_group=)`; where the world's backend
    is gloo already, None (its own group is on the host). Collective over the whole world, like every
    `dist.new_group`: every process calls it for every group, in the same order."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(ranks, backend="gloo")
