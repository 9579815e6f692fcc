"""Online drafter training on a worker that the rollout's long tail left idle: preemptible and checkpointed.

One optimizer step = `grad_accum` micro-steps, each one packed batch of `batch_tokens` tokens from the
buffer. `train(stop)` checks `stop` before every micro-step; a step interrupted that way is undone: its
partial gradient is dropped and the buffer cursor and noise generator go back to where the step began,
so the data it had drawn is trained on later and a resumed run repeats exactly what an uninterrupted
one would have done. With `micro_tokens` (the tail trainer's) a stop after some micro-batches applies the
step on those instead (`train`). AdamW state lives across `step()` / `train()` calls; the learning rate follows
`lr_schedule` by the step count (`scheduled_lr`), so a resumed trainer goes on where the schedule was.
On CUDA the forward runs under bf16 autocast by default (the drafter's weights and AdamW state stay in
their own dtype, fp32 usually).

Checkpoints (train/drafter/checkpoint.py): the drafter's weights, the optimizer state, the step count, the
buffer cursor and the noise generator; `save_checkpoint(async_=True)` writes in the background and `wait()`
joins it. The buffer itself is not saved: a resumed trainer expects the same samples re-added, then the cursor.
The buffer is not thread-safe: add data between `train()` calls, not during one.

Reduced draft vocabulary (`draft_vocab` = size > 0): before a step, whenever the buffer's contents changed
(new rollouts, evicted old ones), the vocabulary is rebuilt from the buffer's token counts (the rollouts of
its last steps, so it follows the policy) plus the target's EOS ids, and set on the drafter
(`tlt_rt.train.drafter.vocab`). The drafter's trained weights do not depend on it; its head rows do. It
changes only this trainer's drafter: a serving copy adopts it through `load_state_dict` (between rollouts),
and with several workers each keeps the vocabulary of its own buffer (replicas average float tensors only).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import FEATURE_LAYERS_KEY
from tlt_rt.train.drafter.checkpoint import CheckpointWriter, read_checkpoint
from tlt_rt.train.drafter.config import DrafterConfig
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.loss import batch_loss
from tlt_rt.train.drafter.schedule import scheduled_lr
from tlt_rt.train.drafter.vocab import DraftVocab

StopFlag = threading.Event | Callable[[], bool]
METRICS = ("loss", "hidden_loss", "token_loss", "top1")  # a step's token-weighted means
# cuDNN attention re-plans for every new sequence shape (~75 ms of host time a call on an H100 with torch
# 2.11) and packed batches change shape every step: training uses flash / mem-efficient / math only
TRAIN_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# the trainer's own keyword names for DrafterConfig fields (kept: benchmarks and tests use them)
ALIASES = {
    "hidden_weight": "hidden_loss_weight",
    "token_weight": "token_loss_weight",
    "temperature": "loss_temperature",
    "sampled_weight": "sampled_token_weight",
}


class DrafterTrainer:
    def __init__(
        self,
        drafter: Drafter,
        buffer: DrafterBuffer,
        config: DrafterConfig | None = None,
        *,
        seed: int = 0,
        checkpoint_dir: str | Path | None = None,
        autocast: bool | None = None,
        **overrides,
    ):
        """Built from `config` (train/drafter/config.py declares every setting and its default); keyword
        `overrides` replace single fields, by their DrafterConfig names or the ALIASES. Checkpoints are
        written every `config.checkpoint_every` steps only when `checkpoint_dir` is given."""
        base = config if config is not None else DrafterConfig()
        self.config = cfg = dataclasses.replace(base, **{ALIASES.get(k, k): v for k, v in overrides.items()})
        lr, batch_tokens, grad_accum, packed = cfg.lr, cfg.batch_tokens, cfg.grad_accum, cfg.packed
        hidden_weight, token_weight, noise_std = cfg.hidden_loss_weight, cfg.token_loss_weight, cfg.noise_std
        unroll, unroll_context, draft_vocab = cfg.unroll, cfg.unroll_context, cfg.draft_vocab
        temperature, sampled_weight = cfg.loss_temperature, cfg.sampled_token_weight
        weight_decay, betas, max_grad_norm = cfg.weight_decay, tuple(cfg.betas), cfg.max_grad_norm
        checkpoint_every = cfg.checkpoint_every if checkpoint_dir is not None else 0
        self.temperature, self.sampled_weight, self.unroll_context = temperature, sampled_weight, unroll_context
        v = drafter.target.arch.vocab_size
        self.vocab = DraftVocab(v, min(draft_vocab, v), keep=drafter.target.arch.eos_token_ids) if draft_vocab else None
        self._vocab_key: tuple | None = None
        self.drafter, self.buffer = drafter, buffer
        self.batch_tokens, self.grad_accum, self.packed = batch_tokens, grad_accum, packed
        self.hidden_weight, self.token_weight, self.noise_std = hidden_weight, token_weight, noise_std
        self.max_grad_norm, self.unroll = max_grad_norm, unroll
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.device = drafter.fc.weight.device
        # bf16 compute over fp32 master weights on CUDA by default (tensor cores, fused attention kernels)
        self.autocast = self.device.type == "cuda" if autocast is None else autocast
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, betas=betas, weight_decay=weight_decay, fused=self.device.type == "cuda"
        )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.steps = 0
        self._writer = CheckpointWriter()

    @classmethod
    def from_config(cls, drafter: Drafter, buffer: DrafterBuffer, cfg: DrafterConfig, **kwargs) -> DrafterTrainer:
        """The same as `DrafterTrainer(drafter, buffer, cfg, **kwargs)`."""
        return cls(drafter, buffer, cfg, **kwargs)

    def refresh_vocab(self) -> bool:
        """Rebuild the reduced draft vocabulary when the buffer's contents changed; True when it was set."""
        if self.vocab is None or self.buffer.num_tokens == 0:
            return False
        key = (tuple(self.buffer.steps), self.buffer.num_samples, self.buffer.num_tokens)
        if key == self._vocab_key:
            return False
        self._vocab_key = key
        d2t = self.vocab.build(self.buffer.token_counts(self.vocab.vocab_size))
        self.drafter.set_draft_vocab(d2t)
        return True

    # -- training --
    def step(self) -> dict[str, float]:
        """One optimizer step on `grad_accum` packed batches; returns its metrics."""
        out = self._step(lambda: False)
        assert out is not None
        return out

    def train(
        self,
        stop: StopFlag,
        max_steps: int | None = None,
        after_step: Callable[[dict], None] | None = None,
        micro_tokens: int = 0,
    ) -> dict[str, float]:
        """Optimizer steps until `stop` is set (checked between micro-steps) or `max_steps` are done;
        `after_step(metrics)` runs after each step (a pacer, progress).

        `micro_tokens` > 0 (below `batch_tokens`) draws each step's tokens as micro-batches of that size and
        makes a stop keep the micro-batches done: the step is applied on them (its gradient the mean over
        their tokens) and the data they drew is consumed. The caller waits at most one micro-batch for the
        stop, where an undone step would make it wait for a whole step or throw the step's work away; the
        run no longer repeats an uninterrupted one exactly. The tail trainer trains this way: its stop is
        the end of the rollout, which waits for it."""
        should_stop = stop.is_set if isinstance(stop, threading.Event) else stop
        done, tokens, t0, stopped = 0, 0, time.perf_counter(), False
        sums = dict.fromkeys(METRICS, 0.0)
        last: dict[str, float] = {}
        while max_steps is None or done < max_steps:
            m = self._step(should_stop, micro_tokens)
            if m is None:
                stopped = True
                break
            done, tokens, last = done + 1, tokens + int(m["tokens"]), m
            for k in sums:
                sums[k] += m[k] * m["tokens"]
            if after_step is not None:
                after_step(m)
            if m["partial"]:  # stopped after some of its micro-batches: they were applied, nothing more
                stopped = True
                break
        elapsed = time.perf_counter() - t0
        summary = {k: v / max(tokens, 1) for k, v in sums.items()}
        summary.update(
            steps=done,
            stopped=float(stopped),
            tokens=tokens,
            tokens_per_s=tokens / max(elapsed, 1e-9),
            step=self.steps,
            last_loss=last.get("loss", float("nan")),
        )
        return summary

    def _step(self, should_stop: Callable[[], bool], micro_tokens: int = 0) -> dict[str, float] | None:
        self.refresh_vocab()
        cursor, rng = self.buffer.state_dict(), self.generator.get_state()
        t0 = time.perf_counter()
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        lazy = 0 < micro_tokens < self.batch_tokens
        if lazy:  # micro-batches drawn one at a time, each weighted by its tokens over the step's nominal size
            size, count = micro_tokens, self.grad_accum * -(-self.batch_tokens // micro_tokens)
            batches, total = [None] * count, self.grad_accum * self.batch_tokens
        else:
            size, batches, total = self.batch_tokens, [], 0
            for _ in range(self.grad_accum):
                batches.append(self.buffer.next_batch(size, self.packed).to(self.device))
                total += batches[-1].num_tokens
        sums = None  # the step's metrics on the device, read once at its end: no host sync inside a step
        done = 0  # tokens of the micro-batches run
        partial = False
        for b in batches:
            if should_stop():
                if lazy and done > 0:  # keep what was done: the step on those micro-batches alone
                    partial = True
                    break
                # undo the whole step: no partial update, no data skipped
                self.optimizer.zero_grad(set_to_none=True)
                self.buffer.load_state_dict(cursor)
                self.generator.set_state(rng)
                return None
            if b is None:
                b = self.buffer.next_batch(size, self.packed).to(self.device)
            with sdpa_kernel(TRAIN_SDPA_BACKENDS):
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    out = batch_loss(
                        self.drafter,
                        b,
                        self.hidden_weight,
                        self.token_weight,
                        self.noise_std,
                        self.generator,
                        self.unroll,
                        temperature=self.temperature,
                        sampled_weight=self.sampled_weight,
                        unroll_context=self.unroll_context,
                    )
                share = out.num_tokens / max(total, 1)
                (out.loss * share).backward()
            part = torch.stack([getattr(out, k).detach().float() for k in METRICS]) * share
            sums = part if sums is None else sums + part
            done += out.num_tokens
        if lazy and 0 < done != total:  # the shares summed to done / total: make the step a mean over its tokens
            scale = total / done
            for p in self.drafter.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            sums = sums * scale
            total = done
        norm = None
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.max_grad_norm)
        lr = scheduled_lr(self.config, self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.device.type == "cuda":  # its own stream only: never wait for the engine's steps beside it
            torch.cuda.current_stream(self.device).synchronize()
        values = torch.cat([sums, norm.reshape(1).to(sums)]) if norm is not None else sums
        values = values.tolist()
        grad_norm = values[len(METRICS)] if norm is not None else float("nan")
        elapsed = time.perf_counter() - t0
        metrics = {
            **dict(zip(METRICS, values[: len(METRICS)], strict=True)),
            "tokens": float(total),
            "tokens_per_s": total / max(elapsed, 1e-9),
            "partial": float(partial),
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "step": float(self.steps),
        }
        if self.checkpoint_dir is not None and self.checkpoint_every > 0 and self.steps % self.checkpoint_every == 0:
            self.save_checkpoint(self.checkpoint_dir, async_=True)
        return metrics

    # -- checkpoints --
    def save_checkpoint(self, folder: str | Path, async_: bool = True) -> None:
        """Write weights, optimizer state and cursor to `folder` (replaced whole); in the background if async_."""
        meta = {"steps": self.steps, "buffer": self.buffer.state_dict(), "rng": self.generator.get_state().clone()}
        info = {
            "steps": self.steps,
            "arch": self.drafter.arch.to_hf(),
            "draft_vocab_size": self.drafter.draft_vocab_size,
        }
        if self.drafter.feature_layers:
            info[FEATURE_LAYERS_KEY] = list(self.drafter.feature_layers)
        self._writer.save(Path(folder), self.drafter.state_dict(), self.optimizer.state_dict(), meta, info, async_)

    def wait(self) -> None:
        """Block until a background checkpoint write finishes; re-raise its error, if any."""
        self._writer.wait()

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore weights, optimizer state, step count, buffer cursor and noise generator from `folder`."""
        self.wait()
        weights, optimizer, meta = read_checkpoint(Path(folder))
        self.drafter.set_draft_vocab(weights.get("d2t"))
        self.drafter.load_state_dict(weights, strict=True)
        self.optimizer.load_state_dict(optimizer)
        self.steps = int(meta["steps"])
        self.buffer.load_state_dict(meta["buffer"])
        self.generator.set_state(meta["rng"])
