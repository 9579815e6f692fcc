"""Tail training: with a single worker there is no idle peer, so the worker trains the drafter during its
own rollout tail. A background thread starts training once fewer than `drafter.tail_fraction` of its
sequences still run and stops when generation returns. It competes with generation for the device (on CPU
for the same cores); the cost shows in the step's rollout seconds and tail share.

It also competes for the GIL. A thread that wants the GIL gets it only after its holder has run for the
interpreter's switch interval (5 ms by default), and an engine step in the tail is about 1 ms that lets the GIL
go while it waits for the device, so beside a busy training thread each step can wait up to 5 ms to go on.
While the trainer runs, the interval is TAIL_SWITCH_INTERVAL_S instead. That is not what slows the tail on a
GPU: with SmolLM2 on an H100, plain decoding at batch 4-8 ran at under half speed beside tail training with
either interval (benchmarks/RESULTS.md, the end-to-end figure), so the contention there is on the device.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Literal

import torch


@dataclasses.dataclass
class DrafterTraining:
    """One worker's drafter training in one RL step: on an idle worker, or in its own rollout's tail."""

    rank: int
    where: Literal["idle", "tail"]
    steps: int = 0
    start: float = 0.0  # wall clock (time.time())
    end: float = 0.0
    loss: float | None = None  # mean over the steps trained
    top1: float | None = None  # agreement with the target's next token

    @property
    def seconds(self) -> float:
        return self.end - self.start if self.steps else 0.0


def tail_training_on(cfg) -> bool:
    """Whether workers train the drafter in their own rollout tail (`drafter.tail_training`)."""
    mode = cfg.drafter.tail_training
    return cfg.drafter.train_online and (mode == "on" or (mode == "auto" and cfg.cluster.num_workers == 1))


TAIL_SWITCH_INTERVAL_S = 1e-4  # beside a busy thread, a 1 ms step loop ran at 1.28 ms/step (5 ms: 6.2; CPU)


class TailTrainer:
    """Trains the drafter in a background thread while the engine's running batch is in its tail."""

    def __init__(self, engine, trainer, first_entry: int, capacity: int, fraction: float,
                 max_steps: int | None, poll_s: float = 0.01, rank: int = 0) -> None:  # fmt: skip
        self.engine, self.trainer = engine, trainer
        self.first_entry, self.threshold = first_entry, fraction * capacity
        self.max_steps, self.poll_s = max_steps, poll_s
        self.stop = threading.Event()
        self.result = DrafterTraining(rank, "tail")
        self._thread = threading.Thread(target=self._run, name="drafter-tail", daemon=True)

    def _in_tail(self) -> bool:
        tl = self.engine.timeline
        if len(tl) <= self.first_entry:
            return False
        last = tl[-1]
        return last["kind"] != "prefill" and 0 < last["running"] < self.threshold

    def _run(self) -> None:
        while not self.stop.is_set() and not self._in_tail():
            self.stop.wait(self.poll_s)
        if self.stop.is_set():
            return
        start = time.time()
        device = self.trainer.device
        if device.type == "cuda":
            # its own stream: training kernels interleave with the engine's replays instead of queueing
            # behind them on the default stream; the buffer's tensors were written on the default stream
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.default_stream(device))
            with torch.cuda.stream(stream):
                out = self.trainer.train(self.stop, max_steps=self.max_steps)
            stream.synchronize()
        else:
            out = self.trainer.train(self.stop, max_steps=self.max_steps)
        end = time.time()
        self.result = DrafterTraining(self.result.rank, "tail", int(out["steps"]), start, end, out["loss"], out["top1"])

    def start(self) -> None:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, TAIL_SWITCH_INTERVAL_S))
        self._thread.start()

    def finish(self) -> DrafterTraining:
        self.stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        return self.result
