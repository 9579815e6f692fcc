"""The target hidden windows the drafter's catch-up block reads, kept on the device between steps.

Each sequence's window holds its last W target hidden rows, ending at its num_cached. A speculative step
keeps the windows it read (`keep_windows`); plain steps in between note their rows (`move_windows`) and the
windows take them all at once when next read (`settle_windows`), so a speculative step after plain ones
reads no history (`_current_windows`). `_window` rebuilds one window from the history when none is current.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.target import to_device


class DraftWindows:
    """Every sequence's window of target hidden rows for the catch-up block (`DrafterRunner` is one).

    window_rows: target hidden rows each sequence keeps on the device for the catch-up block (the deepest
    strategy's depth + 1, one more in auto mode); 0 keeps exactly what each step needs.
    """

    def __init__(self, window_rows: int, device):
        self.device = device
        self.window_rows = window_rows
        self._recent: tuple[tuple[int, ...], Tensor] | None = None  # (sequence ids, their windows) of the last step
        self._plain: PlainRun | None = None  # plain steps since, whose rows the windows have not taken yet

    def _current_windows(self, seqs: list[Sequence], width: int) -> Tensor | None:
        """The windows the last step kept, if every sequence's is there and ends at its num_cached (no
        history read): as they are for the same batch, the survivors' in one gather for a batch that lost
        sequences since; else None."""
        recent = self._recent
        if recent is None or recent[1].shape[1] < width:
            return None
        src = recent[1]
        if not all(s.window_src is src and s.window_end == s.num_cached for s in seqs):
            return None
        if recent[0] == tuple(s.seq_id for s in seqs):
            return src
        rows = to_device(torch.tensor([s.window_row for s in seqs], dtype=torch.long), self.device)
        return src.index_select(0, rows)

    def move_windows(self, seqs: list[Sequence], hidden: Tensor) -> None:
        """After a plain step (hidden [B, 1, H]: each sequence's row of position num_cached): the windows move
        on by that row, so that the next speculative step after plain ones reads no history. The move waits
        for that step (`settle_windows`): a plain step only notes its rows, and a stretch of plain steps over
        one batch moves the windows once, by all of its rows, in one concatenation; a plain step thus costs
        what it costs without a drafter but for the rows it logs. Nothing moves unless every window was
        current when the stretch began (as a speculative step leaves them)."""
        run = self._plain
        if run is not None and len(seqs) == len(run.seqs) and all(map(operator.is_, seqs, run.seqs)):
            run.rows.append(hidden)
            run.steps += 1
            return
        self.settle_windows()  # the batch changed (a finish, a preemption): the last stretch ends here
        current = self._current_windows(seqs, self.window_rows)
        if current is not None:
            self._plain = PlainRun(seqs, current, deque([hidden], maxlen=current.shape[1]))

    def settle_windows(self) -> None:
        """Move the windows on by the rows of the plain steps noted since they were last kept (`move_windows`):
        row i of the result is sequence i's window, as many steps later (its last W rows of window ++ rows).
        A sequence preempted meanwhile (its window dropped) keeps none."""
        run, self._plain = self._plain, None
        if run is None:
            return
        w = run.windows
        m = len(run.rows)  # min(steps, W): older rows fall out of every window
        moved = torch.cat([w[:, m:], *(h[:, :1].to(w.dtype) for h in run.rows)], 1)
        for i, s in enumerate(run.seqs):
            if s.window_src is not None:
                s.window_src, s.window_row, s.window_end = moved, i, s.window_end + run.steps
        self._recent = (tuple(s.seq_id for s in run.seqs), moved)

    def _window(self, s: Sequence, width: int) -> Tensor:
        """Sequence `s`'s last `width` hidden rows [width, H], zeros before position 0, read from the history
        unless its window is current."""
        if s.window is not None and s.window_end == s.num_cached and s.window.shape[0] >= width:
            return s.window[-width:]
        L = s.num_cached
        h = s.hidden_rows(max(0, L - width), L).to(self.device)
        if h.shape[0] < width:
            h = torch.cat([h.new_zeros(width - h.shape[0], h.shape[1]), h])
        return h

    def keep_windows(self, seqs: list[Sequence], windows: Tensor, ends: list[int]) -> None:
        """After a step: sequence i's window [W, H] now ends at position ends[i]."""
        for i, (s, end) in enumerate(zip(seqs, ends, strict=True)):  # row i, viewed only when read
            s.window_src, s.window_row, s.window_end = windows, i, end
        self._recent = (tuple(s.seq_id for s in seqs), windows)


@dataclass
class PlainRun:
    """Plain steps over one batch whose rows the drafter's windows have not taken yet (`DraftWindows.move_windows`)."""

    seqs: list[Sequence]  # the batch, the same sequences every step
    windows: Tensor  # [B, W, H] their windows when the stretch began, each ending at its num_cached then
    rows: deque  # the last (at most W) steps' hidden rows, each [B, 1, H]
    steps: int = 1
