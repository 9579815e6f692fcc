"""Teacher-forced drafter evaluation, independent of the engine: depth-by-depth agreement with the target.

A sample is a dict with "ids" [L] (x_0 .. x_{L-1}), "hidden" [L, H] (the target's h_0 .. h_{L-1}, before the
final norm) and "prompt_len" P. Drafts start at root rows r = P-1 .. L-2 (root x_{r+1}), as in the engine.
`chain_agreement` recomputes what the engine's paged drafting does for a chain (top-1, depth D) with dense
tensors, so on greedy answers `chain_steps` of it equals the engine's accept length with strategy D_1_{D+1}
(tests/test_drafter_eval.py holds the two together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt_rt.models.drafter import Drafter


@torch.no_grad()
def oracle_steps(target, samples: list[dict], temperature: float, topk: int, depth: int) -> float:
    """Tokens per step a perfect drafter would give: the step accepts the sampled tokens while each lies in
    the target's top-k at its position (at most `depth`), plus one."""
    emitted = steps = 0
    for s in samples:
        logits = F.linear(target.model.norm(s["hidden"]), target.lm_head.weight)
        if temperature > 0:
            logits = logits / temperature
        top = logits.topk(topk, -1).indices  # row t predicts x_{t+1}
        hit = (top[:-1] == s["ids"][1:, None]).any(-1).tolist()  # hit[t]: x_{t+1} in top-k
        t = s["prompt_len"] - 1  # the first draft: root x_P
        while t < len(hit):
            a = 0
            while a < depth and t + a < len(hit) and hit[t + a]:
                a += 1
            emitted, steps, t = emitted + a + 1, steps + 1, t + a + 1
    return emitted / max(steps, 1)


@torch.no_grad()
def chain_agreement(drafter: Drafter, s: dict, depth: int) -> torch.Tensor:
    """[depth, R] bool: drafter top-1 == target top-1 at depth j for root rows r = P-1 .. L-2 (False past the end).

    Root row r pairs f_r with x_{r+1}; depth j's row is r+j-1 with token x_{r+j} and feature f_r (j = 1) or
    the drafter's own output of depth j-1, at position r+j-1; it predicts x_{r+j+1}, compared with
    argmax lm_head(f_{r+j}). Independent of the engine: K/V of the true rows from one dense pass, chain rows
    attend to those (key <= r) and to their own chain.
    """
    ids, f = s["ids"], drafter.features(s["hidden"])
    n = ids.shape[0] - 1  # rows 0 .. L-2
    target_top1 = F.linear(f, drafter.lm_head.weight).argmax(-1)  # [L], row t predicts x_{t+1}
    layer, attn, rot = drafter.layer, drafter.layer.self_attn, drafter._rotary(f.device)
    rows = torch.arange(n)
    x = drafter._fuse(ids[1:], f[:-1])  # [n, H]
    _, k_true, v_true = attn._qkv(x, rows, rot)  # [n, Hkv, D]
    starts = torch.arange(s["prompt_len"] - 1, n)
    r = starts.numel()
    rep = attn.n_heads // attn.n_kv
    ok = torch.zeros(depth, r, dtype=torch.bool)
    feat = f[starts]
    chain_k, chain_v = [], []
    for j in range(1, depth + 1):
        row = starts + j - 1
        live = row < n
        rc = row.clamp(max=n - 1)
        xc = drafter._fuse(ids[rc + 1], feat)
        q, kc, vc = attn._qkv(xc, rc, rot)  # [R, H, D]
        if j == 1:  # the root row is a true row: its K/V are k_true[r]
            kc, vc = k_true[starts], v_true[starts]
        chain_k.append(kc)
        chain_v.append(vc)
        kk = torch.cat([k_true[None].expand(r, -1, -1, -1), torch.stack(chain_k, 1)], 1)  # [R, n + j, Hkv, D]
        vv = torch.cat([v_true[None].expand(r, -1, -1, -1), torch.stack(chain_v, 1)], 1)
        # true rows 0..r-1 (row r itself is chain row 1), then the chain
        mask = torch.cat([rows[None] < starts[:, None], torch.ones(r, j, dtype=torch.bool)], 1)
        kk, vv = kk.repeat_interleave(rep, 2), vv.repeat_interleave(rep, 2)
        att = torch.einsum("rhd,rkhd->rhk", q, kk) * attn.scale
        att = att.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        out = torch.einsum("rhk,rkhd->rhd", att, vv)
        h = xc + attn.o_proj(out.flatten(-2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        pred = drafter.to_target_vocab(drafter.logits(h)).argmax(-1)
        label = rc + 1
        ok[j - 1] = live & (pred == target_top1[label.clamp(max=n)]) & (label <= n)
        feat = h
    return ok


def chain_steps(ok: torch.Tensor) -> float:
    """Tokens per step of a greedy chain walk over [depth, R] agreement (the engine's walk from the first root)."""
    depth, r = ok.shape
    run = torch.cumprod(ok.int(), 0).sum(0).tolist()  # consecutive hits from depth 1
    t = emitted = steps = 0
    while t < r:
        emitted, steps, t = emitted + run[t] + 1, steps + 1, t + run[t] + 1
    return emitted / max(steps, 1)
