"""Drafter training data: a bounded buffer of (token ids, target hidden states) and packed batches.

A sample is one whole sequence (prompt + response): ids [L] int64 and the target's hidden states [L, H]
(`ModelOutput.hidden`, before the final norm). It gives L-1 training rows; row t pairs h_t with x_{t+1}
and its target is h_{t+1} (the drafter predicts the next feature and, through the LM head, x_{t+2}).

Packing concatenates the rows of several samples into one row of at most `batch_tokens`; positions
restart at 0 for every sample and `segment_ids` make attention block-diagonal causal. Rows are shifted per
sample before packing, so no row ever pairs tokens of two samples; only padding is masked out of the loss.
When the next sample does not fit, the first of the next 64 samples that does is swapped in (first fit;
the epoch still visits every sample once). A sample with more rows than `batch_tokens` is cut into chunks
that keep their positions (a chunk does not attend to the previous chunk).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch

from tlt_rt.models.llama import CausalLM


@dataclass
class DrafterBatch:
    input_ids: torch.Tensor  # [R, T] int64, x_{t+1}
    hidden: torch.Tensor  # [R, T, H] target hidden h_t (before the final norm)
    target_hidden: torch.Tensor  # [R, T, H] target hidden h_{t+1}
    positions: torch.Tensor  # [R, T] int64, restarting at each sample
    segment_ids: torch.Tensor  # [R, T] int32, one id per sample piece, -1 on padding
    loss_mask: torch.Tensor  # [R, T] bool, False on padding
    cu_seqlens: torch.Tensor  # [S+1] int32, piece boundaries among the real rows (`x[loss_mask]` order)
    # known on the host where the batch is assembled, so that reading them never waits for the device
    tokens: int = -1  # real rows (-1: count loss_mask)
    shared_rows: bool | None = None  # whether some row holds pieces of several samples (None: look)

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.tokens >= 0 else int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> DrafterBatch:
        """The tensors on `device` (without waiting), the host facts as they are."""
        return DrafterBatch(**{f.name: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                               for f in fields(self) for v in [getattr(self, f.name)]})  # fmt: skip


@dataclass
class _Step:
    """One RL step's samples, concatenated: sample i is ids[starts[i] : starts[i] + lengths[i]]."""

    step: int
    ids: torch.Tensor  # [N] int64
    hidden: torch.Tensor  # [N, H]
    starts: torch.Tensor  # [n] int64
    lengths: torch.Tensor  # [n] int64

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


def _cat_step(step: int, ids_list: list[torch.Tensor], hidden_list: list[torch.Tensor], device) -> _Step:
    lengths = torch.tensor([t.shape[0] for t in ids_list], dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    ids = torch.cat([t.to(device, torch.int64) for t in ids_list])
    hidden = torch.cat([h.detach().to(device) for h in hidden_list])
    return _Step(step, ids, hidden, starts, lengths)


class DrafterBuffer:
    """(ids, target hidden) samples of the last `max_steps` RL steps, at most `max_tokens` tokens in all.

    Batches come in a deterministic order: a seeded permutation of all samples per epoch, read with a
    cursor (`state_dict()` / `load_state_dict()`). Adding or evicting data starts a new epoch. Storage is
    tensors only: one concatenated ids / hidden tensor per step with sample offsets.
    """

    def __init__(self, max_steps: int = 4, max_tokens: int | None = None, device=None, seed: int = 0):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if max_tokens is not None and max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 or None, got {max_tokens}")
        self.max_steps, self.max_tokens, self.device, self.seed = max_steps, max_tokens, device, seed
        self._steps: list[_Step] = []
        self._epoch, self._pos, self._offset = 0, 0, 0  # cursor: epoch, index in its permutation, row in sample
        self._index = self._perm = self._rows = torch.zeros(0, dtype=torch.int64)

    # -- contents --
    @property
    def steps(self) -> list[int]:
        return [s.step for s in self._steps]

    @property
    def num_samples(self) -> int:
        return sum(s.lengths.numel() for s in self._steps)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self._steps)

    def add(self, step: int, ids_list: list[torch.Tensor], hidden_list: list[torch.Tensor]) -> None:
        """Store one RL step's sequences: ids [L] and hidden [L, H] each; samples with L < 2 hold no row."""
        if len(ids_list) != len(hidden_list):
            raise ValueError(f"{len(ids_list)} id tensors but {len(hidden_list)} hidden tensors")
        if self._steps and step < self._steps[-1].step:
            raise ValueError(f"step {step} is older than the newest buffered step {self._steps[-1].step}")
        keep_ids, keep_hidden = [], []
        for i, (ids, hid) in enumerate(zip(ids_list, hidden_list, strict=True)):
            if ids.dim() != 1 or hid.dim() != 2 or hid.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"sample {i}: expected ids [L] and hidden [L, H], got {tuple(ids.shape)} and {tuple(hid.shape)}"
                )
            if self._steps and hid.shape[1] != self._steps[0].hidden.shape[1]:
                raise ValueError(f"sample {i}: hidden size {hid.shape[1]} != buffered {self._steps[0].hidden.shape[1]}")
            if ids.shape[0] >= 2:
                keep_ids.append(ids)
                keep_hidden.append(hid)
        if keep_ids:
            new = _cat_step(step, keep_ids, keep_hidden, self.device or keep_hidden[0].device)
            if self._steps and self._steps[-1].step == step:  # more samples of the newest step
                old = self._steps.pop()
                new = _Step(
                    step,
                    torch.cat([old.ids, new.ids.to(old.ids.device)]),
                    torch.cat([old.hidden, new.hidden.to(old.hidden.device)]),
                    torch.cat([old.starts, new.starts + old.num_tokens]),
                    torch.cat([old.lengths, new.lengths]),
                )
            self._steps.append(new)
        self._evict()
        self._new_epoch()

    def _evict(self) -> None:
        newest = self._steps[-1].step if self._steps else 0
        self._steps = [s for s in self._steps if s.step > newest - self.max_steps]
        while self.max_tokens is not None and len(self._steps) > 1 and self.num_tokens > self.max_tokens:
            self._steps.pop(0)
        if self.max_tokens is not None and self._steps and self.num_tokens > self.max_tokens:
            # the newest step alone is too big: keep its first samples that fit (at least one)
            s = self._steps[0]
            ends = s.starts + s.lengths
            n = max(1, int((ends <= self.max_tokens).sum()))
            end = int(ends[n - 1])
            self._steps[0] = _Step(s.step, s.ids[:end], s.hidden[:end], s.starts[:n], s.lengths[:n])
            warnings.warn(
                f"drafter buffer: step {s.step} alone exceeds max_tokens={self.max_tokens}; "
                f"kept {n} of {s.lengths.numel()} samples",
                stacklevel=3,
            )

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] how often each id occurs in the buffer (for a reduced draft vocabulary)."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for s in self._steps:
            counts += torch.bincount(s.ids.cpu(), minlength=vocab_size)
        return counts

    # -- deterministic order --
    def _new_epoch(self, epoch: int | None = None) -> None:
        self._epoch = self._epoch + 1 if epoch is None else epoch
        self._pos = self._offset = 0
        self._refresh_order()

    def _refresh_order(self) -> None:
        # _index[g] = (step slot, sample) of global sample g, in step order
        parts = [
            torch.stack([torch.full_like(s.lengths, i), torch.arange(s.lengths.numel())], 1)
            for i, s in enumerate(self._steps)
        ]
        self._index = torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.int64)
        self._rows = torch.cat([s.lengths for s in self._steps]) - 1 if parts else torch.zeros(0, dtype=torch.int64)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self._epoch)
        self._perm = torch.randperm(self._index.shape[0], generator=gen)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "pos": self._pos,
            "offset": self._offset,
            "num_samples": self.num_samples,
            "perm": self._perm.clone(),  # the epoch's order after first-fit swaps
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor; the order matches the saved one when the buffer holds the same samples."""
        if state.get("num_samples", self.num_samples) != self.num_samples:
            warnings.warn("drafter buffer: restoring a cursor saved over different contents", stacklevel=2)
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._refresh_order()
        perm = state.get("perm")
        if perm is not None and perm.numel() == self._perm.numel():
            self._perm = perm.clone().to(torch.int64)
        self._pos, self._offset = int(state["pos"]), int(state["offset"])

    def _current(self) -> tuple[_Step, int, int]:
        """The sample under the cursor: (its step, its start, its number of rows), advancing epochs as needed."""
        if self._pos >= self._perm.numel():
            self._new_epoch()
        slot, i = self._index[self._perm[self._pos]].tolist()
        s = self._steps[slot]
        return s, int(s.starts[i]), int(s.lengths[i]) - 1

    def _swap_in_fitting(self, space: int, window: int = 64) -> bool:
        """First fit: bring the first of the next `window` samples of this epoch with <= `space` rows under the
        cursor (a swap inside the permutation, so the epoch still visits every sample once)."""
        ahead = self._perm[self._pos + 1 : self._pos + 1 + window]
        hit = torch.nonzero(self._rows[ahead] <= space).flatten()
        if hit.numel() == 0:
            return False
        j = self._pos + 1 + int(hit[0])
        self._perm[[self._pos, j]] = self._perm[[j, self._pos]]
        return True

    def next_batch(self, batch_tokens: int, packed: bool = True) -> DrafterBatch:
        """The next batch of at most `batch_tokens` rows (tokens), packed into one row or one sample per row."""
        if not self._steps:
            raise RuntimeError("the drafter buffer is empty: add samples before drawing batches")
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        pieces: list[tuple[_Step, int, int, int]] = []  # (step, sample start, first row, rows)
        used = longest = 0
        while True:
            s, start, rows = self._current()
            left = rows - self._offset
            n = min(left, batch_tokens)
            cost = used + n if packed else (len(pieces) + 1) * max(longest, n)
            if pieces and cost > batch_tokens:
                if packed and self._offset == 0 and self._swap_in_fitting(batch_tokens - used):
                    continue
                break
            pieces.append((s, start, self._offset, n))
            used, longest = used + n, max(longest, n)
            if n < left:
                self._offset += n
                break
            self._pos, self._offset = self._pos + 1, 0
        return _assemble(pieces, packed)


def _assemble(pieces: list[tuple[_Step, int, int, int]], packed: bool) -> DrafterBatch:
    ids, hid, tgt, pos, seg = [], [], [], [], []
    for k, (s, start, r0, n) in enumerate(pieces):
        a = start + r0
        ids.append(s.ids[a + 1 : a + n + 1])
        hid.append(s.hidden[a : a + n])
        tgt.append(s.hidden[a + 1 : a + n + 1])
        pos.append(torch.arange(r0, r0 + n, device=s.ids.device))
        seg.append(torch.full((n,), k, dtype=torch.int32, device=s.ids.device))
    lens = torch.tensor([p[3] for p in pieces], dtype=torch.int32)
    if packed:
        rows = [torch.cat(x)[None] for x in (ids, hid, tgt, pos, seg)]
    else:
        t = int(lens.max())

        def pad(xs, value):
            return torch.stack([torch.cat([x, x.new_full((t - x.shape[0], *x.shape[1:]), value)]) for x in xs])

        rows = [pad(ids, 0), pad(hid, 0), pad(tgt, 0), pad(pos, 0), pad(seg, -1)]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0, dtype=torch.int32)])
    return DrafterBatch(rows[0], rows[1], rows[2], rows[3], rows[4], rows[4] >= 0, cu.to(rows[0].device),
                        int(lens.sum()), packed and len(pieces) > 1)  # fmt: skip


@torch.no_grad()
def collect_hidden(target: CausalLM, ids_list: list[torch.Tensor], max_batch_tokens: int = 8192) -> list[torch.Tensor]:
    """Target hidden states [L, H] (before the final norm) for each sequence, from the learner's dense forward.

    Sequences are right-padded into batches of about `max_batch_tokens`; causal attention keeps each
    sequence's rows independent of the padding after it.
    """
    device = target.lm_head.weight.device
    order = sorted(range(len(ids_list)), key=lambda i: ids_list[i].shape[0])
    out: list[torch.Tensor | None] = [None] * len(ids_list)
    i = 0
    while i < len(order):
        longest = ids_list[order[i]].shape[0]
        j = i + 1
        while j < len(order) and (j - i + 1) * ids_list[order[j]].shape[0] <= max_batch_tokens:
            longest = ids_list[order[j]].shape[0]
            j += 1
        batch = torch.zeros(j - i, longest, dtype=torch.int64, device=device)
        for r, k in enumerate(order[i:j]):
            batch[r, : ids_list[k].shape[0]] = ids_list[k]
        hidden = target(batch).hidden
        for r, k in enumerate(order[i:j]):
            out[k] = hidden[r, : ids_list[k].shape[0]]
        i = j
    return out
