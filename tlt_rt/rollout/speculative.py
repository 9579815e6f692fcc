"""One speculative step for a batch: draft a tree, verify it with the target, accept, commit.

Positions (L = a sequence's cached target tokens; its pending root x_L sits at position L):
- drafter row p pairs the target hidden h_p with token x_{p+1} and predicts h_{p+1}. Rows [draft_cached, L)
  are caught up first from stored target hidden states (this is also how SD switches on after plain
  decoding without re-prefilling anything); row L-1 is the root's, whose output drafts depth 1.
- a node at tree depth d is drafter row L+d-1; level d writes its topk rows to drafter cache positions
  [L+(d-1)K, L+dK) and sees, inside that window, only its own ancestors (a tree mask of width dK).
- the target verifies the T tree nodes at cache positions [L, L+T) with rotary positions L+depth; the
  accepted path is then moved to [L+1, L+1+a] and the bonus token becomes the next root.
Drafter rows for accepted tokens are recomputed from the target's own hidden states at the next step
rather than committed from the draft, so the drafter always conditions on true features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_rt.codegen.kernels.accept import AcceptOutput
from tlt_rt.codegen.lower import LoweredStep
from tlt_rt.ir.program import StepProgram
from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import Candidates
from tlt_rt.models.llama import KVCache
from tlt_rt.rollout.rng import counter_uniforms
from tlt_rt.rollout.runner import Layout, PagedForward, Sampler, TargetRunner, build_meta, table_tensor, tree_meta
from tlt_rt.rollout.sequence import Sequence


def scratch_tokens(strategy: Strategy) -> int:
    """Cache positions past L a step needs: the verify tree or the drafter's level scratch, whichever is longer."""
    return max(strategy.verify_tokens, (strategy.depth - 1) * strategy.topk)


@dataclass
class StepResult:
    accept: AcceptOutput  # on the host
    hidden: torch.Tensor  # [B, D+1, H] target hidden at the root and each accepted node (device)


class DrafterRunner:
    """The drafter's one-layer paged cache and its forwards; shares the target's block tables."""

    def __init__(self, drafter, num_blocks: int, block_size: int, buckets=None, max_blocks: int = 0):
        self.drafter = drafter
        self.block_size = block_size
        self.cache: KVCache = drafter.make_cache(num_blocks + 1, block_size)  # + the trash block
        device = drafter.fc.weight.device
        self.run = PagedForward(
            lambda i, p, c, m, e, rows: drafter.forward_paged(i, e, p, c, m, logits_indices=rows),
            self.cache, device, buckets, max_blocks, extra_dim=drafter.fc.weight.shape[0],
        )  # fmt: skip

    @torch.no_grad()
    def catch_up(self, seqs: list[Sequence], tables: list[list[int]], device):
        """Run drafter rows [draft_cached, num_cached) of every sequence; return the last row's logits/hidden."""
        ids, hidden, layout = [], [], Layout(tables, [], [], [], [])
        for s in seqs:
            c, L = s.draft_cached, s.num_cached
            toks = s.tokens
            ids += toks[c + 1 : L + 1]
            hidden.append(s.hidden_rows(c, L))
            layout.q_lens.append(L - c)
            layout.seq_lens.append(L)
            layout.positions.append(list(range(c, L)))
            layout.cache_pos.append(list(range(c, L)))
        meta, positions = build_meta(layout, "prefill", self.block_size, device)
        last = torch.tensor(layout.q_lens).cumsum(0) - 1
        out = self.drafter.forward_paged(
            torch.tensor(ids, device=device),
            self.drafter.features(torch.cat(hidden).to(device)),
            positions,
            self.cache,
            meta,
            logits_indices=last.to(device),
        )
        for s in seqs:
            s.draft_cached = s.num_cached
        return out.logits, out.hidden[last.to(device)]

    @torch.no_grad()
    def draft(
        self, seqs: list[Sequence], tables: list[list[int]], table_t: torch.Tensor, strategy: Strategy, device
    ) -> Candidates:
        """Grow the candidate tree level by level (EAGLE-2 expansion); returns every candidate.

        tables: the block tables as lists (for the catch-up's host-built layout); table_t: the same on the device.
        """
        k, depth = strategy.topk, strategy.depth
        root_logits, root_hidden = self.catch_up(seqs, tables, device)
        cached = torch.tensor([s.num_cached for s in seqs], device=device)
        cands = Candidates.start(torch.log_softmax(root_logits.float(), -1), k)
        b = len(seqs)
        # flat candidate -> its row in the scratch window, sized for every candidate the step will have
        slot_of = torch.full((b, strategy.num_candidates), -1, dtype=torch.long, device=device)
        prev_front, prev_hidden = None, root_hidden[:, None].expand(b, k, -1)
        for d in range(1, depth):
            front = cands.frontier()  # [B, K]
            if prev_front is None:
                parent_hidden = prev_hidden
            else:
                parent = cands.parents.gather(1, front)
                which = (prev_front[:, None, :] == parent[:, :, None]).float().argmax(-1)  # [B, K]
                parent_hidden = prev_hidden.gather(1, which[..., None].expand(-1, -1, prev_hidden.shape[-1]))
            slot_of.scatter_(1, front, (d - 1) * k + torch.arange(k, device=device).expand(b, k))
            anc = cands.ancestry(front)  # [B, K, levels]
            anc_slot = torch.where(anc >= 0, slot_of.gather(1, anc.clamp(min=0).flatten(1)).view_as(anc), -1)
            w = d * k
            mask = torch.zeros(b, k, w + 1, dtype=torch.bool, device=device)
            mask.scatter_(2, torch.where(anc_slot >= 0, anc_slot, w), True)
            mask = mask[..., :w]
            # level d's k rows: rotary position L+d-1, cache positions [L+(d-1)k, L+dk)
            meta = tree_meta(table_t, cached + w, k, mask, self.block_size)
            positions = (cached + d - 1).repeat_interleave(k)
            tokens = cands.tokens.gather(1, front)
            out = self.run(tokens.flatten(), positions, meta, extra=parent_hidden.reshape(b * k, -1))
            logp = torch.log_softmax(out.logits.float(), -1).view(b, k, -1)
            cands = cands.grow(front, logp)
            prev_front, prev_hidden = front, out.hidden.view(b, k, -1)
        return cands


class EngineStepModels:
    """The engine's side of a lowered step (`codegen.lower.StepModels`) for one batch of sequences."""

    def __init__(self, seqs: list[Sequence], tables: list[list[int]], target: TargetRunner, drafter: DrafterRunner):
        self.seqs, self.tables, self.target, self.drafter = seqs, tables, target, drafter
        self.table_t = table_tensor(tables, target.device)  # the batch's block tables on the device, once a step

    def draft(self, strategy: Strategy) -> Candidates:
        return self.drafter.draft(self.seqs, self.tables, self.table_t, strategy, self.target.device)

    def verify(self, tree):
        seqs, T = self.seqs, tree.tree_tokens.shape[1]
        dev = self.target.device
        cached = torch.tensor([s.num_cached for s in seqs], device=dev)
        meta = tree_meta(self.table_t, cached + T, T, tree.tree_mask, self.target.block_size)
        out = self.target.run(tree.tree_tokens.flatten(), tree.positions.flatten(), meta)
        b = len(seqs)
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
    seeds = torch.tensor([s.seed for s in seqs], device=device)
    counters = torch.tensor([s.counter for s in seqs], device=device)
    inputs = {
        "last_tokens": torch.tensor([s.tokens[-1] for s in seqs], device=device),
        "prefix_lens": torch.tensor([s.num_cached for s in seqs], device=device),
        "uniforms": counter_uniforms(seeds, counters, 2 * (D + 1)).view(b, D + 1, 2),
    }
    v = lowered(EngineStepModels(seqs, tables, target, drafter), inputs)
    # target hidden at the root and along the accepted path: positions L .. L+a
    acc = AcceptOutput(v["accept_len"], v["accepted_tokens"], v["accepted_nodes"], v["bonus"], v["logprobs"])
    nodes = torch.cat([torch.zeros_like(acc.accepted_nodes[:, :1]), acc.accepted_nodes[:, :D]], 1).clamp(min=0)
    hidden = v["hidden"]
    hid = hidden.gather(1, nodes[..., None].expand(-1, -1, hidden.shape[-1]))
    return StepResult(AcceptOutput(*(t.cpu() for t in acc)), hid)
