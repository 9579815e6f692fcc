"""Spot drafter training for an AsyncEngine served to another framework (verl).

The rollout's finished samples bring their target hidden states (`AsyncEngine(collect_hidden=True,
on_sample=spot.collect)`); when no request is left the engine thread runs `spot.train_while_idle(stop)`
(`on_idle`), which trains a float32 replica of the serving drafter until a new request (or a weight update,
sleep, shutdown) sets `stop`, then copies it into the serving drafter (between steps: the engine thread is
the one training). It is the worker's recipe (`train/worker.py`): same buffer, same trainer, same push.
"""

from __future__ import annotations

import threading
import time

import torch

from tlt_rt.models.drafter import Drafter
from tlt_rt.rollout.engine import Engine
from tlt_rt.rollout.params import Completion
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.trainer import DrafterTrainer


class SpotDrafter:
    def __init__(self, engine: Engine, buffer_steps: int = 4, min_tokens: int = 256, max_steps: int | None = None,
                 seed: int = 0, **trainer_kwargs):  # fmt: skip
        if engine.drafter_runner is None:
            raise ValueError("drafter training needs speculation on: set engine_kwargs.tlt_rt.speculative")
        self.serving: Drafter = engine.drafter_runner.drafter
        self.drafter = Drafter(self.serving.arch, self.serving.target, feature_layers=self.serving.feature_layers)
        self.drafter = self.drafter.to(engine.device, torch.float32)
        self.drafter.set_draft_vocab(self.serving.d2t)
        self.drafter.load_state_dict(self.serving.state_dict())
        self.buffer = DrafterBuffer(max_steps=buffer_steps, seed=seed)
        self.trainer = DrafterTrainer(self.drafter, self.buffer, seed=seed, **trainer_kwargs)
        self.min_tokens, self.max_steps = min_tokens, max_steps
        self._ids: list[torch.Tensor] = []
        self._hidden: list[torch.Tensor] = []
        self._round = 0
        self.trained_steps, self.trained_seconds = 0, 0.0

    def collect(self, prompt: list[int], completion: Completion) -> None:
        """Keep one finished sample: hidden has a row per position the target ran (all tokens but the last)."""
        if completion.hidden is None or not completion.token_ids:
            return
        self._ids.append(torch.tensor(prompt + completion.token_ids[:-1]))
        self._hidden.append(completion.hidden.detach())

    def train_while_idle(self, stop: threading.Event) -> None:
        if self._ids:  # the samples since the last idle spell are one buffer step
            self._round += 1
            self.buffer.add(self._round, self._ids, self._hidden)
            self._ids, self._hidden = [], []
        if self.buffer.num_tokens < self.min_tokens or stop.is_set():
            return
        t0 = time.perf_counter()
        out = self.trainer.train(stop, max_steps=self.max_steps)
        self.trained_seconds += time.perf_counter() - t0
        if out["steps"] > 0:
            self.trained_steps += int(out["steps"])
            with torch.no_grad():
                self.serving.load_state_dict(self.drafter.state_dict())
                for d in (self.drafter, self.serving):
                    if d.d2t is not None:
                        d.refresh_head()

    def stats(self) -> dict:
        return {"steps": self.trained_steps, "seconds": self.trained_seconds, "buffer_tokens": self.buffer.num_tokens}
