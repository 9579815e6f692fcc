"""A worker's drafter: the copy the engine drafts with, the fp32 replica that trains beside it, and the run's
starting copy kept for `logging.drafter_curve`.

The replica trains on its own copy (the engine may be drafting with the serving one meanwhile); merged
replicas are copied into the serving drafter before the next rollout. Every copy reads the target's
embedding, final norm and LM head (`heads`), so a reduced head is re-sliced after each policy update.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import load_eagle
from tlt_rt.train.cluster.comm import all_reduce_sum, busiest_rank
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.eval import frozen_copy
from tlt_rt.train.drafter.tail import DrafterTraining
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.vocab import DraftVocab


def serving_drafters(cfg: TLTConfig, heads, device: torch.device, dtype: torch.dtype,
                     rank: int) -> tuple[Drafter, Drafter | None]:  # fmt: skip
    """The drafter the engine drafts with (`drafter.path`, else a fresh one in the target's dtype), its draft
    vocabulary sized before the engine captures, and a frozen copy of it for `logging.drafter_curve` (None
    when the curve is off), taken before any checkpoint loads."""
    if cfg.drafter.path:
        serving = load_eagle(cfg.drafter.path, heads)
    else:
        serving = Drafter(heads.arch, heads, feature_layers=cfg.drafter.feature_layers).to(device, dtype)
    serving = serving.eval()
    _size_draft_vocab(cfg, serving, rank)
    curve = cfg.logging.drafter_curve and cfg.rollout.speculative != "off"
    return serving, frozen_copy(serving) if curve else None


def _size_draft_vocab(cfg: TLTConfig, serving: Drafter, rank: int) -> None:
    """Give the serving drafter a reduced head of `drafter.draft_vocab` ids before the engine captures its
    steps: each vocabulary the trainer rebuilds is then copied into the captured tensors in place. A head of
    another size (a drafter saved without a token map, or with one of another size) would leave the captured
    steps drafting over the old one. Until the first rollout's counts, the placeholder is the end-of-sequence
    ids and the lowest ids."""
    n = min(cfg.drafter.draft_vocab, serving.arch.vocab_size)
    if n <= 0 or cfg.rollout.speculative == "off" or serving.draft_vocab_size == n:
        return
    if serving.d2t is not None:
        print(f"worker {rank}: the drafter's {serving.draft_vocab_size}-id head is resized to "
              f"drafter.draft_vocab={n} ids", flush=True)  # fmt: skip
    serving.set_draft_vocab(DraftVocab(serving.arch.vocab_size, n, keep=serving.arch.eos_token_ids).build())


class DrafterRole:
    """Owns the serving drafter, the trained replica with its buffer and trainer, the frozen starting copy,
    and the stop events of spot training (a stop may arrive before the training call it stops)."""

    def __init__(self, serving: Drafter, frozen: Drafter | None, heads, cfg: TLTConfig, rank: int,
                 device: torch.device) -> None:  # fmt: skip
        self.serving, self.frozen, self.heads = serving, frozen, heads
        self.cfg, self.rank = cfg, rank
        # the trained replica is fp32: AdamW steps of 1e-4-sized updates vanish in bf16
        self.replica = Drafter(serving.arch, heads, feature_layers=serving.feature_layers)
        self.replica = self.replica.to(device, torch.float32)
        self.replica.set_draft_vocab(serving.d2t)
        self.replica.load_state_dict(serving.state_dict())
        d = cfg.drafter
        self.buffer = DrafterBuffer(max_steps=d.buffer_steps, seed=cfg.rl.seed * 1009 + rank)
        self.trainer = DrafterTrainer.from_config(self.replica, self.buffer, d, seed=cfg.rl.seed * 1009 + rank)
        self._stops: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------- training
    def _stop_event(self, epoch: int) -> threading.Event:
        with self._lock:
            return self._stops.setdefault(epoch, threading.Event())

    def train(self, epoch: int) -> DrafterTraining:
        """Train the replica until `stop(epoch)`."""
        stop = self._stop_event(epoch)
        start = time.time()
        if self.buffer.num_tokens == 0 or stop.is_set():
            return DrafterTraining(self.rank, "idle", 0, start, start)
        out = self.trainer.train(stop, max_steps=self.cfg.drafter.max_spot_steps or None)
        return DrafterTraining(self.rank, "idle", int(out["steps"]), start, time.time(), out["loss"], out["top1"])

    def stop(self, epoch: int) -> None:
        self._stop_event(epoch).set()
        with self._lock:
            for old in [e for e in self._stops if e < epoch - 1]:
                del self._stops[old]

    @torch.no_grad()
    def merge(self, my_steps: int, total_steps: int, world_size: int) -> None:
        """Average the replicas over the workers that trained, weighted by their steps; push to the serving copy.

        Collective: every worker calls it. Optimizer moments stay per worker (local-SGD style). The reduced draft
        vocabulary is not averaged: each trainer rebuilds it from its own buffer, and every worker takes the one
        of the replica that trained most. The ranks of a tensor-parallel engine must draft alike: with rank 0's
        vocabulary rebuilt from its answers and its peers' left as they were (peers collect no answers), the ranks
        drafted over different ids, so their trees, accepted lengths and schedules could part; a TP=2 run on
        Qwen2.5-Coder-1.5B hung, as engines out of lockstep do, in the first rollout after its drafter trained.
        """
        if world_size > 1 and total_steps > 0:
            tensors = [t for t in self.replica.state_dict().values() if t.is_floating_point()]
            # scaled copies: if a peer dies mid-reduce, this replica is still whole
            shares = [t * (my_steps / total_steps) for t in tensors]
            all_reduce_sum(shares)
            for t, s in zip(tensors, shares, strict=True):
                t.copy_(s)
            if self.replica.d2t is not None:
                d2t = self.replica.d2t.clone()
                dist.broadcast(d2t, src=busiest_rank(my_steps, d2t.device))
                self.replica.set_draft_vocab(d2t)
        if total_steps > 0:
            self.push()

    # ----------------------------------------------------------------------------------- serving
    @torch.no_grad()
    def push(self) -> None:
        """Copy the replica into the serving drafter (the engine's captured steps read its tensors in place)."""
        self.serving.load_state_dict(self.replica.state_dict())
        for d in (self.replica, self.serving):
            if d.d2t is not None:
                d.refresh_head()

    def refresh_heads(self) -> None:
        """Re-slice every reduced head after a policy update: it is a copy of the policy's rows."""
        for d in (self.replica, self.serving, self.frozen):
            if d is not None and d.d2t is not None:
                d.refresh_head()

    # ---------------------------------------------------------------------------- state transfer
    def export_state(self) -> dict:
        return {
            "drafter": {k: v.detach().cpu().clone() for k, v in self.replica.state_dict().items()},
            "drafter_optimizer": self.trainer.optimizer.state_dict(),
        }

    @torch.no_grad()
    def import_state(self, state: dict) -> None:
        self.replica.load_state_dict(state["drafter"])
        self.trainer.optimizer.load_state_dict(state["drafter_optimizer"])
        self.push()

    def save_checkpoint(self, folder: Path) -> None:
        """Rank 0 writes its replica and optimizer state; the other ranks' are not kept."""
        if self.rank == 0:
            self.trainer.save_checkpoint(folder / "drafter", async_=False)

    def load_checkpoint(self, folder: Path) -> None:
        with warnings.catch_warnings():  # the buffer starts empty after a restart; its cursor is moot
            warnings.simplefilter("ignore")
            self.trainer.load_checkpoint(folder / "drafter")
        self.push()
