"""Log-probs of the sampled tokens straight from the final hidden rows and the LM head, in row chunks.

For hidden rows h [N, H], head W [V, H] and targets y [N]:

    x      = h @ W.T                          (in the inputs' dtype: bf16 on GPU)
    z      = float32(x) / tau                 (tau <= 0: no scaling)
    keep_v = float32(x_v) >= thr              (thr: `filter_thresholds` of the row; -inf when not filtering)
    out    = z_y - logsumexp_{v kept} z_v     (float32; -inf when y itself is filtered out)

the same numbers as `token_logprobs(h @ W.T, y, tau, keep)` of the learner's dense path, without ever
holding [N, V] logits: the forward runs `chunk_tokens` rows at a time and keeps only the per-row
logsumexp (and the index of its threshold token); the backward recomputes each chunk's logits and applies

    dL/dz_v = g * (1[v = y] - p_v) / tau     (0 outside the kept set),   p = softmax of z over the kept set
    dL/dh   = dL/dz @ W,    dL/dW = sum over chunks of dL/dz.T @ h

so the extra memory is O(chunk_tokens x V) float32 in both passes, plus a float32 [V, H] buffer for dL/dW
(summing many chunks' products in bf16 would lose the small ones). The cost is one more [N, H] x [H, V]
matmul than the dense path (the recompute). The backward skips chunks whose upstream gradient is all 0;
a caller saves more by passing only the rows under its loss mask.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from tlt_rt.codegen.kernels.sampling import filter_thresholds

__all__ = ["chunked_token_logprobs", "kept_ids"]


def _filtering(temperature: float, top_k: int, top_p: float) -> bool:
    # as `SamplingFilter.filtering`: greedy rows (temperature <= 0) are never filtered
    return temperature > 0 and (top_k > 0 or top_p < 1)


def _thresholds(x: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """x [c, V] logits -> thr [c] float32, per row as the sampler sets it."""
    dev = x.device
    return filter_thresholds(
        x[None],
        torch.full((1,), temperature, device=dev),
        torch.full((1,), top_k, dtype=torch.int32, device=dev),
        torch.full((1,), top_p, device=dev),
    )[0]


def kept_ids(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor | None:
    """logits [..., V] -> [..., V] bool, the ids the sampler keeps under top-k / top-p (its thresholds, row by
    row); None when it does not filter. The dense path's mask: `token_logprobs(logits, y, tau, kept_ids(...))`."""
    if not _filtering(temperature, top_k, top_p):
        return None
    flat = logits.detach().reshape(-1, logits.shape[-1])
    return (flat.float() >= _thresholds(flat, temperature, top_k, top_p)[:, None]).view(logits.shape)


def _scaled_logits(x: Tensor, temperature: float, thr: Tensor | None) -> Tensor:
    """x [c, V] logits (a fresh matmul output: written in place when float32), thr [c] or None
    -> z [c, V] float32, -inf outside the kept set."""
    z = x.float()
    if thr is not None:
        z.masked_fill_(~(z >= thr[:, None]), float("-inf"))  # compare before scaling, as the sampler does
    if temperature > 0 and temperature != 1.0:  # dividing by 1 is exact: skip the pass
        z.div_(temperature)
    return z


def _accumulate(grad_w: Tensor, gz: Tensor, h: Tensor) -> None:
    """grad_w [V, H] float32 += gz.T @ h, gz [c, V] and h [c, H] of one dtype."""
    if gz.dtype == torch.float32:
        grad_w.addmm_(gz.T, h)
    elif gz.is_cuda:
        # cuBLAS adds the bf16 product into the float32 buffer itself: no [V, H] temporary, no extra pass
        torch.addmm(grad_w, gz.T, h, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w += gz.T @ h


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        top_k: int,
        top_p: float,
        chunk_tokens: int,
    ) -> Tensor:
        n, dev = hidden.shape[0], hidden.device
        filtering = _filtering(temperature, top_k, top_p)
        out = torch.empty(n, dtype=torch.float32, device=dev)
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        # per row, the kept token with the smallest logit: the backward reads the threshold back as that
        # token's recomputed logit, so even a recompute that differed in the last bit could not drop the
        # boundary token (the sort puts it exactly at the threshold), as a saved float threshold might
        thr_idx = torch.empty(n, dtype=torch.long, device=dev) if filtering else None
        # no autocast in either pass: the backward must recompute the forward's logits in the same dtype
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(hidden.dtype)
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                x = hidden[s:e] @ w.T  # [c, V]
                thr = _thresholds(x, temperature, top_k, top_p) if filtering else None
                z = _scaled_logits(x, temperature, thr)
                del x
                if filtering:
                    thr_idx[s:e] = torch.where(z > float("-inf"), z, float("inf")).argmin(dim=1)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                out[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
                del z
        ctx.save_for_backward(hidden, weight, targets, lse, *([thr_idx] if filtering else []))
        ctx.temperature, ctx.chunk_tokens, ctx.filtering = temperature, chunk_tokens, filtering
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        thr_idx = rest[0] if ctx.filtering else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        scale = 1.0 / ctx.temperature if ctx.temperature > 0 else 1.0
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n, c = hidden.shape[0], ctx.chunk_tokens
        # the forward's chunks again (the same matmul shapes, so the same logits bit for bit); chunks
        # whose rows all have gradient 0 (padding, prompt rows) are skipped, for one host sync
        nonzero = torch.cat([grad_out != 0, grad_out.new_zeros(-n % c, dtype=torch.bool)])
        live = nonzero.view(-1, c).any(dim=1).tolist()
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            for s, run in zip(range(0, n, c), live, strict=True):
                if not run:
                    continue
                r = slice(s, min(s + c, n))
                h, g, y = hidden[r], grad_out[r].float(), targets[r]
                x = h @ w.T  # [c, V]
                thr = None if thr_idx is None else x.gather(1, thr_idx[r, None]).squeeze(1).float()
                z = _scaled_logits(x, ctx.temperature, thr)
                del x
                gs = g[:, None] * scale  # [c, 1]
                target_kept = z.gather(1, y[:, None]) > float("-inf")
                gz = z.sub_(lse[r, None]).exp_().mul_(-gs)  # -g p / tau, 0 outside the kept set
                gz.scatter_add_(1, y[:, None], gs * target_kept)
                gz = gz.to(hidden.dtype)
                if need_h:
                    grad_h[r] = gz @ w
                if need_w:
                    _accumulate(grad_w, gz, h)
                del z, gz
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    chunk_tokens: int = 1024,
) -> Tensor:
    """log p(target) of each row under softmax((hidden @ weight.T).float() / temperature) over the
    sampler's top-k / top-p kept set (module docstring), differentiable w.r.t. hidden and weight.

    hidden [..., H] (the final-normed rows, any float dtype), weight [V, H] (the LM head; cast to
    hidden's dtype for the matmuls, its gradient comes back in its own dtype), targets [...] int64 ->
    [...] float32. The matmuls run in hidden's dtype whatever autocast says. `chunk_tokens` rows of [V]
    float32 logits are live at a time.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree: {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must be hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).long()
    out = _ChunkedTokenLogprobs.apply(h, weight, y, float(temperature), int(top_k), float(top_p), int(chunk_tokens))
    return out.reshape(targets.shape)
