"""Teacher-forced drafter evaluation, independent of the engine: depth-by-depth agreement with the target.

A sample is a dict with "ids" [L] (x_0 .. x_{L-1}), "hidden" [L, H] (the target's h_0 .. h_{L-1}, before the
final norm) and "prompt_len" P. Drafts start at root rows r = P-1 .. L-2 (root x_{r+1}), as in the engine.
`chain_agreement` recomputes what the engine's paged drafting does for a chain (top-1, depth D) with dense
tensors, so on greedy answers `chain_steps` of it equals the engine's accept length with strategy D_1_{D+1}
(tests/test_drafter_eval.py holds the two together). `drafter_counts_by_shape` counts the drafter's accept
length along the answers' top-k path; `frozen_copy` freezes a drafter to evaluate while training goes on.
The perfect-drafter ceiling these are judged by is in oracle.py (re-exported here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt_rt.models.drafter import Drafter
from tlt_rt.train.drafter.oracle import (
    oracle_counts,
    oracle_counts_by_shape,
    oracle_steps,
    oracle_tree_steps,
    restrict,
    tree_accepts,
    walk_steps,
)

__all__ = [
    "chain_agreement", "chain_steps", "drafter_counts_by_shape", "drafter_hits", "frozen_copy", "oracle_counts",
    "oracle_counts_by_shape", "oracle_steps", "oracle_tree_steps", "restrict", "tree_accepts", "walk_steps",
]  # fmt: skip


def _path_logits(drafter: Drafter, s: dict, depth: int, chunk: int):
    """Yield (roots slice, j, row [c], draft-vocab logits [c, Vd]) per chunk of root rows and depth j = 1..depth.

    Root row r pairs f_r with x_{r+1}; depth j's row is r+j-1 with token x_{r+j} and feature f_r (j = 1) or
    the drafter's own output of depth j-1, at position r+j-1; its logits predict x_{r+j+1}. Independent of the
    engine: K/V of the true rows from one dense pass; chain rows attend to those (key < r) and to their own
    chain. `row` is clamped to the last true row (n - 1); callers mask rows past it."""
    f = drafter.features(s["hidden"])
    ids = s["ids"].to(f.device)
    n = ids.shape[0] - 1  # rows 0 .. L-2
    layer, attn, rot = drafter.layer, drafter.layer.self_attn, drafter._rotary(f.device)
    rep = attn.n_heads // attn.n_kv
    rows = torch.arange(n, device=f.device)
    x = drafter._fuse(ids[1:], f[:-1])  # [n, H]
    _, k_true, v_true = attn._qkv(x, rows, rot)  # [n, Hkv, D]
    kt, vt = k_true.repeat_interleave(rep, 1), v_true.repeat_interleave(rep, 1)  # [n, H, D]
    for a in range(s["prompt_len"] - 1, n, chunk):
        starts = torch.arange(a, min(a + chunk, n), device=f.device)
        see = rows[None] < starts[:, None]  # [c, n]: true rows 0..r-1 (row r itself is chain row 1)
        feat, chain_k, chain_v = f[starts], [], []
        for j in range(1, depth + 1):
            rc = (starts + j - 1).clamp(max=n - 1)
            xc = drafter._fuse(ids[rc + 1], feat)
            q, kc, vc = attn._qkv(xc, rc, rot)  # [c, H(kv), D]
            if j == 1:  # the root row is a true row: its K/V are k_true[r]
                kc, vc = k_true[starts], v_true[starts]
            chain_k.append(kc.repeat_interleave(rep, 1))
            chain_v.append(vc.repeat_interleave(rep, 1))
            kk, vv = torch.stack(chain_k, 1), torch.stack(chain_v, 1)  # [c, j, H, D]
            sp = torch.einsum("chd,khd->chk", q, kt) * attn.scale
            sp = sp.masked_fill(~see[:, None], float("-inf"))
            sc = torch.einsum("chd,cjhd->chj", q, kk) * attn.scale
            p = torch.cat([sp, sc], -1).float().softmax(-1).to(q.dtype)
            out = torch.einsum("chk,khd->chd", p[..., :n], vt) + torch.einsum("chj,cjhd->chd", p[..., n:], vv)
            h = xc + attn.o_proj(out.flatten(-2))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            yield (
                slice(a - s["prompt_len"] + 1, a - s["prompt_len"] + 1 + starts.numel()),
                j,
                starts + j - 1,
                drafter.logits(h),
            )
            feat = h


@torch.no_grad()
def chain_agreement(drafter: Drafter, s: dict, depth: int, chunk: int = 256) -> torch.Tensor:
    """[depth, R] bool: drafter top-1 == target top-1 at depth j for root rows r = P-1 .. L-2 (False past the end).

    Depth j's row r+j-1 predicts x_{r+j+1} (`_path_logits`), compared with argmax lm_head(f_{r+j})."""
    n = s["hidden"].shape[0] - 1
    target_top1 = F.linear(drafter.target_features(s["hidden"]), drafter.lm_head.weight).argmax(-1)  # row t: x_{t+1}
    ok = torch.zeros(depth, n - s["prompt_len"] + 1, dtype=torch.bool, device=target_top1.device)
    for roots, j, row, logits in _path_logits(drafter, s, depth, chunk):
        pred = drafter.to_target_vocab(logits).argmax(-1)
        ok[j - 1, roots] = (row < n) & (pred == target_top1[(row + 1).clamp(max=n)])
    return ok.cpu()


@torch.no_grad()
def drafter_hits(drafter: Drafter, s: dict, depth: int, ks: set[int], chunk: int = 256) -> dict[int, torch.Tensor]:
    """Per k, [depth, R] bool: the answer's own token x_{r+j+1} lies in the drafter's top-k at depth j of root
    row r (teacher-forced along the answer, `_path_logits`); False where the answer has no such token (its last
    token is not in `ids`). The top-k of each k is its own (not a prefix of a larger one), as in the ceiling."""
    ids = s["ids"].to(s["hidden"].device)
    n = ids.shape[0] - 1
    hits = {k: torch.zeros(depth, n - s["prompt_len"] + 1, dtype=torch.bool, device=ids.device) for k in ks}
    for roots, j, row, logits in _path_logits(drafter, s, depth, chunk):
        want, live = ids[(row + 2).clamp(max=n)], row + 2 <= n
        for k in ks:
            top = drafter.to_target_ids(logits.topk(min(k, logits.shape[-1]), -1).indices)  # [c, k]
            hits[k][j - 1, roots] = live & (top == want[:, None]).any(-1)
    return {k: h.cpu() for k, h in hits.items()}


@torch.no_grad()
def drafter_counts_by_shape(
    drafter: Drafter, samples: list[dict], shapes: dict[str, tuple[int, int]], chunk: int = 256
) -> dict[str, tuple[int, int]]:
    """Per (topk, depth) shape, (tokens emitted, steps taken) of `drafter` on the answers `samples`: the
    counterpart of `oracle_counts_by_shape` with the drafter in place of the target. Each step of the engine's
    walk from root row P-1 accepts the answer's tokens while each lies in the drafter's top-k at its depth (at
    most `depth`), plus one. Like the ceiling, this counts a path of top-k sets, wider than the engine's tree
    (top-k of the best frontier, verify budget), and it does not depend on the temperature (a top-k does not).
    The walk starts one token later than the ceiling's (the engine drafts from the prefill's token on)."""
    depth = max(d for _, d in shapes.values())
    counts = {name: [0, 0] for name in shapes}
    for s in samples:
        hits = drafter_hits(drafter, s, depth, {k for k, _ in shapes.values()}, chunk)
        for name, (topk, d) in shapes.items():
            e, n = walk_steps(torch.cumprod(hits[topk][:d].int(), 0).sum(0).tolist())
            counts[name][0] += e
            counts[name][1] += n
    return {name: (e, n) for name, (e, n) in counts.items()}


def chain_steps(ok: torch.Tensor) -> float:
    """Tokens per step of a greedy chain walk over [depth, R] agreement (the engine's walk from the first root)."""
    depth, r = ok.shape
    run = torch.cumprod(ok.int(), 0).sum(0).tolist()  # consecutive hits from depth 1
    t = emitted = steps = 0
    while t < r:
        emitted, steps, t = emitted + run[t] + 1, steps + 1, t + run[t] + 1
    return emitted / max(steps, 1)


@torch.no_grad()
def frozen_copy(drafter: Drafter) -> Drafter:
    """A copy of `drafter`'s own weights (and draft vocabulary) on its device and dtype, in eval mode without
    gradients, bound to the same target: the embedding, final norm and LM head stay the target's (shared),
    so a reduced head must be re-sliced after a policy update as the drafter's is (`refresh_head`). The global
    random state is left as it was (the new module's initial draws are overwritten anyway): a run that keeps a
    copy samples as one that does not."""
    w = drafter.fc.weight
    with torch.random.fork_rng(devices=[]):  # the module is built on the CPU, then moved
        copy = Drafter(drafter.arch, drafter.target, fc_bias=drafter.fc.bias is not None,
                       feature_layers=drafter.feature_layers)  # fmt: skip
    copy = copy.to(w.device, w.dtype)
    copy.load_state_dict(drafter.state_dict())
    return copy.eval().requires_grad_(False)
