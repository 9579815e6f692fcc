"""A decode step's host side: its packed inputs built from the sequences, its one host copy parsed back.

Both run once per step around the device work (rollout/step/graph.py describes the buffers), so they are
vectorised: numpy arrays filled column by column (no tensor built from nested lists, no per-element
`int()`), and each sequence is read for its scalars only (its pending root is `Sequence.last_token`,
never the whole token list). The acceptance uniforms depend only on each sequence's seed and step counter
(rollout/step/rng.py), so the next step's are drawn while the device runs this one (`Uniforms.prefetch`).

A step made one step ahead (`ahead=1`: the engine's overlapped plain decoding) is packed before the step in
flight is postprocessed: its sequences are one token further than they say (num_cached, counter), and its
root is that step's sampled token, which the device copies into place (`StepArgs.tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from tlt_rt.rollout.block_manager import Tables
from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.rng import host_uniforms
from tlt_rt.rollout.step.target import to_device


def row_params(seqs: list[Sequence], params: SamplingParams) -> list[SamplingParams]:
    """Each sequence's sampling settings: its request's own (AsyncEngine), else the call's."""
    return [params if s.params is None else s.params for s in seqs]


def distinct(rows: list[SamplingParams]) -> list[SamplingParams]:
    """The distinct settings objects among `rows`, in order of first use."""
    return list({id(p): p for p in rows}.values())


@dataclass
class StepOut:
    """One step's results on the host, per sequence: a+1 tokens (a accepted drafts, then the bonus)."""

    accept_len: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    hidden: Tensor | None  # [B, D+1, H] on the device (a copy): target hidden at the root and accepted nodes

    def rows(self, keep: list[int]) -> StepOut:
        """The results of the sequences at positions `keep` only. The hidden rows are picked on the device by an
        index uploaded without a wait (`to_device`): indexing by a list uploads it from pageable memory, which
        waits for every step queued on the stream, the one queued ahead of this one too (a stall at each finish)."""
        hidden = self.hidden
        if hidden is not None:
            hidden = hidden.index_select(0, to_device(torch.tensor(keep, dtype=torch.long), hidden.device))
        return StepOut(
            [self.accept_len[i] for i in keep],
            [self.tokens[i] for i in keep],
            [self.logprobs[i] for i in keep],
            hidden,
        )


class PinnedRing:
    """Page-locked host buffers a step's host <-> device copies go through, two of each kind used in turn.

    A copy from pageable memory may wait for the stream's earlier work, so a step queued behind the one
    running would wait for it; from a pinned buffer the copy is queued and the host goes on. A buffer is
    written again two uses later, by when the host has waited for the step that read it (the engine
    keeps at most one step in flight beyond the one it collects). On the CPU every call returns its tensor.
    """

    def __init__(self, device: torch.device):
        self.pinned = device.type == "cuda"
        self._slots: dict[tuple, list[Tensor]] = {}
        self._turn: dict[tuple, int] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """The next pinned buffer of this kind, viewed as `shape` (grown when too small)."""
        kind, n = (name, dtype), int(np.prod(shape))
        slots = self._slots.get(kind)
        if slots is None or slots[0].numel() < n:
            size = max(n, 2 * slots[0].numel() if slots else 0)
            slots = self._slots[kind] = [torch.empty(size, dtype=dtype, pin_memory=True) for _ in range(2)]
        turn = self._turn.get(kind, 0)
        self._turn[kind] = 1 - turn
        return slots[turn][:n].view(shape)

    def stage(self, name: str, t: Tensor) -> Tensor:
        """`t` (a host tensor) in the next pinned buffer of its kind; `t` itself on the CPU."""
        if not self.pinned:
            return t
        buf = self.take(name, tuple(t.shape), t.dtype)
        buf.copy_(t)
        return buf


class Uniforms:
    """The acceptance walks' uniforms of a step, [B, n] float32; the next step's drawn ahead.

    width: the most a step reads (2 x (deepest depth + 1)); a prefetch draws that many, or as many as it is
    told, and a step reads the first n (each uniform depends on its index alone, so a prefix is the same
    numbers bit for bit); a step that needs more than were drawn draws its own.
    """

    def __init__(self, width: int):
        self.width = width
        self._ahead: tuple[tuple[int, ...], list[int], np.ndarray] | None = None  # (seq ids, counters, [B, width])

    def get(self, seqs: list[Sequence], n: int, ahead: int = 0) -> np.ndarray:
        """[B, n] for the step `ahead` steps past each sequence's counter."""
        counters = [s.counter + ahead for s in seqs]
        drawn, self._ahead = self._ahead, None
        if drawn is not None and n <= drawn[2].shape[1] and drawn[1] == counters:
            if drawn[0] == tuple(s.seq_id for s in seqs):
                return drawn[2][:, :n]
        return host_uniforms([s.seed for s in seqs], counters, n)

    def prefetch(self, seqs: list[Sequence], n: int | None = None, ahead: int = 0) -> None:
        """Draw the first `n` (None: width) uniforms of the same batch's next step (every counter one on, past
        the `ahead` steps already in flight): the host does it while the device runs, and a batch that changed
        meanwhile draws its own in `get`."""
        counters = [s.counter + 1 + ahead for s in seqs]
        drawn = host_uniforms([s.seed for s in seqs], counters, self.width if n is None else min(n, self.width))
        self._ahead = (tuple(s.seq_id for s in seqs), counters, drawn)


def pack_ints(seqs: list[Sequence], tables: Tables, rows: int, depth: int, ahead: int = 0) -> Tensor:
    """ints [B, 2 + R + W] int64: prefix_len, ctx_len, the last R tokens (the root last), the block table
    padded with block 0 to the longest (W). `ahead` (plain steps only): the step that many steps past the
    sequences' state, its root left for the device to fill."""
    if ahead and depth:
        raise ValueError("only a plain step is packed ahead of the step in flight")
    b, w = len(seqs), tables.array.shape[1]
    ints = np.empty((b, 2 + rows + w), dtype=np.int64)
    ints[:, 0] = [s.num_cached + ahead for s in seqs]
    if depth == 0:  # ctx_len 0: a plain step runs no catch-up rows
        ints[:, 1] = 0
        ints[:, 2] = [s.last_token for s in seqs]
    else:
        np.minimum(ints[:, 0], rows, out=ints[:, 1])
        last = np.fromiter(chain.from_iterable(s.last_tokens(rows) for s in seqs), np.int64, b * rows)
        ints[:, 2 : 2 + rows] = last.reshape(b, rows)
    ints[:, 2 + rows :] = tables.array
    return torch.from_numpy(ints)


def pack_floats(
    seqs: list[Sequence], rows: list[SamplingParams], depth: int, uniforms: Uniforms, ahead: int = 0
) -> Tensor:
    """floats [B, 2(D+1) + 3] float32: the uniforms, then temperature, top_k, top_p."""
    floats = np.empty((len(seqs), 2 * (depth + 1) + 3), dtype=np.float32)
    if all(p.greedy for p in rows):  # greedy acceptance reads no uniform
        floats[:, :-3] = 0.0
    else:
        floats[:, :-3] = uniforms.get(seqs, 2 * (depth + 1), ahead)
    if all(p is rows[0] for p in rows):  # one setting for the batch (generate)
        floats[:, -3:] = (rows[0].temperature, rows[0].top_k, rows[0].top_p)
    else:  # per-request settings (AsyncEngine)
        floats[:, -3:] = [(p.temperature, p.top_k, p.top_p) for p in rows]
    return torch.from_numpy(floats)


def parse_host(host: np.ndarray, depth: int) -> tuple[list[int], list[list[int]], list[list[float]]]:
    """The host copy [B, 1 + 2(D+1)] float64 (accept length, D+1 tokens, D+1 log-probs) as per-sequence
    lists: accept lengths a, and the a+1 emitted tokens and log-probs of each sequence."""
    accept = host[:, 0].astype(np.int64).tolist()
    tokens = host[:, 1 : 2 + depth].astype(np.int64).tolist()
    logprobs = host[:, 2 + depth :].tolist()
    if depth:
        tokens = [t[: a + 1] for t, a in zip(tokens, accept, strict=True)]
        logprobs = [lp[: a + 1] for lp, a in zip(logprobs, accept, strict=True)]
    return accept, tokens, logprobs
