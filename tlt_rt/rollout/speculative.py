"""One speculative step for a batch: draft a tree, verify it with the target, accept, commit.

L is a sequence's cached target tokens; its pending root x_L sits at position L. The drafter catches up and
grows the tree (drafting.py, which also gives the drafter's positions); the target verifies the T tree
nodes at cache positions [L, L+T) with rotary positions L+depth; the accepted path is then moved to
[L+1, L+1+a] and the bonus token becomes the next root. The target hidden states of the root and the
accepted path move each sequence's catch-up window on, on the device, for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_rt.codegen.kernels.accept import AcceptOutput
from tlt_rt.codegen.lower import LoweredStep
from tlt_rt.ir.program import StepProgram
from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import DraftTree
from tlt_rt.rollout.drafting import DrafterRunner, DraftInputs, upload
from tlt_rt.rollout.rng import host_uniforms
from tlt_rt.rollout.runner import Sampler, TargetRunner, table_tensor, tree_meta
from tlt_rt.rollout.sequence import Sequence

__all__ = ["DrafterRunner", "EngineStepModels", "StepResult", "scratch_tokens", "speculative_step", "step_program"]


def scratch_tokens(strategy: Strategy) -> int:
    """Cache positions past L a step needs: the verify tree or the drafter's level scratch, whichever is longer."""
    return max(strategy.verify_tokens, (strategy.depth - 1) * strategy.topk)


@dataclass
class StepResult:
    accept: AcceptOutput  # on the host
    hidden: torch.Tensor  # [B, D+1, H] target hidden at the root and each accepted node (device)


class EngineStepModels:
    """The engine's side of a lowered step (`codegen.lower.StepModels`) for one batch of sequences."""

    def __init__(self, seqs: list[Sequence], prefix_lens, table_t, target: TargetRunner, drafter: DrafterRunner):
        self.seqs, self.prefix_lens, self.table_t = seqs, prefix_lens, table_t  # [B] int64, [B, W] int32
        self.target, self.drafter = target, drafter

    def draft(self, strategy: Strategy, prefix_lens, ctx_tokens, ctx_hidden, ctx_len) -> DraftTree:
        ins = DraftInputs(ctx_tokens, ctx_hidden, ctx_len, prefix_lens, self.table_t)
        return self.drafter.draft_tree(strategy, ins)

    def verify(self, tree):
        b, T = tree.tree_tokens.shape
        meta = tree_meta(self.table_t, self.prefix_lens + T, T, tree.tree_mask, self.target.block_size)
        out = self.target.run(tree.tree_tokens.flatten(), tree.positions.flatten(), meta)
        return out.logits.view(b, T, -1), out.hidden.view(b, T, -1), meta.block_tables

    def kv_layers(self):
        c = self.target.cache
        return [(c.k[i], c.v[i]) for i in range(c.num_layers)]


def step_program(strategy: Strategy, params) -> StepProgram:
    if params.greedy:
        return StepProgram.speculative(strategy, accept="greedy")
    return StepProgram.speculative(strategy, "sampled", params.temperature, params.top_k, params.top_p)


def speculative_step(
    seqs: list[Sequence],
    tables: list[list[int]],
    strategy: Strategy,
    target: TargetRunner,
    drafter: DrafterRunner,
    sampler: Sampler,
    lowered: LoweredStep,
) -> StepResult:
    """Draft, verify, accept and commit for every sequence through `lowered` (the strategy's StepProgram
    lowered for this batch's bucket); results come back to the host once."""
    device = target.device
    b, D = len(seqs), strategy.depth
    r = drafter.block_rows(strategy)
    window = drafter.prepare(seqs, tables, r)  # [B, W >= R, H]
    rows = [[s.num_cached, min(s.num_cached, r), *s.last_tokens(r)] for s in seqs]
    (lens, valid), ctx_tokens = upload(rows, 2, device)
    uniforms = host_uniforms([s.seed for s in seqs], [s.counter for s in seqs], 2 * (D + 1))
    table_t = table_tensor(tables, device)
    inputs = {
        "last_tokens": ctx_tokens[:, -1],
        "prefix_lens": lens,
        "block_table": table_t,
        "ctx_tokens": ctx_tokens,
        "ctx_hidden": window[:, -r:],
        "ctx_len": valid,
        "uniforms": torch.from_numpy(uniforms).to(device).view(b, D + 1, 2),
    }
    v = lowered(EngineStepModels(seqs, lens, table_t, target, drafter), inputs)
    # target hidden at the root and along the accepted path: positions L .. L+a
    acc = AcceptOutput(v["accept_len"], v["accepted_tokens"], v["accepted_nodes"], v["bonus"], v["logprobs"])
    nodes = torch.cat([torch.zeros_like(acc.accepted_nodes[:, :1]), acc.accepted_nodes[:, :D]], 1).clamp(min=0)
    hidden = v["hidden"]
    hid = hidden.gather(1, nodes[..., None].expand(-1, -1, hidden.shape[-1]))
    # the windows move on by a+1 rows: rows [a+1, a+1+W) of window ++ hid end at position L+a+1
    w, h = window.shape[1], window.shape[2]
    shift = (acc.accept_len.long() + 1)[:, None] + torch.arange(w, device=device)
    moved = torch.cat([window, hid.to(window.dtype)], 1).gather(1, shift[..., None].expand(-1, -1, h))
    host_acc = AcceptOutput(*(t.cpu() for t in acc))
    ends = [s.num_cached + a + 1 for s, a in zip(seqs, host_acc.accept_len.tolist(), strict=True)]
    drafter.keep_windows(seqs, moved, ends)
    return StepResult(host_acc, hid)
