"""Tree acceptance's rule in plain torch: the reference the Triton kernel (`accept.py`, whose docstring gives the
rule) is tested against, the checks both sides make of their inputs, and the choice of the filtering pre-pass.
Runs on any device with no host sync on CUDA; the engine runs it off CUDA (`codegen.table`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tlt_rt.codegen.kernels.sampling import filter_thresholds, inverse_temperature

__all__ = ["AcceptOutput", "accept_tree_reference"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TREE_NODES = 256
NEG_INF = float("-inf")


class AcceptOutput(NamedTuple):
    accept_len: Tensor
    """[B] int64 accepted draft tokens, 0..D."""
    accepted_tokens: Tensor
    """[B, D+1] int64 accepted draft tokens, then the bonus token at index accept_len, then -1."""
    accepted_nodes: Tensor
    """[B, D+1] int64 tree node of each accepted draft token; -1 at the bonus slot and after."""
    bonus: Tensor
    """[B] int64 the correction / bonus token."""
    logprobs: Tensor
    """[B, D+1] float32 log-prob of each emitted token under the filtered target distribution; 0 after."""


def check_inputs(logits, tree_tokens, parents, temperature, top_k, top_p, uniforms, max_depth):
    assert logits.dim() == 3, f"logits must be [B, T, V], got {tuple(logits.shape)}"
    B, T, V = logits.shape
    assert logits.dtype in SUPPORTED_DTYPES, f"logits dtype {logits.dtype} not in {SUPPORTED_DTYPES}"
    assert 1 <= T <= MAX_TREE_NODES, f"tree of {T} nodes; 1..{MAX_TREE_NODES} supported"
    assert isinstance(max_depth, int) and max_depth >= 0, f"max_depth must be an int >= 0, got {max_depth}"
    for name, t in (("tree_tokens", tree_tokens), ("parents", parents)):
        assert t.shape == (B, T), f"{name} must be [B, T] = {(B, T)}, got {tuple(t.shape)}"
        assert t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}"
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("top_p", top_p, (torch.float32,)),
    ):
        assert t.shape == (B,), f"{name} must be [B] = {(B,)}, got {tuple(t.shape)}"
        assert t.dtype in dtypes, f"{name} dtype {t.dtype} not in {dtypes}"
        assert B < 2 or t.stride(0) == 1, f"{name} must be contiguous (the kernel reads it so), got {t.stride()}"
    assert uniforms.shape == (B, max_depth + 1, 2), (
        f"uniforms must be [B, D+1, 2] = {(B, max_depth + 1, 2)}, got {tuple(uniforms.shape)}"
    )
    assert uniforms.dtype == torch.float32, f"uniforms must be float32, got {uniforms.dtype}"
    names = ("tree_tokens", "parents", "temperature", "top_k", "top_p", "uniforms")
    for name, t in zip(names, (tree_tokens, parents, temperature, top_k, top_p, uniforms), strict=True):
        assert t.device == logits.device, f"{name} is on {t.device}, logits on {logits.device}"
    return B, T, V, max_depth


def resolve_filtering(filtering: bool | None, all_greedy: bool, top_k: Tensor, top_p: Tensor, V: int) -> bool:
    """Whether the top-k / top-p threshold pre-pass must run. Deciding from the values needs them on the
    host: free on CPU, a sync on CUDA, so on CUDA `None` means True and `False` is the caller's promise."""
    if all_greedy:
        return False
    if top_k.is_cuda:
        return True if filtering is None else filtering
    active = bool((((top_k > 0) & (top_k < V)) | (top_p < 1.0)).any())
    if filtering is False and active:
        raise ValueError("accept_tree: filtering=False but some row sets top_k or top_p")
    return active if filtering is None else filtering


def accept_tree_reference(
    logits: Tensor,
    tree_tokens: Tensor,
    parents: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    uniforms: Tensor,
    max_depth: int,
    *,
    all_greedy: bool = False,
    filtering: bool | None = None,
) -> AcceptOutput:
    """Plain-torch tree acceptance with the kernel's semantics (module docstring), batched over B, one
    loop step per tree level. Any device, no host sync on CUDA; same arguments as `accept_tree`."""
    B, T, V, D = check_inputs(logits, tree_tokens, parents, temperature, top_k, top_p, uniforms, max_depth)
    filtering = resolve_filtering(filtering, all_greedy, top_k, top_p, V)
    dev = logits.device
    inv_t = torch.zeros(B, device=dev) if all_greedy else inverse_temperature(temperature)
    greedy = inv_t == 0
    scale = torch.where(greedy, torch.ones_like(inv_t), inv_t)
    thr = filter_thresholds(logits, temperature, top_k, top_p) if filtering else torch.full((B, T), NEG_INF, device=dev)
    rows, nodes, vocab = (torch.arange(n, device=dev) for n in (B, T, V))
    tok = tree_tokens
    tok_ok = (tok >= 0) & (tok < V)
    tok_c = tok.clamp(0, V - 1)
    # first[b, j]: no earlier sibling i < j carries the same token
    same = (
        (parents[:, :, None] == parents[:, None, :])
        & (tok[:, :, None] == tok[:, None, :])
        & (nodes[:, None] < nodes[None, :])
    )
    first = tok_ok & ~same.any(dim=1)

    accept_len = torch.zeros(B, dtype=torch.int64, device=dev)
    bonus = torch.zeros(B, dtype=torch.int64, device=dev)
    out_tokens = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
    out_nodes = torch.full((B, D + 1), -1, dtype=torch.int64, device=dev)
    logprobs = torch.zeros(B, D + 1, dtype=torch.float32, device=dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for d in range(D + 1):
        x = logits[rows, cur].float()  # [B, V]
        mx, amax = x.amax(dim=-1), x.argmax(dim=-1)  # argmax: the first index on ties
        ref = torch.where(mx == NEG_INF, torch.zeros_like(mx), mx)
        z = (x - ref[:, None]) * scale[:, None]  # scaled logits minus their max
        e = torch.where(x >= thr[rows, cur][:, None], torch.exp(z), 0.0)  # unnormalised filtered p
        s = e.sum(dim=-1)
        is_child = (parents == cur[:, None]) & (d < D)  # [B, T]
        e_c = torch.where(is_child & tok_ok, e.gather(1, tok_c), 0.0)

        take = is_child & (tok == amax[:, None])
        b_tok = amax
        if not all_greedy:
            cum = torch.where(first, e_c / s[:, None], 0.0).cumsum(dim=1)
            take = torch.where(greedy[:, None], take, is_child & (uniforms[:, d, 0, None] < cum))
            # bonus: inverse CDF over the residual r = e without the children's tokens
            resid = s - torch.where(first, e_c, 0.0).sum(dim=1)
            excl_on = resid > 0
            resid = torch.where(excl_on, resid, s)
            excl = torch.zeros(B, V, device=dev).scatter_add_(1, tok_c, (is_child & tok_ok).float()) > 0
            r = torch.where(excl & excl_on[:, None], 0.0, e)
            cand = (r.cumsum(dim=1) > (uniforms[:, d, 1] * resid)[:, None]) & (r > 0)
            found = torch.where(cand, vocab, V).amin(dim=1)
            last = torch.where(r > 0, vocab, -1).amax(dim=1)
            sampled = torch.where(found < V, found, torch.where(last >= 0, last, amax))
            b_tok = torch.where(greedy, amax, sampled)

        j = torch.where(take, nodes, T).amin(dim=1)
        acc = (j < T) & ~done
        stop = (j >= T) & ~done
        j = j.clamp(max=T - 1)
        emitted = torch.where(acc, tok.gather(1, j[:, None]).squeeze(1), b_tok)
        lp = z.gather(1, emitted.clamp(0, V - 1)[:, None]).squeeze(1) - torch.log(s)
        out_tokens[:, d] = torch.where(acc | stop, emitted, -1)
        out_nodes[:, d] = torch.where(acc, j, -1)
        logprobs[:, d] = torch.where(acc | stop, lp, 0.0)
        accept_len = torch.where(stop, d, accept_len)
        bonus = torch.where(stop, b_tok, bonus)
        cur = torch.where(acc, j, cur)
        done = done | stop
    return AcceptOutput(accept_len, out_tokens, out_nodes, bonus, logprobs)
