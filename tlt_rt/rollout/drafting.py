"""The drafter's side of a speculative step: catch up on the target's hidden states, then grow the tree.

Positions (L = a sequence's cached target tokens; its pending root x_L sits at position L):
- drafter row p pairs the target hidden h_p with token x_{p+1} and predicts h_{p+1}; row L-1 is the
  root's, whose output drafts depth 1.
- catch-up: every step runs the fixed block of R rows [L-R, L) under a causal mask over the cached prefix
  (the tree-attention metadata the levels use, with a lower-triangular mask). R is the deepest configured
  strategy's depth + 1 (`DrafterRunner.block_rows`), whatever strategy this step drafts with: after a step
  that accepted a tokens the rows the drafter has not seen are [L-a-1, L), never more than that step's
  depth + 1, so a switch from a deep strategy to a shallow one never leaves the drafter behind. Rows it has
  seen are recomputed from the same target hidden states, which rewrites their K/V with the same values.
  Rows before position 0 (L < R) are padding: they write to the trash slot and see nothing. A sequence
  further behind (speculation switched on after plain decoding, or a recomputed one) first runs rows
  [draft_cached, L-R) through an eager prefill-style forward (`DrafterRunner.catch_up`).
- a node at tree depth d is drafter row L+d-1; level d writes its topk rows to drafter cache positions
  [L+(d-1)K, L+dK) and sees, inside that window, only its own ancestors (a tree mask of width dK).
Drafter rows for accepted tokens are recomputed from the target's own hidden states at the next step
rather than committed from the draft, so the drafter always conditions on true features.

`draft_tree` (block, depth-1 levels, reranking) reads only device tensors, never syncs with the host and
has shapes fixed by (B, strategy), so the engine captures it as one CUDA graph per (batch bucket, strategy)
(`DraftProgram`, in the target's graph pool); on CPU or with enforce_eager it runs as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from tlt_rt.codegen.graphs import GraphPool, Key, fill_tables
from tlt_rt.ir.strategy import Strategy, bucket_for
from tlt_rt.ir.tree import Candidates, DraftTree, build_tree
from tlt_rt.models.llama import KVCache
from tlt_rt.rollout.runner import Layout, build_meta, tree_meta
from tlt_rt.rollout.sequence import Sequence, flush_hidden


@dataclass
class DraftInputs:
    """One draft's device inputs, B sequences, R >= depth + 1 catch-up rows."""

    tokens: Tensor  # [B, R] int64: token x_{p+1} of block row p = L-R+j; tokens[:, -1] is the root x_L
    hidden: Tensor  # [B, R, H] target hidden h_p of block row p (before the final norm), zeros for padding
    valid: Tensor  # [B] int64 real rows of the block, min(L, R); 0 marks a padding sequence
    prefix_lens: Tensor  # [B] int64 L
    tables: Tensor  # [B, W] int32 block tables (the target's)


def catch_up_block(drafter, cache: KVCache, ins: DraftInputs, block_size: int) -> tuple[Tensor, Tensor]:
    """Drafter rows [L-R, L) of every sequence in one fixed-shape forward; the root row's logits [B, V] and
    output hidden [B, H]."""
    b, r = ins.tokens.shape
    dev = ins.tokens.device
    j = torch.arange(r, device=dev)
    real = j >= (r - ins.valid)[:, None]  # [B, R]
    mask = torch.ones(r, r, dtype=torch.bool, device=dev).tril() & real[:, None, :] & real[:, :, None]
    meta = tree_meta(ins.tables, ins.prefix_lens, r, mask, block_size, write=real)
    positions = (ins.prefix_lens.long()[:, None] - r + j).clamp(min=0)
    feats = drafter.features(ins.hidden.reshape(b * r, -1))
    roots = torch.arange(b, device=dev) * r + (r - 1)
    out = drafter.forward_paged(ins.tokens.reshape(-1), feats, positions.reshape(-1), cache, meta, roots)
    return out.logits, out.hidden[roots]


def draft_candidates(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, compiled: bool = False
) -> Candidates:
    """Catch up, then grow the candidate tree level by level (EAGLE-2 expansion); every candidate."""
    root_logits, root_hidden = catch_up_block(drafter, cache, ins, block_size)
    return grow_candidates(drafter, cache, strategy, block_size, ins, root_logits, root_hidden, compiled)


def _level_plan(tokens, scores, parents, topk: int, slot_of, prev_front, prev_hidden, d: int):
    """Level d's inputs from the candidates so far: its frontier [B, K], the frontier's parent hidden rows
    [B, K, H], its tree mask [B, K, dK] over the scratch window, its tokens [B, K] and the updated map from
    flat candidate to scratch row [B, N]."""
    cands = Candidates(tokens, scores, parents, topk)
    k, b = topk, tokens.shape[0]
    front = cands.frontier()  # [B, K]
    if prev_front is None:
        parent_hidden = prev_hidden
    else:
        parent = parents.gather(1, front)
        which = (prev_front[:, None, :] == parent[:, :, None]).float().argmax(-1)  # [B, K]
        parent_hidden = prev_hidden.gather(1, which[..., None].expand(-1, -1, prev_hidden.shape[-1]))
    slot_of = slot_of.scatter(1, front, (d - 1) * k + torch.arange(k, device=front.device).expand(b, k))
    anc = cands.ancestry(front)  # [B, K, levels]
    anc_slot = torch.where(anc >= 0, slot_of.gather(1, anc.clamp(min=0).flatten(1)).view_as(anc), -1)
    w = d * k
    mask = torch.zeros(b, k, w + 1, dtype=torch.bool, device=front.device)
    mask = mask.scatter(2, torch.where(anc_slot >= 0, anc_slot, w), True)[..., :w]
    return front, parent_hidden, mask, tokens.gather(1, front), slot_of


def _grow(tokens, scores, parents, topk: int, front, logits):
    """Add a level from the drafter's logits [B*K, V] at the frontier: (tokens, scores, parents)."""
    logp = torch.log_softmax(logits.float(), -1).view(front.shape[0], topk, -1)
    grown = Candidates(tokens, scores, parents, topk).grow(front, logp)
    return grown.tokens, grown.scores, grown.parents


def _start(root_logits, topk: int):
    c = Candidates.start(torch.log_softmax(root_logits.float(), -1), topk)
    return c.tokens, c.scores, c.parents


_compiled: dict[str, object] = {}


def _maybe_compiled(fn, compiled: bool, device: torch.device):
    """`fn` itself, or (on CUDA, for the captured draft graph) its torch.compile'd version: the tree
    bookkeeping is dozens of tiny sorts, gathers and scatters a level, each a kernel launch unfused."""
    if not compiled or device.type != "cuda":
        return fn
    if fn.__name__ not in _compiled:
        # dynamo's default recompile limit (8 a function) stays: past it the remaining variants run eagerly
        # (still captured in the graph). Raising it to 64 made capture and the first drafter evaluation
        # compile for minutes cold, and a variant compiled mid-rollout synchronised the device (H200)
        _compiled[fn.__name__] = torch.compile(fn, dynamic=True)
    return _compiled[fn.__name__]


def grow_candidates(
    drafter,
    cache: KVCache,
    strategy: Strategy,
    block_size: int,
    ins: DraftInputs,
    root_logits,
    root_hidden,
    compiled: bool = False,
) -> Candidates:
    """The depth-1 drafter levels from the root rows' logits [B, V] and output hidden [B, H]."""
    k, depth = strategy.topk, strategy.depth
    b, dev = ins.tokens.shape[0], ins.tokens.device
    start, plan, grow = (_maybe_compiled(f, compiled, dev) for f in (_start, _level_plan, _grow))
    cached = ins.prefix_lens.long()
    live = (ins.valid > 0)[:, None].expand(b, k)  # padding sequences write nowhere
    tokens, scores, parents = start(root_logits, k)
    # flat candidate -> its row in the scratch window, sized for every candidate the step will have
    slot_of = torch.full((b, strategy.num_candidates), -1, dtype=torch.long, device=dev)
    prev_front, prev_hidden = None, root_hidden[:, None].expand(b, k, -1)
    for d in range(1, depth):
        front, parent_hidden, mask, level_tokens, slot_of = plan(
            tokens, scores, parents, k, slot_of, prev_front, prev_hidden, d
        )
        # level d's k rows: rotary position L+d-1, cache positions [L+(d-1)k, L+dk)
        meta = tree_meta(ins.tables, cached + d * k, k, mask, block_size, write=live)
        positions = (cached + d - 1)[:, None].expand(b, k).reshape(-1)
        out = drafter.forward_paged(level_tokens.reshape(-1), parent_hidden.reshape(b * k, -1), positions, cache, meta)
        tokens, scores, parents = grow(tokens, scores, parents, k, front, out.logits)
        prev_front, prev_hidden = front, out.hidden.view(b, k, -1)
    return Candidates(tokens, scores, parents, k)


TREE_FIELDS = [f.name for f in dataclasses.fields(DraftTree)]


def _tree_tensors(tokens, scores, parents, topk: int, root_tokens, prefix_lens, verify_tokens: int):
    tree = build_tree(Candidates(tokens, scores, parents, topk), root_tokens, prefix_lens, verify_tokens)
    return tuple(getattr(tree, name) for name in TREE_FIELDS)


def fused_build_tree(cands: Candidates, root_tokens: Tensor, prefix_lens: Tensor, verify_tokens: int) -> DraftTree:
    """`build_tree` through torch.compile on CUDA (see `_maybe_compiled`): its ~100 small sorts, gathers and
    scatters become a handful of kernels inside the captured draft graph; the same tree (tested)."""
    fn = _maybe_compiled(_tree_tensors, True, cands.tokens.device)
    return DraftTree(
        *fn(cands.tokens, cands.scores, cands.parents, cands.topk, root_tokens, prefix_lens, verify_tokens)
    )


def draft_tree(
    drafter, cache: KVCache, strategy: Strategy, block_size: int, ins: DraftInputs, compiled: bool = False
) -> DraftTree:
    """The whole drafter step: catch-up block, depth-1 levels, rerank into the verify tree (`compiled`:
    the rerank through `fused_build_tree`, as the captured draft graph runs it)."""
    cands = draft_candidates(drafter, cache, strategy, block_size, ins, compiled)
    build = fused_build_tree if compiled else build_tree
    return build(cands, ins.tokens[:, -1], ins.prefix_lens, strategy.verify_tokens)


class DraftProgram:
    """`draft_tree` as a `codegen.graphs.Program` for keys ("draft", B, verify_tokens, depth, topk).

    Its outputs are read after the verify graph of the same pool replays, so they are copied into buffers
    allocated outside the pool; padding sequences (valid 0) write only to the trash slot."""

    def __init__(self, runner: DrafterRunner, width: int):
        self.runner = runner
        self.width = width

    @staticmethod
    def key(batch: int, strategy: Strategy) -> Key:
        return ("draft", batch, strategy.verify_tokens, strategy.depth, strategy.topk)

    def static_inputs(self, key: Key) -> dict[str, Tensor]:
        _, b, t, depth, k = key
        w = self.runner.drafter.fc.weight
        dev, r, long = w.device, self.runner.block_rows(Strategy(depth, k, t)), torch.long
        ins = {
            "tokens": torch.zeros(b, r, dtype=long, device=dev),
            "hidden": torch.zeros(b, r, w.shape[0], dtype=w.dtype, device=dev),
            "valid": torch.zeros(b, dtype=long, device=dev),
            "prefix_lens": torch.zeros(b, dtype=long, device=dev),
            "tables": torch.zeros(b, self.width, dtype=torch.int32, device=dev),
        }
        out_shapes = {"tree_mask": (b, t, t), "paths": (b, t, depth + 1), "children": (b, t, k)}
        for name in TREE_FIELDS:
            dtype = torch.bool if name == "tree_mask" else long
            ins["out." + name] = torch.zeros(out_shapes.get(name, (b, t)), dtype=dtype, device=dev)
        return ins

    def run(self, key: Key, ins: dict[str, Tensor]) -> DraftTree:
        _, _, t, depth, k = key
        r = self.runner
        args = DraftInputs(ins["tokens"], ins["hidden"], ins["valid"], ins["prefix_lens"], ins["tables"])
        tree = draft_tree(r.drafter, r.cache, Strategy(depth, k, t), r.block_size, args, compiled=True)
        for name in TREE_FIELDS:
            ins["out." + name].copy_(getattr(tree, name))
        return DraftTree(**{name: ins["out." + name] for name in TREE_FIELDS})

    def fill(self, key: Key, ins: dict[str, Tensor], d: DraftInputs) -> None:
        b = d.tokens.shape[0]
        ins["tokens"][:b].copy_(d.tokens)
        ins["hidden"][:b].copy_(d.hidden)
        ins["valid"][:b].copy_(d.valid)
        ins["valid"][b:].zero_()
        ins["prefix_lens"][:b].copy_(d.prefix_lens)
        ins["prefix_lens"][b:].zero_()
        fill_tables(ins["tables"], d.tables)

    def result(self, key: Key, tree: DraftTree, d: DraftInputs) -> DraftTree:
        b = d.tokens.shape[0]
        return DraftTree(**{name: getattr(tree, name)[:b] for name in TREE_FIELDS})


class DrafterRunner:
    """The drafter's one-layer paged cache (sharing the target's block tables) and its step.

    window_rows: target hidden rows each sequence keeps on the device for the catch-up block (the deepest
    strategy's depth + 1); 0 keeps exactly what each step needs.
    """

    def __init__(self, drafter, num_blocks: int, block_size: int, window_rows: int = 0):
        self.drafter = drafter
        self.block_size = block_size
        self.cache: KVCache = drafter.make_cache(num_blocks + 1, block_size)  # + the trash block
        self.device = drafter.fc.weight.device
        self.window_rows = window_rows
        self.pool: GraphPool | None = None
        self.buckets: list[int] = []
        self.width = 0
        self._recent: tuple[tuple[int, ...], Tensor] | None = None  # (sequence ids, their windows) of the last step

    def use_graphs(self, pool: GraphPool, buckets: list[int], width: int) -> None:
        """Capture and replay draft steps in `pool` for batches up to buckets[-1] and tables up to `width`."""
        self.pool, self.buckets, self.width = pool, buckets, width
        pool.register(("draft",), DraftProgram(self, width))

    def block_rows(self, strategy: Strategy) -> int:
        """Rows of the catch-up block a step of `strategy` runs: the deepest strategy's depth + 1 (window_rows)."""
        return max(strategy.depth + 1, self.window_rows)

    def graph_key(self, batch: int, strategy: Strategy, table_width: int) -> Key | None:
        if self.pool is None or batch > self.buckets[-1] or table_width > self.width:
            return None
        return DraftProgram.key(bucket_for(batch, self.buckets), strategy)

    @torch.no_grad()
    def catch_up(self, seqs: list[Sequence], tables: list[list[int]], ends: list[int] | None = None):
        """Eagerly run drafter rows [draft_cached, end) of every sequence (end: num_cached unless given);
        returns the last row's logits and hidden."""
        ends = [s.num_cached for s in seqs] if ends is None else ends
        ids, hidden, layout = [], [], Layout(tables, [], [], [], [])
        for s, end in zip(seqs, ends, strict=True):
            c = s.draft_cached
            ids += s.tokens[c + 1 : end + 1]
            hidden.append(s.hidden_rows(c, end))
            layout.q_lens.append(end - c)
            layout.seq_lens.append(end)
            layout.positions.append(list(range(c, end)))
            layout.cache_pos.append(list(range(c, end)))
            s.draft_cached = end
        meta, positions = build_meta(layout, "prefill", self.block_size, self.device)
        last = (torch.tensor(layout.q_lens).cumsum(0) - 1).to(self.device)
        feats = self.drafter.features(torch.cat(hidden).to(self.device))
        out = self.drafter.forward_paged(
            torch.tensor(ids, device=self.device), feats, positions, self.cache, meta, logits_indices=last
        )
        return out.logits, out.hidden[last]

    def prepare(self, seqs: list[Sequence], tables: list[list[int]], rows: int) -> Tensor:
        """Bring every sequence within `rows` of its cache (eager catch-up for those further behind) and
        return the target hidden windows [B, max(rows, window_rows), H] ending at each num_cached. Marks the
        drafter rows as cached: the caller runs the block."""
        flush_hidden(seqs)
        behind = [i for i, s in enumerate(seqs) if s.num_cached - s.draft_cached > rows]
        if behind:
            ends = [seqs[i].num_cached - rows for i in behind]
            self.catch_up([seqs[i] for i in behind], [tables[i] for i in behind], ends)
        width = max(rows, self.window_rows)
        for s in seqs:
            s.draft_cached = s.num_cached
        recent = self._recent
        fresh = all(s.window is not None and s.window_end == s.num_cached for s in seqs)
        if fresh and recent is not None and recent[0] == tuple(s.seq_id for s in seqs) and recent[1].shape[1] >= width:
            return recent[1]  # the same batch as the last step: its windows as they are
        return torch.stack([self._window(s, width) for s in seqs])

    def _window(self, s: Sequence, width: int) -> Tensor:
        if s.window is not None and s.window_end == s.num_cached and s.window.shape[0] >= width:
            return s.window[-width:]
        L = s.num_cached
        h = s.hidden_rows(max(0, L - width), L).to(self.device)
        if h.shape[0] < width:
            h = torch.cat([h.new_zeros(width - h.shape[0], h.shape[1]), h])
        return h

    def keep_windows(self, seqs: list[Sequence], windows: Tensor, ends: list[int]) -> None:
        """After a step: sequence i's window [W, H] now ends at position ends[i]."""
        for i, (s, end) in enumerate(zip(seqs, ends, strict=True)):
            s.window, s.window_end = windows[i], end
        self._recent = (tuple(s.seq_id for s in seqs), windows)

    @torch.no_grad()
    def draft_tree(self, strategy: Strategy, ins: DraftInputs) -> DraftTree:
        """Replay the (bucket, strategy) graph when there is one, else run eagerly."""
        key = self.graph_key(ins.tokens.shape[0], strategy, ins.tables.shape[1])
        if key is None:
            return draft_tree(self.drafter, self.cache, strategy, self.block_size, ins)
        if not self.pool.has(key):
            self.pool.capture([key])
        return self.pool.replay(key, ins)

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
