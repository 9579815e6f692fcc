"""What a run says while it runs and when it ends: plain progress lines (step k of N, time left) that reach
redirected logs too, where tqdm's bars switch themselves off, and the closing summary."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from tlt_rt.train.rl.sd_explain import sd_why


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Step k of N with the time left (from the mean step time of this process); while a step runs, a line
    every `every_s` seconds when the output is not a terminal (a terminal has tqdm's bars)."""

    def __init__(self, start_step: int, total_steps: int, every_s: float = 30.0, stream: TextIO | None = None):
        self.start_step, self.total = start_step, total_steps
        self.stream = stream or sys.stdout
        self.every_s = every_s
        self.t_run = time.time()
        self.done = 0
        self._step, self._t_step, self._phase, self._seqs = start_step, self.t_run, "", (0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if every_s > 0 and not _is_tty(self.stream):
            self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)
            self._thread.start()

    def begin(self, step: int, phase: str, total_seqs: int = 0) -> None:
        if step != self._step or not self._phase:
            self._t_step = time.time()
        self._step, self._phase, self._seqs = step, phase, (0, total_seqs)

    def update(self, n: int) -> None:
        """`n` more sequences done (the coordinator's progress hook)."""
        self._seqs = (self._seqs[0] + n, self._seqs[1])

    def step_done(self) -> None:
        self.done += 1
        self._phase = ""

    def eta(self) -> str:
        if not self.done:
            return "time left unknown until a step ends"
        per = (time.time() - self.t_run) / self.done
        return f"~{duration(per * (self.total - self.start_step - self.done))} left"

    def prefix(self, step: int) -> str:
        """`[step 3/5 | 1m10s | ~40s left]` for the line of finished step `step` (0-based)."""
        return f"[step {step + 1}/{self.total} | {duration(time.time() - self.t_run)} | {self.eta()}]"

    def line(self) -> str:
        seq = f" {self._seqs[0]}/{self._seqs[1]} sequences," if self._phase == "rollout" and self._seqs[1] else ""
        return (
            f"[progress] step {self._step + 1}/{self.total}: {self._phase}{seq} {duration(time.time() - self._t_step)} "
            f"into the step; run {duration(time.time() - self.t_run)}, {self.eta()}"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._phase:
                print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        self._stop.set()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _span(records: list[dict], key: str) -> str:
    vals = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return f"{vals[0]:.3f} -> {vals[-1]:.3f}" if vals else "-"


def run_summary(records: list[dict], run_dir: Path, checkpoint: Path | None, speculative: str, seconds: float) -> str:
    """The lines a run ends with: what it did, what speculation did and why, and where to look."""
    if not records:
        return f"no steps run; run folder {run_dir}"
    rollout = sum(r["rollout_seconds"] for r in records)
    total = sum(r["step_seconds"] for r in records)
    sd_time = [(r.get("sd_share") or 0.0, r["rollout_seconds"]) for r in records]
    sd_share = sum(a * b for a, b in sd_time) / rollout if rollout else 0.0
    hist: dict[str, int] = {}
    for r in records:
        for k, v in (r.get("accept_length_hist") or {}).items():
            hist[k] = hist.get(k, 0) + v
    n_sd = sum(hist.values())
    mean = sum(int(k) * v for k, v in hist.items()) / n_sd if n_sd else None
    accept = f"{mean:.2f} tokens per speculative step" if mean else "- (no speculative steps)"
    spot = sum(r.get("spot_steps", 0) for r in records)
    harvested = sum(r.get("harvested_worker_seconds", 0.0) for r in records)
    last = records[-1]
    lines = [
        f"done: {len(records)} step(s) in {duration(seconds)}"
        + (f" (resumed at step {records[0]['step'] + 1})" if records[0]["step"] else ""),
        f"  reward    {_span(records, 'reward_mean')}   accuracy {_span(records, 'accuracy')}",
        f"  rollout   {duration(rollout)} of {duration(total)} step time ({rollout / total:.0%})"
        if total
        else f"  rollout   {duration(rollout)}",
        f"  SD        {sd_share:.0%} of decode time ({last.get('sd_share') or 0.0:.0%} in the last step); "
        f"accept length {accept}",
        f"  why       {sd_why(last, speculative)}",
        f"  drafter   {spot} training step(s) on idle workers / the tail, {harvested:.1f} idle worker-seconds used",
        f"  run       {run_dir}  (metrics.jsonl, timelines.jsonl, config.yaml)",
        f"  checkpoint {checkpoint if checkpoint is not None else '(none yet)'}",
        f"  report    python -m tlt_rt.report {run_dir}",
    ]
    return "\n".join(lines)
