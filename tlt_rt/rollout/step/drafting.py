"""The drafter's eager side of a speculative step: its paged cache, the catch-up beyond the block, the draft inputs.

What a step drafts on the device (the catch-up block, the levels, the rerank) is the step program's
CATCHUP / LEVEL / RERANK nodes, lowered in codegen (codegen/draft.py says where each row sits). This module
keeps the drafter within reach of them: a sequence further behind than the block (speculation switched on
after plain decoding, or a recomputed one) first runs rows [draft_cached, L-R) through an eager prefill-style
forward (`DrafterRunner.catch_up`); the hidden windows the block reads between steps are kept by `DraftWindows`
(rollout/step/draft_windows.py). In auto mode R is one row more than the deepest strategy's depth + 1, so one
plain step in between leaves no sequence beyond the block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tlt_rt.codegen.draft import DraftInputs, draft_candidates
from tlt_rt.ir.strategy import Strategy
from tlt_rt.ir.tree import Candidates
from tlt_rt.models.drafter_catchup import catch_up_rows
from tlt_rt.models.llama import KVCache
from tlt_rt.rollout.sequence import Sequence, flush_hidden
from tlt_rt.rollout.step.draft_windows import DraftWindows, PlainRun
from tlt_rt.rollout.step.target import Layout, build_meta, to_device

__all__ = ["DrafterRunner", "PlainRun", "upload"]


class DrafterRunner(DraftWindows):
    """The drafter's one-layer paged cache (sharing the target's block tables) and its step, over the
    hidden windows of `DraftWindows` (window_rows: see there).
    """

    def __init__(self, drafter, num_blocks: int, block_size: int, window_rows: int = 0):
        super().__init__(window_rows, drafter.fc.weight.device)
        self.drafter = drafter
        self.block_size = block_size
        self.cache: KVCache = drafter.make_cache(num_blocks + 1, block_size)  # + the trash block

    def rows_behind(self, seqs: list[Sequence], ahead: int = 0) -> int:
        """Drafter rows of `seqs` a speculative step would catch up eagerly before its block (beyond the window),
        `ahead` plain steps from now (queued, not yet postprocessed)."""
        rows = self.window_rows - ahead
        return sum(max(0, s.num_cached - s.draft_cached - rows) for s in seqs)

    def block_rows(self, strategy: Strategy) -> int:
        """Rows of the catch-up block a step of `strategy` runs: window_rows, at least its depth + 1."""
        return max(strategy.depth + 1, self.window_rows)

    @torch.no_grad()
    def catch_up(self, seqs: list[Sequence], tables: list[list[int]], ends: list[int] | None = None):
        """Eagerly run drafter rows [draft_cached, end) of every sequence (end: num_cached unless given);
        returns the last row's logits over the draft vocabulary and its hidden."""
        ends = [s.num_cached for s in seqs] if ends is None else ends
        ids, hidden, layout = [], [], Layout(tables, [], [])
        for s, end in zip(seqs, ends, strict=True):
            c = s.draft_cached
            ids += s.tokens[c + 1 : end + 1]
            hidden.append(s.hidden_rows(c, end))
            layout.starts.append(c)
            layout.q_lens.append(end - c)
            s.draft_cached = end
        meta, positions = build_meta(layout, "prefill", self.block_size, self.device)
        last = meta.cu_seqlens_q[1:].long() - 1  # each sequence's last row
        feats = self.drafter.features((hidden[0] if len(hidden) == 1 else torch.cat(hidden)).to(self.device))
        tokens = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        # every row's K/V; the layer's attention, MLP and head for each sequence's last row only
        out = catch_up_rows(self.drafter, tokens, feats, positions, self.cache, meta, last)
        return out.logits, out.hidden

    def prepare(self, seqs: list[Sequence], tables: list[list[int]], rows: int) -> Tensor:
        """Bring every sequence within `rows` of its cache (eager catch-up for those further behind) and
        return the target hidden windows [B, max(rows, window_rows), H] ending at each num_cached. Marks the
        drafter rows as cached: the caller runs the block. `tables[i]`: sequence i's block table (a list of
        lists or a `block_manager.Tables`)."""
        self.settle_windows()
        behind = [i for i, s in enumerate(seqs) if s.num_cached - s.draft_cached > rows]
        if behind:
            flush_hidden(seqs)
            ends = [seqs[i].num_cached - rows for i in behind]
            self.catch_up([seqs[i] for i in behind], [tables[i] for i in behind], ends)
        width = max(rows, self.window_rows)
        for s in seqs:
            s.draft_cached = s.num_cached
        current = self._current_windows(seqs, width)
        if current is not None:
            return current
        flush_hidden(seqs)  # the logged rows of every sequence at once, before any window reads them
        return torch.stack([self._window(s, width) for s in seqs])

    @torch.no_grad()
    def draft(
        self, seqs: list[Sequence], tables: list[list[int]], table_t: Tensor, strategy: Strategy, device=None
    ) -> Candidates:
        """Every candidate of one eager draft for `seqs` (catching up as needed); table_t: `tables` on the device
        (`device` is the runner's own and only accepted for the caller's convenience)."""
        ins = self.inputs(seqs, tables, table_t, strategy)
        return draft_candidates(self.drafter, self.cache, strategy, self.block_size, ins)

    def inputs(self, seqs: list[Sequence], tables: list[list[int]], table_t: Tensor, strategy: Strategy):
        """DraftInputs for `seqs` (see `prepare`), built with one host-to-device copy."""
        r = self.block_rows(strategy)
        window = self.prepare(seqs, tables, r)
        rows = [[s.num_cached, min(s.num_cached, r), *s.last_tokens(r)] for s in seqs]
        (lens, valid), tokens = upload(rows, 2, self.device)
        return DraftInputs(tokens, window[:, -r:], valid, lens, table_t)


def upload(rows: list[list[int]], scalars: int, device) -> tuple[list[Tensor], Tensor]:
    """Host int rows [B, scalars + C] -> the first `scalars` columns as contiguous [B] int64 device tensors
    and the rest as a contiguous [B, C], with one host-to-device copy."""
    host = torch.tensor(rows, dtype=torch.long)
    b = host.shape[0]
    dev = torch.cat([host[:, :scalars].t().reshape(-1), host[:, scalars:].reshape(-1)]).to(device)
    return [dev[i * b : (i + 1) * b] for i in range(scalars)], dev[scalars * b :].view(b, -1)
