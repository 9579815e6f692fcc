"""The perfect-drafter ceiling of speculative decoding on given answers: the accept length a drafter that is
the target itself would reach, along the top-k path (`oracle_counts_by_shape`) or in the engine's own tree
with its verify budget (`oracle_tree_steps`, by a dense tree walk over the target's K/V of the answer).

Samples are the dicts of train/drafter/eval.py ("ids" [L], "hidden" [L, H], "prompt_len" P); the walk of
accepted counts that turns them into tokens per step (`walk_steps`) is the engine's, shared with eval.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt_rt.ir.tree import Candidates, build_tree


def restrict(logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Logits [..., V] with every id outside `vocab` (target ids, None = all) at -inf: what a drafter with
    that reduced vocabulary ranks (its head is trained on the target's distribution restricted to it)."""
    if vocab is None:
        return logits
    vocab = vocab.to(logits.device)
    out = torch.full_like(logits, float("-inf"))
    return out.index_copy_(-1, vocab, logits.index_select(-1, vocab))


@torch.no_grad()
def oracle_steps(
    target, samples: list[dict], temperature: float, topk: int, depth: int, vocab: torch.Tensor | None = None
) -> float:
    """Tokens per step a perfect drafter would give: the step accepts the sampled tokens while each lies in
    the target's top-k at its position (at most `depth`), plus one. `vocab`: a reduced draft vocabulary (a
    token outside it is never drafted; the top-k is taken over it)."""
    emitted, steps = oracle_counts(target, samples, temperature, topk, depth, vocab)
    return emitted / max(steps, 1)


def oracle_counts(
    target, samples: list[dict], temperature: float, topk: int, depth: int, vocab: torch.Tensor | None = None
) -> tuple[int, int]:
    """(tokens emitted, steps taken) of `oracle_steps`, so that several workers' answers add up."""
    return oracle_counts_by_shape(target, samples, temperature, {"": (topk, depth)}, vocab)[""]


@torch.no_grad()
def oracle_counts_by_shape(
    target,
    samples: list[dict],
    temperature: float,
    shapes: dict[str, tuple[int, int]],
    vocab: torch.Tensor | None = None,
) -> dict[str, tuple[int, int]]:
    """`oracle_counts` for several (topk, depth) shapes at once: the LM head runs once per sample, the top-k
    once per distinct k (a top-k of its own, not a prefix of a larger one, so tied logits pick the same ids)."""
    counts = {name: [0, 0] for name in shapes}
    for s in samples:
        last = s["hidden"][..., -target.lm_head.weight.shape[1] :]  # the last layer's part of fused features
        logits = restrict(F.linear(target.model.norm(last), target.lm_head.weight), vocab)
        if temperature > 0:
            logits = logits / temperature
        nxt = s["ids"].to(logits.device)[1:, None]
        hits = {}  # per k, hit[t]: x_{t+1} in the top-k of row t
        for k in {k for k, _ in shapes.values()}:
            hits[k] = (logits.topk(k, -1).indices[:-1] == nxt).any(-1).tolist()
        for name, (topk, depth) in shapes.items():
            # the first draft: root x_P; a root accepts the run of hits from it, at most `depth`
            e, n = walk_steps(_runs(hits[topk][s["prompt_len"] - 1 :], depth))
            counts[name][0] += e
            counts[name][1] += n
    return {name: (e, n) for name, (e, n) in counts.items()}


def _runs(hit: list[bool], depth: int) -> list[int]:
    """Per position t, the run of True in hit[t:], at most `depth` long."""
    out = [0] * (len(hit) + 1)
    for t in range(len(hit) - 1, -1, -1):
        out[t] = min(depth, out[t + 1] + 1) if hit[t] else 0
    return out[:-1]


def walk_steps(accepts: list[int]) -> tuple[int, int]:
    """(tokens emitted, steps) of the engine's walk from root row 0 of per-root accepted draft counts."""
    t = emitted = steps = 0
    while t < len(accepts):
        emitted, steps, t = emitted + accepts[t] + 1, steps + 1, t + accepts[t] + 1
    return emitted, steps


def _prefix_kv(target, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per-layer K/V [L, Hkv, D] of the target's dense causal pass over ids [L], and its logits [L, V]."""
    pos = torch.arange(ids.shape[0], device=ids.device)[None]
    x = target.model.embed_tokens(ids[None])
    kv = []
    for layer in target.model.layers:
        _, k, v = layer.self_attn._qkv(layer.input_layernorm(x), pos, target.rotary)
        kv.append((k[0], v[0]))
        x = layer(x, pos, target.rotary)
    return kv, target.lm_head(target.model.norm(x))[0]


def _tree_level(target, kv, roots, tokens, positions, chain_kv, anc):
    """Target logits [R, k, V] of frontier tokens [R, k] at `positions` [R, k]: each attends to the prefix rows
    <= its root (`roots` [R]), its ancestors (`anc` [R, k, l] frontier slots of levels 0..l-1, whose K/V per
    layer are chain_kv[layer][m], a (K, V) pair of [R, k, Hkv, D]) and itself; appends this level's K/V to chain_kv."""
    r, k = tokens.shape
    x = target.model.embed_tokens(tokens)
    prefix_len = kv[0][0].shape[0]
    see = torch.arange(prefix_len, device=tokens.device)[None] <= roots[:, None]  # [R, L]
    for i, layer in enumerate(target.model.layers):
        attn = layer.self_attn
        q, kc, vc = attn._qkv(layer.input_layernorm(x), positions, target.rotary)  # [R, k, H(kv), D]
        rep = attn.n_heads // attn.n_kv
        kp, vp = (t.repeat_interleave(rep, 1) for t in kv[i])  # [L, H, D]
        levels = chain_kv[i]
        pick = [anc[:, :, m, None, None].expand(-1, -1, *kc.shape[2:]) for m in range(len(levels))]
        ks = [lk.gather(1, ix) for (lk, _), ix in zip(levels, pick, strict=True)]
        vs = [lv.gather(1, ix) for (_, lv), ix in zip(levels, pick, strict=True)]
        kk = torch.stack([*ks, kc], 2).repeat_interleave(rep, 3)  # [R, k, l+1, H, D]
        vv = torch.stack([*vs, vc], 2).repeat_interleave(rep, 3)
        sp = torch.einsum("rkhd,lhd->rkhl", q, kp) * attn.scale
        sp = sp.masked_fill(~see[:, None, None, :], float("-inf"))
        sc = torch.einsum("rkhd,rkmhd->rkhm", q, kk) * attn.scale
        p = torch.cat([sp, sc], -1).float().softmax(-1).to(q.dtype)
        out = torch.einsum("rkhl,lhd->rkhd", p[..., :prefix_len], vp)
        out = out + torch.einsum("rkhm,rkmhd->rkhd", p[..., prefix_len:], vv)
        x = x + attn.o_proj(out.flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        levels.append((kc, vc))
    return target.lm_head(target.model.norm(x))


@torch.no_grad()
def tree_accepts(
    target,
    s: dict,
    temperature: float,
    depth: int,
    topk: int,
    verify_tokens: int,
    chunk: int = 64,
    vocab: torch.Tensor | None = None,
) -> list[int]:
    """Draft tokens a perfect drafter's tree accepts at each root row r = P-1 .. L-2 of sample `s`.

    The perfect drafter is the target itself at the sampling temperature (T = 0 ranks by T = 1 log-probs):
    the tree is built exactly as the engine builds it (tlt_rt.ir.tree: topk children of the topk best
    frontier nodes per level, the best verify_tokens - 1 candidates kept by cumulative log-prob), and the
    step accepts the sample's own next tokens while they follow a path of that tree. `vocab`: a reduced draft
    vocabulary (target ids): the tree's candidates come from the target's distribution restricted to it."""
    ids = s["ids"].to(target.lm_head.weight.device)
    n = ids.shape[0] - 1  # root rows 0 .. L-2
    kv, logits = _prefix_kv(target, ids)
    scale = temperature if temperature > 0 else 1.0
    out: list[int] = []
    for a in range(s["prompt_len"] - 1, n, chunk):
        roots = torch.arange(a, min(a + chunk, n), device=ids.device)
        r = roots.numel()
        cands = Candidates.start(torch.log_softmax(restrict(logits[roots].float(), vocab) / scale, -1), topk)
        chain_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in target.model.layers]
        anc = torch.zeros(r, topk, 0, dtype=torch.long, device=ids.device)
        prev = None
        for level in range(depth - 1):
            front = cands.frontier()  # [R, k] flat candidate index
            if prev is not None:  # each frontier node's parent is a frontier node of the level before
                slot = (prev[:, None, :] == cands.parents.gather(1, front)[..., None]).int().argmax(-1)
                anc = torch.cat([anc.gather(1, slot[..., None].expand(-1, -1, anc.shape[-1])), slot[..., None]], -1)
            pos = (roots + 1 + level)[:, None].expand(-1, topk)
            lv = _tree_level(target, kv, roots, cands.tokens.gather(1, front), pos, chain_kv, anc)
            cands = cands.grow(front, torch.log_softmax(restrict(lv.float(), vocab) / scale, -1))
            prev = front
        tree = build_tree(cands, ids[roots], roots + 1, verify_tokens)
        node = torch.zeros(r, dtype=torch.long, device=ids.device)
        alive = torch.ones(r, dtype=torch.bool, device=ids.device)
        acc = torch.zeros(r, dtype=torch.long, device=ids.device)
        for d in range(depth):
            want_at = roots + 1 + d
            want = torch.where(want_at <= n, ids[want_at.clamp(max=n)], -1)
            kids = tree.children[torch.arange(r), node]  # [R, K]
            toks = torch.where(kids >= 0, tree.tree_tokens.gather(1, kids.clamp(min=0)), -2)
            hit = (toks == want[:, None]) & alive[:, None]
            alive = hit.any(-1)
            node = torch.where(alive, kids.gather(1, hit.int().argmax(-1, keepdim=True)).squeeze(1), node)
            acc += alive.long()
        out += acc.tolist()
    return out


@torch.no_grad()
def oracle_tree_steps(
    target,
    samples: list[dict],
    temperature: float,
    depth: int,
    topk: int,
    verify_tokens: int,
    chunk: int = 64,
    vocab: torch.Tensor | None = None,
) -> float:
    """Tokens per step a perfect drafter would give with the engine's tree of this shape and verify budget
    (`tree_accepts`, walked as the engine walks): the ceiling that a strategy's accept length is judged by.
    `chunk` root rows share one batched tree walk (memory grows with it; the count does not depend on it);
    `vocab` restricts the drafter to a reduced vocabulary."""
    emitted = steps = 0
    for s in samples:
        e, n = walk_steps(tree_accepts(target, s, temperature, depth, topk, verify_tokens, chunk, vocab))
        emitted, steps = emitted + e, steps + n
    return emitted / max(steps, 1)
