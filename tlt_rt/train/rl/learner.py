"""The policy learner: dense forward on padded (prompt + response) batches, the GRPO loss, an AdamW step.

Data parallel without a wrapper: every worker runs the same number of mini-batches, each worker's loss is
its share of the global sum (global token/response counts come with the mini-batch), gradients are summed
by `grad_sync` (an all-reduce) and every worker applies the same clipped AdamW step, so all workers hold
identical weights afterwards. The model is the rollout engine's own target: updating it in place is how
the engine gets the new policy (a sharded worker copies it into the engine instead, see train/sharded.py).

With `lockstep` (an FSDP-sharded model: every forward and backward is a collective) every rank runs the
same number of micro-batches: a rank with fewer samples runs zero-weighted dummy ones.

Low-precision weights (bf16 on GPU) are stepped through fp32 master copies: an lr of 1e-6 is below
bf16's resolution, so a direct bf16 AdamW step would drop most updates.

The samples, their padding and the cut into micro-batches are in learn_batch.py (re-exported here), the
warm-up's shapes in warm_up_shapes.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from tlt_rt.train.rl.config import RLConfig
from tlt_rt.train.rl.flops import update_flops
from tlt_rt.train.rl.grpo import policy_loss, token_logprobs
from tlt_rt.train.rl.learn_batch import LearnSample, MiniBatch, pad_batch, to_device
from tlt_rt.train.rl.learn_batch import count_chunks as _chunks
from tlt_rt.train.rl.learn_batch import token_chunks as _token_chunks
from tlt_rt.train.rl.logprobs import chunked_token_logprobs, kept_ids
from tlt_rt.train.rl.warm_up_shapes import SDPA_ALIGN
from tlt_rt.train.rl.warm_up_shapes import warm_up_shapes as _warm_up_shapes

# the loss's own statistics (grpo.LossStats), summed over micro-batches
LOSS_STATS = ("tokens", "clipped_low", "clipped_high", "ratio_sum", "kl_sum")
# the sums a worker's update adds up and the driver totals over workers
SUMMED = ("loss", *LOSS_STATS, "forward_tokens", "flops", "alloc_retries", "compiles")


@dataclass
class LearnResult:
    """One `learn` call on one worker: sums over its mini-batches, for the driver to total over workers."""

    loss: float = 0.0
    tokens: float = 0.0  # response tokens in the loss
    clipped_low: float = 0.0
    clipped_high: float = 0.0
    ratio_sum: float = 0.0  # exp(new - old log-prob) summed over tokens
    kl_sum: float = 0.0
    forward_tokens: float = 0.0  # prompt + response tokens through the forward and backward (no padding)
    flops: float = 0.0  # model FLOPs of the update (train/rl/flops.py)
    alloc_retries: float = 0.0  # times the CUDA allocator freed its cache to retry an allocation (slow, syncs)
    compiles: float = 0.0  # graphs torch.compile made during the update (a new shape of the compiled glue)
    grad_norm: float | None = None  # of the last optimizer step; None when the call had nothing to apply
    optimizer_steps: float = 0.0
    seconds: float = 0.0
    rank: int = 0
    version: int = 0  # the learner's version after the call
    peak_flops: float | None = None  # the device's bf16 peak, FLOP/s (None: CPU or unknown)
    peak_rollout_bytes: float | None = None  # GPU memory allocated at most during the step's rollout
    peak_learn_bytes: float | None = None  # and during this update
    reserved_rollout_bytes: float | None = None  # GPU memory the allocator held at most during the rollout
    reserved_learn_bytes: float | None = None  # and during this update (what the device must have free)

    def add(self, other: LearnResult) -> None:
        """Add `other`'s sums (SUMMED) to these."""
        for k in SUMMED:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class SamplingFilter:
    """The rollout's sampling distribution; the learner's log-probs must be taken under the same one."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @property
    def filtering(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    # named_parameters() already skips the tied lm_head, so each tensor is stepped once
    return [p for _, p in model.named_parameters() if p.requires_grad]


class Learner:
    """Owns the policy optimizer; `update` runs the mini-batches of one RL step."""

    def __init__(
        self,
        model: nn.Module,
        cfg: RLConfig,
        sampling: SamplingFilter,
        grad_sync: Callable[[list[Tensor]], None] | None = None,
        ref_model: nn.Module | None = None,
        pad_id: int = 0,
        lockstep: bool = False,
    ) -> None:
        self.model, self.cfg, self.sampling, self.lockstep = model, cfg, sampling, lockstep
        self.grad_sync, self.ref_model, self.pad_id = grad_sync, ref_model, pad_id
        self.params = unique_parameters(model)
        self.device = self.params[0].device
        # compiled layers on a GPU only (on a CPU inductor's compile takes longer than the updates it would speed
        # up) and not under FSDP, whose sharded layers gather and free their weights around each forward
        compile_layers = cfg.compile_layers and self.device.type == "cuda" and not lockstep
        if compile_layers:  # a graph compiled inside an update costs seconds: say which guard failed
            torch._logging.set_logs(recompiles=True)
        for m in model.modules():  # the policy and, under FSDP, the wrapped CausalLM inside it
            if hasattr(m, "checkpoint_layers"):
                m.checkpoint_layers = cfg.activation_checkpointing
            if hasattr(m, "compile_layers"):
                m.compile_layers = compile_layers
        self.master: list[nn.Parameter] | None = None
        if self.params[0].dtype != torch.float32:
            self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        stepped = self.master or self.params
        # one fused kernel per group of tensors on a GPU (the foreach path launches several per tensor list);
        # sharded (DTensor) parameters keep the default path
        fused = self.device.type == "cuda" and not any(isinstance(p, DTensor) for p in stepped)
        self.optimizer = torch.optim.AdamW(
            stepped, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), fused=fused or None
        )
        self.version = 0  # optimizer steps taken; identical on every worker after each step

    def warm_up(self, max_len: int = 0) -> int:
        """Forward and backward, with no update, of dummy micro-batches of the shapes the updates will meet
        (`_warm_up_shapes`): the graphs the compiled glue needs for training (gradients on) are made here, at
        start-up, and not inside the updates that first meet them (in RL runs on a GPU each such update took
        1-10 s longer). `max_len`: the longest sample (prompt + response tokens) the run can make, the model's
        context; 0: `rl.micro_batch_tokens` bounds it. Returns the graphs compiled. Lockstep (FSDP) learners
        skip it: their forward is a collective every rank must join in the same order."""
        if self.lockstep:
            return 0
        compiles0 = self._slow_events()[1]
        was_training = self.model.training
        self.model.train()
        # on a GPU, attention inside a compiled graph guards on whether the length is a multiple of 8 (its
        # kernels' alignment): each shape again at such a length, avoiding the hidden size (see _warm_up_shapes)
        align = SDPA_ALIGN if self.device.type == "cuda" else 0
        arch = getattr(self.model, "arch", None)
        avoid = (arch.hidden_size,) if arch is not None else ()
        try:
            for b, t in _warm_up_shapes(self.cfg.micro_batch_tokens, self.cfg.micro_batch, max_len, align, avoid):
                # t rows each; a one-token response: the head projects one row a sample, the glue sees them all
                chunk = [LearnSample([self.pad_id] * t, [self.pad_id], [0.0], 0.0)] * b
                ids, targets, _, _, rows = pad_batch(chunk, self.pad_id, self.device)
                (self._logprobs(self.model, ids, targets, rows).sum() * 0.0).backward()
                if self.cfg.recompute_logprobs:  # the same forward without gradients, before each update
                    with torch.no_grad():
                        self._logprobs(self.model, ids, targets, rows)
        finally:
            self.model.train(was_training)
            for p in self.params:
                p.grad = None
        return self._slow_events()[1] - compiles0

    # ----------------------------------------------------------------------------------- log-probs
    def _logprobs(self, model: nn.Module, ids: Tensor, targets: Tensor, rows: Tensor | None = None) -> Tensor:
        """[B, T] log-probs of `targets` under the sampling filter; with `rows` (the response positions,
        `pad_batch`'s last) and a chunk size, only those rows are projected through the head, a chunk of rows
        at a time (zeros elsewhere)."""
        chunk = self.cfg.logprob_chunk_tokens
        if rows is not None and chunk > 0:
            s = self.sampling

            def head(hidden: Tensor, weight: Tensor) -> Tensor:  # [B, T, H], [V, H] -> [B, T]
                picked = hidden.flatten(0, 1).index_select(0, rows)
                lp = chunked_token_logprobs(picked, weight, targets.flatten().index_select(0, rows), s.temperature,
                                            s.top_k, s.top_p, chunk_tokens=chunk)  # fmt: skip
                out = torch.zeros(targets.numel(), dtype=lp.dtype, device=lp.device).index_copy(0, rows, lp)
                return out.view(targets.shape)

            return model(ids, head=head).logits
        logits = model(ids).logits  # [B, T, V]
        s = self.sampling
        keep = kept_ids(logits, s.temperature, s.top_k, s.top_p)
        return token_logprobs(logits, targets, self.sampling.temperature, keep)

    @torch.no_grad()
    def recompute_logprobs(self, samples: list[LearnSample]) -> None:
        """Replace each sample's old log-probs with the dense forward's (the `rl.recompute_logprobs` path)."""
        for chunk in self._micro_batches(samples):
            ids, targets, _, _, rows = pad_batch(chunk or [self._dummy()], self.pad_id, self.device)
            lp = self._logprobs(self.model, ids, targets, rows)
            for i, s in enumerate(chunk):
                p = len(s.prompt)
                s.old_logprobs = lp[i, p - 1 : p - 1 + len(s.response)].tolist()

    # ------------------------------------------------------------------------------------- update
    def update(self, minibatches: list[MiniBatch]) -> LearnResult:
        """One optimizer step per mini-batch; returns sums (loss, clip counts, ...) for the driver to total."""
        t0 = time.perf_counter()
        retries0, compiles0 = self._slow_events()
        totals = LearnResult(grad_norm=0.0, version=self.version)
        was_training = self.model.training
        self.model.train()
        for p in self.params:  # a failed earlier attempt may have left partial sums
            p.grad = None
        # the loss and its stats summed on the device, read once at the end: a read per micro-batch would make
        # the host wait for each forward and backward before it queues the next
        sums = torch.zeros(1 + len(LOSS_STATS), dtype=torch.float64, device=self.device)
        try:
            for mb in minibatches:
                sums = self._accumulate(mb, totals, sums)
                totals.grad_norm = self._step()
                totals.optimizer_steps += 1
        finally:
            self.model.train(was_training)
        for k, v in zip(("loss", *LOSS_STATS), sums.tolist(), strict=True):
            setattr(totals, k, getattr(totals, k) + v)
        totals.seconds = time.perf_counter() - t0
        totals.version = self.version
        retries1, compiles1 = self._slow_events()
        totals.alloc_retries, totals.compiles = retries1 - retries0, compiles1 - compiles0
        return totals

    def _slow_events(self) -> tuple[int, int]:
        """(CUDA allocator retries, torch.compile graphs) so far: what can make one update much slower."""
        retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) if self.device.type == "cuda" else 0
        return retries, torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def _accumulate(self, mb: MiniBatch, totals: LearnResult, sums: torch.Tensor) -> torch.Tensor:
        """Forward and backward of `mb`'s micro-batches; returns `sums` plus their loss and LOSS_STATS."""
        for chunk in self._micro_batches(mb.samples):
            if not chunk:  # lockstep: join the collectives of the others' forward and backward
                ids, targets, _, _, _ = pad_batch([self._dummy()], self.pad_id, self.device)
                (self._logprobs(self.model, ids, targets).sum() * 0.0).backward()
                continue
            ids, targets, mask, old, rows = pad_batch(chunk, self.pad_id, self.device)
            adv = to_device(torch.tensor([s.advantage for s in chunk]), self.device)
            ref = None
            if self.ref_model is not None and self.cfg.kl_coef > 0:
                with torch.no_grad():
                    ref = self._logprobs(self.ref_model, ids, targets, rows)
            logp = self._logprobs(self.model, ids, targets, rows)
            cfg = self.cfg
            loss, st = policy_loss(
                logp, old, adv, mask, cfg.clip_low, cfg.clip_high, cfg.loss_agg, ref, cfg.kl_coef,
                num_tokens=mb.num_tokens, num_seqs=mb.num_seqs, host_stats=False,
            )  # fmt: skip
            loss.backward()
            sums = sums + torch.stack([loss.detach().double(), *(getattr(st, k) for k in LOSS_STATS)])
            lengths = [len(x.prompt) + len(x.response) - 1 for x in chunk]
            totals.forward_tokens += sum(lengths)
            arch = getattr(self.model, "arch", None)
            if arch is not None:
                totals.flops += update_flops(arch, lengths, sum(len(x.response) for x in chunk))
        return sums

    def _micro_batches(self, samples: list[LearnSample]) -> list[list[LearnSample]]:
        """This rank's micro-batches; in lockstep padded with empty ones to the most any rank has."""
        budget = self.cfg.micro_batch_tokens
        chunks = _token_chunks(samples, budget) if budget else _chunks(samples, self.cfg.micro_batch)
        if self.lockstep and dist.is_initialized():
            n = torch.tensor([len(chunks)], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            chunks += [[] for _ in range(int(n.item()) - len(chunks))]
        return chunks

    def _dummy(self) -> LearnSample:
        return LearnSample([self.pad_id], [self.pad_id], [0.0], 0.0)

    def _step(self) -> float:
        for p in self.params:
            if p.grad is None:  # a worker with no samples still joins the all-reduce
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if self.grad_sync is not None:
            self.grad_sync(grads)
        targets = self.params
        if self.master is not None:
            for m, p in zip(self.master, self.params, strict=True):
                m.grad = p.grad.float()
            targets = self.master
        if self.cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(targets, self.cfg.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if isinstance(norm, DTensor):  # FSDP parameters: the norm is itself sharded
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params, strict=True):
                    p.copy_(m)
        self.version += 1
        return float(norm)

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "version": self.version}
        if self.master is not None:
            state["master"] = [m.detach().cpu() for m in self.master]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        if self.master is not None and "master" in state:
            with torch.no_grad():
                for m, saved in zip(self.master, state["master"], strict=True):
                    m.copy_(saved)
