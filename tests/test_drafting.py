"""The engine's level-by-level drafting equals the drafter's dense forward along every path it expands."""

from __future__ import annotations

import torch

from tests.helpers.engine import tiny_pair
from tlt_rt.ir.strategy import Strategy
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.drafting import DrafterRunner
from tlt_rt.rollout.step.target import table_tensor


def _dense_logprobs(drafter, feats, toks, path_tokens, path_hidden):
    """Log-probs after the root row (p = L-1) and then one row per path token, fed the drafter's own hidden."""
    ids = torch.tensor([toks[1:] + path_tokens])
    hidden = torch.cat([feats, *path_hidden], 0)[None] if path_hidden else feats[None]
    out = drafter(ids, hidden)
    return torch.log_softmax(out.logits[0, -1].float(), -1), out.hidden[0, -1:]


def test_draft_levels_match_dense_paths():
    target, drafter = tiny_pair(0, 4.0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3)  # a sharp drafter: distinct, well-separated candidates
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 12, (n,), generator=gen).tolist() for n in (15, 9)]
    strategy = Strategy(3, 2, 5)
    runner = DrafterRunner(drafter, 32, 4)
    seqs, tables = [], []
    for i, toks in enumerate(prompts):
        L = len(toks) - 1  # the last token is the pending root
        with torch.no_grad():
            h = target(torch.tensor([toks[:L]])).hidden[0]
        seqs.append(Sequence(i, i, 0, toks, 0, 8, num_cached=L, hidden_chunks=[h]))
        tables.append(list(range(i * 16, i * 16 + 16)))
    with torch.no_grad():
        cands = runner.draft(seqs, tables, table_tensor(tables, "cpu"), strategy, torch.device("cpu"))
        for b, (toks, seq) in enumerate(zip(prompts, seqs, strict=True)):
            feats = drafter.features(seq.hidden())
            n = cands.tokens.shape[1]
            for j in range(n):
                path, node = [], j
                while node >= 0:  # root-child .. j
                    path.insert(0, node)
                    node = int(cands.parents[b, node])
                # the parent's distribution must have produced candidate j with its score
                hid, lp = [], None
                lp, last = _dense_logprobs(drafter, feats, toks, [], [])
                for k in path[:-1]:
                    hid.append(last)
                    lp, last = _dense_logprobs(
                        drafter, feats, toks, [int(cands.tokens[b, q]) for q in path[: path.index(k) + 1]], hid
                    )
                parent_score = 0.0 if len(path) == 1 else float(cands.scores[b, path[-2]])
                tok = int(cands.tokens[b, j])
                torch.testing.assert_close(float(cands.scores[b, j]), parent_score + float(lp[tok]), atol=1e-4, rtol=0)
