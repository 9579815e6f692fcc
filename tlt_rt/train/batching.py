"""How a step's work is cut up: prompts into even shares over the workers, each share's sampling seed, and
the learner's samples into token-balanced mini-batches."""

from __future__ import annotations

import random

from tlt_rt.train.rl.learner import LearnSample, MiniBatch


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of n items over `parts`, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def work_shares(
    num_prompts: int, group_size: int, workers: int, split: str = "prompts"
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """Per worker: its prompts [lo, hi), (its seed key, the group index of its first answer) and its answers
    per prompt. 'prompts': contiguous prompt ranges with every answer (seed key: the first prompt);
    'samples': every prompt, answers w*k .. (w+1)*k-1 of each group for worker w, k = group_size / workers
    (seed key: -1 - w, never a prompt index, so no two shares draw the same samples)."""
    if split == "prompts":
        bounds = split_even(num_prompts, workers)
        return bounds, [(lo, 0) for lo, _ in bounds], [group_size] * workers
    if split != "samples":
        raise ValueError(f"split must be 'prompts' or 'samples', got {split!r}")
    if group_size % workers:
        raise ValueError(f"split 'samples': {group_size} answers a prompt do not divide over {workers} workers")
    k = group_size // workers
    return [(0, num_prompts)] * workers, [(-1 - w, w * k) for w in range(workers)], [k] * workers


def share_seed(seed: int, step: int, first_prompt: int) -> int:
    """Sampling seed of one share: fixed by (run seed, step, the share's first prompt), not by the worker,
    so a redone share draws the same samples."""
    return random.Random(f"rollout:{seed}:{step}:{first_prompt}").getrandbits(62)


def build_minibatches(samples: list[LearnSample], num_minibatches: int, num_workers: int) -> list[list[MiniBatch]]:
    """Split the step's samples into mini-batches, and each mini-batch over workers balanced by tokens.

    Returns per worker its list of mini-batches (same length for every worker; a part may be empty), each
    carrying the mini-batch's global response-token and response counts for the loss normalisation.
    """
    chunks = [samples[i::num_minibatches] for i in range(min(num_minibatches, len(samples)))]
    per_worker: list[list[MiniBatch]] = [[] for _ in range(num_workers)]
    for chunk in chunks:
        n_tokens = sum(len(s.response) for s in chunk)
        parts: list[list[LearnSample]] = [[] for _ in range(num_workers)]
        load = [0] * num_workers
        for s in sorted(chunk, key=lambda s: -(len(s.prompt) + len(s.response))):  # largest first
            r = min(range(num_workers), key=lambda i: (load[i], i))
            parts[r].append(s)
            load[r] += len(s.prompt) + len(s.response)
        for r in range(num_workers):
            per_worker[r].append(MiniBatch(parts[r], n_tokens, len(chunk)))
    return per_worker
