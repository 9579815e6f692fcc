"""Lowering: (StepProgram, Bucket, device) -> the step callable the engine runs.

    step = lower(StepProgram.speculative("8_4_48", accept="sampled", temperature=0.9), bucket, "cuda")
    out = step(models, inputs)          # inputs / outputs: the named tensors of `StepProgram.signature`

Lowering is a straight sequence of passes: verify the program, check it against the bucket, then emit
one call per node from the table `EMIT` (op -> function). Each emitted function reads and writes the
step's named tensors, so the data flow is exactly the IR's. On CUDA the calls are the Triton kernels
(acceptance, KV commit; attention runs inside the models' forwards), on CPU their torch references.
The models are not part of the program: the engine supplies them through `StepModels`, whose draft (the
whole drafter step, tree included) and verify replay CUDA graphs per bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tlt_rt.codegen.kernels.accept import accept_tree
from tlt_rt.codegen.kernels.kv_commit import kv_commit, kv_commit_reference
from tlt_rt.ir.program import Op, StepProgram
from tlt_rt.ir.strategy import Bucket, Strategy
from tlt_rt.ir.tree import DraftTree, root_only_tree

Values = dict[str, Any]


class StepModels(Protocol):
    """What a lowered step needs from the engine: the two models' forwards and the caches to commit."""

    def draft(self, strategy: Strategy, prefix_lens, ctx_tokens, ctx_hidden, ctx_len) -> DraftTree:
        """Catch the drafter up on the block ctx_tokens / ctx_hidden (see `StepProgram.step_inputs`), grow the
        candidate tree level by level from each root ctx_tokens[:, -1] and rerank it (`ir.tree.build_tree`).
        No host sync, shapes fixed by the bucket: the engine replays it as one CUDA graph."""

    def verify(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Target forward over the tree: logits [B, T, V], hidden [B, T, H], block tables [B, max_blocks]."""

    def kv_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(k_cache, v_cache) of every target layer, for the commit."""


@dataclass(frozen=True)
class LoweredStep:
    program: StepProgram
    bucket: Bucket
    device: torch.device
    calls: tuple[tuple[str, Callable[..., None]], ...]  # (node op name, emitted function) in program order

    def __call__(self, models: StepModels, inputs: Values) -> Values:
        values: Values = dict(inputs)
        for _, fn in self.calls:
            fn(models, values)
        return values

    def __str__(self) -> str:
        lines = [f"lowered for {self.bucket} on {self.device}:"]
        lines += [f"  {op:7} -> {fn.__name__}" for op, fn in self.calls]
        return "\n".join(lines)


# ---- emission: one function per op -------------------------------------------------------------------
def _emit_draft(node, device):
    strategy = Strategy(node["depth"], node["topk"], node["verify_tokens"])

    def draft(models: StepModels, v: Values) -> None:
        v["tree"] = models.draft(strategy, v["prefix_lens"], v["ctx_tokens"], v["ctx_hidden"], v["ctx_len"])

    return draft


def _emit_verify(node, device):
    def verify(models: StepModels, v: Values) -> None:
        if "tree" not in v:  # plain decode: a tree of the root alone
            v["tree"] = root_only_tree(v["last_tokens"].long(), v["prefix_lens"])
        v["logits"], v["hidden"], v["block_table"] = models.verify(v["tree"])

    return verify


def _emit_accept(node, device):
    greedy = node["mode"] == "greedy"
    depth = node["depth"]
    # the filtering walk for a filtered program, or a sampled one whose own settings filter
    filtering = node["mode"] == "filtered" or (not greedy and (node["top_k"] > 0 or node["top_p"] < 1.0))
    backend = "triton" if device.type == "cuda" else "torch"

    def accept(models: StepModels, v: Values) -> None:
        tree: DraftTree = v["tree"]
        b = tree.tree_tokens.shape[0]
        dev = tree.tree_tokens.device
        # per-row settings where the caller gives them (one captured step serves every temperature of
        # its mode); the node's attributes otherwise
        temp = v.get("temperature")
        if temp is None:
            temp = torch.full((b,), float(node["temperature"]), device=dev)
        top_k = v.get("top_k")
        if top_k is None:
            top_k = torch.full((b,), int(node["top_k"]), dtype=torch.int32, device=dev)
        top_p = v.get("top_p")
        if top_p is None:
            top_p = torch.full((b,), float(node["top_p"]), device=dev)
        uniforms = v.get("uniforms")
        if uniforms is None:  # greedy acceptance reads none
            uniforms = torch.zeros(b, depth + 1, 2, device=dev)
        out = accept_tree(
            v["logits"],
            tree.tree_tokens,
            tree.parents,
            temp,
            top_k,
            top_p,
            uniforms,
            depth,
            all_greedy=greedy,
            filtering=filtering,
            backend=backend,
        )
        v.update(out._asdict())

    return accept


def _emit_commit(node, device):
    commit = kv_commit if device.type == "cuda" else kv_commit_reference

    def commit_kv(models: StepModels, v: Values) -> None:
        if node["depth"] > 0:  # plain decode wrote its one row in place already
            commit(models.kv_layers(), v["block_table"], v["prefix_lens"], v["accepted_nodes"], v["accept_len"])
        v["new_prefix_lens"] = v["prefix_lens"] + v["accept_len"] + 1

    return commit_kv


EMIT: dict[Op, Callable] = {Op.DRAFT: _emit_draft, Op.VERIFY: _emit_verify, Op.ACCEPT: _emit_accept,
                            Op.COMMIT: _emit_commit}  # fmt: skip


# ---- passes -------------------------------------------------------------------------------------------
def _check_bucket(program: StepProgram, bucket: Bucket) -> None:
    if program.strategy != bucket.strategy:
        raise ValueError(f"bucket {bucket} serves strategy {bucket.strategy}, the program {program.strategy}")


def lower(program: StepProgram, bucket: Bucket, device: torch.device | str) -> LoweredStep:
    """Verify `program`, check it fits `bucket`, and emit one call per node for `device`."""
    device = torch.device(device)
    program.verify()
    _check_bucket(program, bucket)
    calls = tuple((n.op.name, EMIT[n.op](n, device)) for n in program.nodes)
    return LoweredStep(program, bucket, device, calls)
