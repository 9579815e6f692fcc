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

Two settings bound what the trainer takes from the device (`drafter.tail_sms`, `drafter.tail_duty`):
- `tail_sms` > 0 runs its kernels on a stream of a CUDA green context holding that many SMs (rounded up to
  the device's granularity). A training GEMM then occupies at most those SMs, and the engine's small decode
  kernels find the others free instead of queueing behind a full wave. The engine itself keeps every SM.
  Where green contexts are missing (older torch or driver) it warns once and uses a low-priority stream.
- `tail_micro_tokens` splits each training step into micro-batches: the rollout's end, which waits for the
  trainer, then waits for one micro-batch, and the step is applied on the micro-batches done (on 16 SMs a whole
  8,192-token step of the 1.5B model's drafter kept the rollout waiting 0.1-0.5 s after its last token).
- `tail_duty` < 1 paces the trainer: after a step of `t` seconds it waits `t * (1 - duty) / duty`, so it keeps
  the device busy at most that share of the tail's time (memory bandwidth and L2 are shared whatever the SMs).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import warnings
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


def sm_partition(requested: int, total: int, granularity: int = 8) -> int:
    """SMs a green context of `requested` SMs gets: rounded up to `granularity`, at most `total`; 0 = no partition."""
    n = -(-requested // granularity) * granularity
    return n if 0 < n < total else 0


_GREEN: dict[tuple[int, int], object] = {}  # (device, SMs) -> (green context, its stream), made once
_GREEN_WARNED: set[str] = set()


def trainer_stream(device: torch.device, sms: int = 0):
    """A CUDA stream for training beside a rollout: on a green context of `sms` SMs (`sm_partition`) where
    the torch build and driver have them, else a stream of the default, lowest priority (the engine's
    is the highest). Returns (stream, SMs it may use; 0 = all)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = sm_partition(sms, torch.cuda.get_device_properties(index).multi_processor_count)
    if n:
        if (index, n) not in _GREEN:
            try:
                from torch.cuda.green_contexts import GreenContext

                ctx = GreenContext.create(num_sms=n, device_id=index)
                _GREEN[(index, n)] = (ctx, ctx.Stream())  # the context must outlive its stream: kept for good
            except Exception as exc:  # noqa: BLE001 - any failure means: no partition here
                key = f"{type(exc).__name__}: {exc}"
                if key not in _GREEN_WARNED:
                    _GREEN_WARNED.add(key)
                    warnings.warn(f"tail_sms={sms}: no CUDA green context here ({key}); the trainer uses all "
                                  "SMs on a low-priority stream", stacklevel=2)  # fmt: skip
                _GREEN[(index, n)] = None
        if _GREEN[(index, n)] is not None:
            return _GREEN[(index, n)][1], n
    return torch.cuda.Stream(index), 0


class Pacer:
    """Keeps a loop's busy share at most `duty`: called after each step, it idles t * (1 - duty) / duty for a
    step of t seconds (since the last call or `mark`), ended early by `stop`. duty 1 never waits. `clock`
    reads seconds (tests give it a fake one)."""

    def __init__(self, duty: float, stop: threading.Event, clock=time.perf_counter):
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        self.duty, self.stop, self.clock = duty, stop, clock
        self.mark = clock()
        self.idle = 0.0

    def __call__(self, _metrics=None) -> None:
        now = self.clock()
        busy, self.mark = now - self.mark, now
        if self.duty < 1:
            pause = busy * (1 - self.duty) / self.duty
            self.stop.wait(pause)
            self.idle += pause
            self.mark = self.clock()


TAIL_SWITCH_INTERVAL_S = 1e-4  # beside a busy thread, a 1 ms step loop ran at 1.28 ms/step (5 ms: 6.2; CPU)


class TailTrainer:
    """Trains the drafter in a background thread while the engine's running batch is in its tail."""

    def __init__(self, engine, trainer, first_entry: int, capacity: int, fraction: float,
                 max_steps: int | None, poll_s: float = 0.01, rank: int = 0, sms: int = 0,
                 duty: float = 1.0, micro_tokens: int = 0) -> None:  # fmt: skip
        self.engine, self.trainer = engine, trainer
        self.micro_tokens = micro_tokens  # DrafterTrainer.train's: the stop waits for one micro-batch at most
        self.first_entry, self.threshold = first_entry, fraction * capacity
        self.max_steps, self.poll_s = max_steps, poll_s
        self.sms, self.stop = sms, threading.Event()
        self.pacer = Pacer(duty, self.stop)
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
        self.pacer.mark = self.pacer.clock()
        if device.type == "cuda":
            # its own stream: training kernels interleave with the engine's replays instead of queueing
            # behind them on the default stream; the buffer's tensors were written on the default stream
            stream, _ = trainer_stream(device, self.sms)
            stream.wait_stream(torch.cuda.default_stream(device))
            with torch.cuda.stream(stream):
                out = self.trainer.train(self.stop, self.max_steps, self.pacer, self.micro_tokens)
            stream.synchronize()
        else:
            out = self.trainer.train(self.stop, self.max_steps, self.pacer, self.micro_tokens)
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
