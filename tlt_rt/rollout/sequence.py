"""Request state inside the engine."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from tlt_rt.rollout.params import Completion, SamplingParams


@dataclass
class Sequence:
    """One sample being generated.

    Invariant while running: the target KV cache holds positions [0, num_cached) and the last token of
    `tokens` (the pending root, at position num_cached) is not cached yet. The drafter's cache holds rows
    [0, draft_cached); drafter row p pairs the target hidden h_p with token x_{p+1}.
    """

    seq_id: int
    prompt_index: int
    sample_index: int
    prompt: list[int]
    seed: int
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_cached: int = 0
    draft_cached: int = 0
    hidden_chunks: list[torch.Tensor] = field(default_factory=list)  # target hidden of positions [0, num_cached)
    # the drafter's catch-up window (`window`): target hidden [R, H] of positions [window_end - R, window_end),
    # zeros before position 0, row window_row of a step's moved windows [B, R, H] (window_src); kept on the
    # device by the speculative step so the next one needs no host work
    window_src: torch.Tensor | None = None
    window_row: int = 0
    window_end: int = -1
    counter: int = 0  # RNG step counter
    _fresh: int = 0  # chunks appended since the last merge
    step_rows: StepRows | None = None  # the log of decode steps' hidden rows this sequence is recorded in
    finish_reason: str | None = None
    preemptions: int = 0
    # per-request settings (AsyncEngine): None means the generate call's SamplingParams / stop set
    params: SamplingParams | None = None
    stop: frozenset[int] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def window(self) -> torch.Tensor | None:
        """The catch-up window [R, H] (a view made on demand: a step keeps its batch's windows in one call)."""
        return None if self.window_src is None else self.window_src[self.window_row]

    @property
    def last_token(self) -> int:
        """The pending root (the last token), without building `tokens`."""
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def hidden(self) -> torch.Tensor:
        """[num_cached, H] target hidden states, concatenated once and kept as one chunk."""
        self._flush()
        if len(self.hidden_chunks) > 1:
            self.hidden_chunks = [torch.cat(self.hidden_chunks)]
            self._fresh = 0
        return self.hidden_chunks[0]

    def hidden_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end); a tail of the rows is read from the last chunks alone, without merging them all."""
        self._flush()
        total = sum(c.shape[0] for c in self.hidden_chunks)
        if end != total or start < 0 or start > end:
            return self.hidden()[start:end]
        parts, need = [], end - start
        for c in reversed(self.hidden_chunks):
            if need <= 0:
                break
            take = min(need, c.shape[0])
            parts.append(c[c.shape[0] - take :])
            need -= take
        if not parts:
            return self.hidden()[start:end]
        return parts[0] if len(parts) == 1 else torch.cat(parts[::-1])

    def _flush(self) -> None:
        """Copy out the rows decode steps logged (for every sequence of the log at once)."""
        if self.step_rows is not None and self.step_rows.steps:
            self.step_rows.flush()

    def add_hidden(self, chunk: torch.Tensor) -> None:
        """Append target hidden rows. A chunk is usually a view of a whole batch's output, which it keeps
        alive; every MERGE_EVERY chunks the recent ones are copied into one tensor of their own."""
        self._flush()  # rows of earlier decode steps come first
        self._append_chunk(chunk)

    def _append_chunk(self, chunk: torch.Tensor) -> None:
        self.hidden_chunks.append(chunk)
        self._fresh = min(self._fresh + 1, len(self.hidden_chunks))
        if self._fresh >= MERGE_EVERY:
            self.hidden_chunks[-self._fresh :] = [torch.cat(self.hidden_chunks[-self._fresh :])]
            self._fresh = 0

    def last_tokens(self, n: int, pad: int = 0) -> list[int]:
        """The last n tokens, front-padded with `pad` when there are fewer (no copy of the whole sequence)."""
        out = self.output[-n:] if n else []
        if len(out) < n:
            out = self.prompt[max(0, len(self.prompt) - (n - len(out))) :] + out
        return [pad] * (n - len(out)) + out

    def completion(self, with_hidden: bool = False) -> Completion:
        """What the caller gets back for this sample (its hidden rows when asked)."""
        hidden = self.hidden()[: self.length - 1].detach() if with_hidden else None
        return Completion(self.prompt_index, self.sample_index, list(self.output), list(self.logprobs),
                          self.finish_reason or "length", hidden, {"preemptions": self.preemptions})  # fmt: skip

    def reset_for_recompute(self) -> None:
        """Forget every cached row (blocks were taken away); the tokens are kept."""
        self._flush()  # the log's other sequences keep their rows
        self.num_cached = 0
        self.draft_cached = 0
        self.hidden_chunks = []
        self.window_src, self.window_end = None, -1
        self.preemptions += 1


MERGE_EVERY = 32


class StepRows:
    """The target hidden rows of decode steps, logged per step: a step records its rows and its B sequences
    in one call, whatever B (no per-sequence work on the decode path), and the rows reach each sequence's
    history when any of them is next read (`flush`). A plain step logs [B, H] (a row each), a speculative
    one [B, D+1, H] and how many of each sequence's rows it kept. A sequence names its log in
    `Sequence.step_rows`."""

    def __init__(self):
        self.steps: list[tuple[torch.Tensor, list[int] | None, list[Sequence]]] = []

    def add(self, rows: torch.Tensor, seqs: list[Sequence], kept: list[int] | None = None) -> None:
        """Row i of `rows` [B, H] is the next hidden row of seqs[i]; or, with `kept`, rows [B, W, H] of which
        seqs[i] takes the first kept[i] <= W. The lists are kept: do not change them. Every MERGE_EVERY steps
        the log is flushed, so it never holds more: a scheduler that outlives its requests (`AsyncEngine`)
        would otherwise keep the rows of every finished one."""
        self.steps.append((rows, kept, seqs))
        if len(self.steps) >= MERGE_EVERY:
            self.flush()

    def flush(self) -> None:
        """Append every logged row to its sequence, in step order, per run of steps that ran the same
        sequences (the usual stretch between a finish and the next), whose rows each of them takes as one
        chunk: one stack for a run of plain steps, one gather where a speculative step kept some rows."""
        steps, self.steps = self.steps, []
        runs: list[tuple[list[Sequence], list[tuple[torch.Tensor, list[int] | None]]]] = []
        for rows, kept, q in steps:
            last = runs[-1][0] if runs else None
            if last is not None and (q is last or (len(q) == len(last) and all(map(operator.is_, q, last)))):
                runs[-1][1].append((rows, kept))
            else:
                runs.append((q, [(rows, kept)]))
        for q, entries in runs:
            if all(kept is None for _, kept in entries):
                chunks = torch.stack([rows for rows, _ in entries], 1).unbind(0)  # [B, steps, H]
            else:
                chunks = _kept_rows(len(q), entries)
            for seq, chunk in zip(q, chunks, strict=True):
                seq._append_chunk(chunk)


def _kept_rows(b: int, entries: list[tuple[torch.Tensor, list[int] | None]]) -> list[torch.Tensor]:
    """Each of b sequences' rows over a run of steps ([B, H] rows, or [B, W, H] and the rows kept of each),
    in step order, as b views of one gather: the run's rows flattened into one [N, H], the kept ones picked
    by indices built on the host."""
    flat = [rows.reshape(b, 1 if rows.dim() == 2 else rows.shape[1], rows.shape[-1]) for rows, _ in entries]
    widths = np.array([r.shape[1] for r in flat])
    bases = np.concatenate([[0], np.cumsum(widths * b)[:-1]])  # each step's first row in the flattened run
    kept = np.array([[1] * b if k is None else k for _, k in entries], dtype=np.int64).T  # [B, steps]
    starts = (bases[None, :] + np.arange(b)[:, None] * widths[None, :]).ravel()  # sequence-major, then step
    lens = kept.ravel()
    idx = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(lens.sum())
    rows = torch.cat([r.reshape(-1, r.shape[-1]) for r in flat]) if len(flat) > 1 else flat[0].flatten(0, 1)
    index = torch.from_numpy(idx)
    if rows.is_cuda:  # pinned, so the copy does not wait for the stream's queued work
        index = index.pin_memory().to(rows.device, non_blocking=True)
    return list(rows.index_select(0, index).split(kept.sum(1).tolist()))


def flush_hidden(seqs: list[Sequence]) -> None:
    """Copy out the logged decode-step rows of many sequences (each log once, a stack or gather per run of
    steps: the rows one by one cost a tensor op each, tens of ms at batch 128 after a few dozen steps)."""
    logs = {id(s.step_rows): s.step_rows for s in seqs if s.step_rows is not None and s.step_rows.steps}
    for log in logs.values():
        log.flush()


@dataclass
class PrefillJob:
    """Tokens to push through the target before their owner can decode.

    A new prompt group prefills the whole prompt once and then forks into its `n` samples; a preempted
    sequence prefills all of its tokens but the pending last one.
    """

    seq_id: int  # block-manager id holding the KV
    tokens: list[int]
    done: int = 0
    group: list[Sequence] | None = None  # the samples to fork into when a prompt finishes
    seq: Sequence | None = None  # the sequence being recomputed
    hidden_chunks: list[torch.Tensor] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done
