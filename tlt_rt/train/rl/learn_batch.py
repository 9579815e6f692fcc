"""The learner's input: a sample to learn from, a worker's mini-batch, their padding into device tensors,
and the cut of a mini-batch into micro-batches (by count, or by a padded-token budget)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LearnSample:
    """One response to learn from; `old_logprobs[i]` is the rollout's log-prob of `response[i]`."""

    prompt: list[int]
    response: list[int]
    old_logprobs: list[float]
    advantage: float


@dataclass
class MiniBatch:
    """This worker's part of one optimizer step, with the step's global counts (over all workers)."""

    samples: list[LearnSample]
    num_tokens: int
    num_seqs: int


def to_device(t: Tensor, device) -> Tensor:
    """`t` (built on the host) on `device`; to a GPU through pinned memory without waiting: a copy from
    pageable memory would first wait for everything queued on the stream (the previous backward)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pad_batch(samples: list[LearnSample], pad_id: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> input_ids [B, L-1], targets [B, L-1], mask [B, L-1], old_logprobs [B, L-1] (right padded), and the
    flat positions [R] of the mask's ones (row-major), found on the host: the response rows the head
    projects, picked without a device-to-host read.

    Row t of the logits predicts token t+1, so response token k of a prompt of length P is scored at
    position P-1+k; the last token is never an input whose prediction is needed.
    """
    length = max(len(s.prompt) + len(s.response) for s in samples)
    b = len(samples)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros(b, length - 1)
    old = torch.zeros(b, length - 1)
    for i, s in enumerate(samples):
        full = s.prompt + s.response
        ids[i, : len(full)] = torch.tensor(full, dtype=torch.long)
        p, r = len(s.prompt), len(s.response)
        mask[i, p - 1 : p - 1 + r] = 1.0
        old[i, p - 1 : p - 1 + r] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    ids = to_device(ids, device)
    rows = mask.flatten().nonzero().squeeze(1)
    return ids[:, :-1], ids[:, 1:], to_device(mask, device), to_device(old, device), to_device(rows, device)


def count_chunks(items: list, size: int) -> list[list]:
    """`items` cut into lists of `size` (the last shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def token_chunks(samples: list[LearnSample], budget: int) -> list[list[LearnSample]]:
    """Samples by length, cut where one more would take the padded batch (count x longest) past `budget`
    tokens; a sample longer than the budget goes alone. The loss is a sum normalised by the mini-batch's
    global counts, so how its samples are cut into micro-batches does not change the update."""
    out: list[list[LearnSample]] = []
    cur: list[LearnSample] = []
    longest = 0
    for s in sorted(samples, key=lambda s: len(s.prompt) + len(s.response)):
        n = len(s.prompt) + len(s.response) - 1  # the rows pad_batch makes
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    return out + ([cur] if cur else [])
