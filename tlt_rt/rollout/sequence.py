"""Request state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # rows of plain decode steps not yet copied out: (that step's [B, H] hidden, this sequence's row)
    _pending: list[tuple[torch.Tensor, int]] = field(default_factory=list)
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

    def add_hidden_row(self, batch: torch.Tensor, row: int) -> None:
        """Append row `row` of a plain decode step's [B, H] hidden states. Only the reference is kept (no
        tensor work on the decode path); the rows are copied out when the hidden states are next read."""
        self._pending.append((batch, row))

    def _flush(self) -> None:
        flush_hidden([self])

    def add_hidden(self, chunk: torch.Tensor) -> None:
        """Append target hidden rows. A chunk is usually a view of a whole batch's output, which it keeps
        alive; every MERGE_EVERY chunks the recent ones are copied into one tensor of their own."""
        if self._pending:  # rows of plain steps come first
            self._flush()
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
        self.num_cached = 0
        self.draft_cached = 0
        self.hidden_chunks, self._pending = [], []
        self.window_src, self.window_end = None, -1
        self.preemptions += 1


MERGE_EVERY = 32


def flush_hidden(seqs: list[Sequence]) -> None:
    """Copy out the pending plain-step rows of many sequences with one gather (the per-sequence path,
    `Sequence.hidden`, costs a tensor op per row: tens of ms at batch 128 after a few dozen plain steps)."""
    seqs = [s for s in seqs if s._pending]
    if not seqs:
        return
    offsets: dict[int, int] = {}
    bases, idx, counts, total = [], [], [], 0
    for s in seqs:
        for batch, row in s._pending:
            off = offsets.get(id(batch))
            if off is None:
                off = offsets[id(batch)] = total
                bases.append(batch)
                total += batch.shape[0]
            idx.append(off + row)
        counts.append(len(s._pending))
    rows = torch.cat(bases).index_select(0, torch.tensor(idx, device=bases[0].device))
    for s, chunk in zip(seqs, rows.split(counts), strict=True):
        s._pending = []
        s._append_chunk(chunk)


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
