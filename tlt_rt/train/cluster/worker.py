"""A rollout worker (one Ray actor per worker: a process on CPU, one per GPU): its engine, its share of
the data-parallel learner, and a drafter replica with its trainer.

The engine and the learner hold the same model object, so an optimizer step is the engine's new policy.
Gradients are all-reduced through a torch.distributed group made inside the actors (gloo on CPU, NCCL on
GPU; the collectives live in comm.py), so every worker holds identical weights after an update without a round
trip through the driver.
The drafter trains on a separate replica (the engine may be drafting with its own copy meanwhile); merged
replicas are copied into the engine's drafter before the next rollout.

Methods run on a small thread pool (the actor's max_concurrency), so `stop_drafter` can preempt a
running `train_drafter`, and `export_state` can copy weights out while the engine generates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tlt_rt.config_loader import from_dict
from tlt_rt.ir.strategy import Strategy
from tlt_rt.models import load_target, save_target
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.eagle_export import load_eagle
from tlt_rt.models.loader import resolve_model_path
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.cluster.comm import all_reduce_sum, node_address_and_port
from tlt_rt.train.cluster.results import RolloutResult, Sample
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.eval import drafter_counts_by_shape, frozen_copy, oracle_counts_by_shape
from tlt_rt.train.drafter.tail import DrafterTraining, TailTrainer, tail_training_on
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.vocab import DraftVocab
from tlt_rt.train.profile import profiled
from tlt_rt.train.rl.checkpoint import load_pt, rng_state, set_rng_state
from tlt_rt.train.rl.flops import peak_flops
from tlt_rt.train.rl.learner import Learner, LearnResult, MiniBatch, SamplingFilter
from tlt_rt.train.rl.metrics import stats_delta
from tlt_rt.train.rl.sd_explain import explain_policy

TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template",
                   "generation_config")  # fmt: skip


def copy_tokenizer_files(model_path: str | None, folder: Path) -> None:
    """Tokenizer and chat template files travel as they are (loading a tokenizer costs seconds)."""
    for f in resolve_model_path(model_path).iterdir():
        if f.is_file() and f.name.startswith(TOKENIZER_FILES):
            shutil.copy2(f, folder / f.name)


class Worker:
    def __init__(self, rank: int, world_size: int, cfg: dict, run_dir: str, policy_path: str | None = None) -> None:
        self.cfg: TLTConfig = from_dict(TLTConfig, cfg)
        self.rank, self.world_size, self.run_dir = rank, world_size, Path(run_dir)
        c = self.cfg
        gpu = c.cluster.gpus_per_worker > 0
        self.device = torch.device("cuda" if gpu else "cpu")
        if not gpu:
            torch.set_num_threads(c.cluster.cpus_per_worker)
        # the same seed on every worker: drafter replicas must start equal to be averaged
        torch.manual_seed(c.rl.seed)
        self.model = load_target(policy_path or c.model.path, dtype=c.model.dtype, device=self.device)
        dtype = self.model.lm_head.weight.dtype
        heads = self._drafter_target()  # what the drafters take embedding, final norm and LM head from
        self.heads = heads
        if c.drafter.path:
            serving = load_eagle(c.drafter.path, heads)
        else:
            serving = Drafter(heads.arch, heads, feature_layers=c.drafter.feature_layers).to(self.device, dtype)
        self.serving_drafter = serving.eval()
        self._size_draft_vocab(serving)
        # the drafter the run started from, kept as it is for logging.drafter_curve (before any checkpoint loads)
        curve = c.logging.drafter_curve and c.rollout.speculative != "off"
        self.frozen_drafter = frozen_copy(serving) if curve else None
        self.engine = self._make_engine()  # None for a sharded worker: it builds its engine in form_group
        if self.engine is not None and self.device.type == "cuda":
            self.engine.capture()  # every graph now: no capture later beside a spot-training thread
        # the trained replica is fp32: AdamW steps of 1e-4-sized updates vanish in bf16
        self.drafter = Drafter(serving.arch, heads, feature_layers=serving.feature_layers)
        self.drafter = self.drafter.to(self.device, torch.float32)
        self.drafter.set_draft_vocab(serving.d2t)
        self.drafter.load_state_dict(serving.state_dict())
        self.buffer = DrafterBuffer(max_steps=c.drafter.buffer_steps, seed=c.rl.seed * 1009 + rank)
        self.trainer = DrafterTrainer.from_config(self.drafter, self.buffer, c.drafter, seed=c.rl.seed * 1009 + rank)
        ref = None
        if c.rl.kl_coef > 0:  # the reference policy is the run's starting model, frozen
            ref = load_target(c.model.path, dtype=c.model.dtype, device=self.device).requires_grad_(False)
        r = c.rollout
        self.sampling = sampling = SamplingFilter(r.temperature, r.top_k, r.top_p)
        sync = all_reduce_sum if world_size > 1 else None
        self.learner = Learner(self.model, c.rl, sampling, sync, ref)
        # the learner's compiled graphs now, not in the first updates; a sharded worker's learner model has no
        # compiled glue (its engine, built later, holds a copy), so nothing to warm up there
        if self.device.type == "cuda" and self.engine is not None:
            with self._engine_released():  # the warm-up's largest micro-batch needs what an update needs
                self.learner.warm_up(max_len=c.model.max_context)
        self.collects = True  # keeps (token, hidden) rows for the drafter and may train it in the tail
        self._answers: dict[str, list[dict]] = {}  # the last rollout's answers, per reader (read once)
        self._rollout_peak: float | None = None  # GPU bytes allocated at most in the last rollout
        self._rollout_reserved: float | None = None  # and held by the allocator
        self._stops: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def _size_draft_vocab(self, serving) -> None:
        """Give the serving drafter a reduced head of `drafter.draft_vocab` ids before the engine captures its
        steps: each vocabulary the trainer rebuilds is then copied into the captured tensors in place. A
        head of another size (a drafter saved without a token map, or with one of another size) would leave
        the captured steps drafting over the old one. Until the first rollout's counts, the placeholder is
        the end-of-sequence ids and the lowest ids."""
        n = min(self.cfg.drafter.draft_vocab, serving.arch.vocab_size)
        if n <= 0 or self.cfg.rollout.speculative == "off" or serving.draft_vocab_size == n:
            return
        if serving.d2t is not None:
            print(f"worker {self.rank}: the drafter's {serving.draft_vocab_size}-id head is resized to "
                  f"drafter.draft_vocab={n} ids", flush=True)  # fmt: skip
        serving.set_draft_vocab(DraftVocab(serving.arch.vocab_size, n, keep=serving.arch.eos_token_ids).build())

    def _drafter_target(self):
        return self.model

    def _make_engine(self):
        return Engine(self.model, **self.engine_options())

    def engine_options(self) -> dict:
        c, r = self.cfg, self.cfg.rollout
        drafter = self.serving_drafter if r.speculative != "off" else None
        return dict(drafter=drafter, config=r.engine(), max_context=c.model.max_context)

    # ----------------------------------------------------------------------------- process group
    def ping(self) -> int:
        return self.rank

    def group_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        return node_address_and_port()

    def form_group(self, addr: str, port: int, world_size: int) -> None:
        """(Re)create the gradient group; called on every worker at once, e.g. after a worker was replaced."""
        self.world_size = world_size
        if dist.is_initialized():
            dist.destroy_process_group()
        if world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=world_size,
            timeout=timedelta(seconds=self.cfg.cluster.collective_timeout_s),
        )  # fmt: skip
        self.learner.grad_sync = all_reduce_sum

    # ----------------------------------------------------------------------------------- rollout
    def _maybe_fail(self, phase: str, step: int) -> None:
        """The `cluster.debug_fail` testing aid: exit this process once at PHASE:RANK:STEP."""
        spec = self.cfg.cluster.debug_fail
        if spec is None or spec != f"{phase}:{self.rank}:{step}":
            return
        marker = self.run_dir / f".debug_fail.{phase}.{self.rank}.{step}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("failed once\n")
        os._exit(1)

    def rollout(self, step: int, prompts: list[list[int]], params: dict) -> RolloutResult:
        """Generate this worker's share; store (tokens, hidden) for the drafter; return tokens and timings."""
        self._maybe_fail("rollout", step)
        start = time.time()
        n0, before = len(self.engine.timeline), self.engine.stats()
        online = self.cfg.drafter.train_online and self.collects
        tail = None
        n_seqs = len(prompts) * params["n"]
        capacity = min(n_seqs, self.engine.max_batch)  # the batch the engine runs before its tail
        if online and prompts and tail_training_on(self.cfg) and self.buffer.num_tokens > 0:
            d = self.cfg.drafter
            tail = TailTrainer(
                self.engine, self.trainer, n0, capacity, d.tail_fraction, d.max_spot_steps or None, rank=self.rank,
                sms=d.tail_sms, duty=d.tail_duty, micro_tokens=d.tail_micro_tokens,
            )  # fmt: skip
            tail.start()
        outs = []
        try:
            if prompts:
                outs = self.engine.generate(prompts, SamplingParams(**params, return_hidden=online))
        finally:
            tail_stats = tail.finish() if tail is not None else None
        end = time.time()
        if self.device.type == "cuda":  # since the last update (or the start): this rollout's phase
            self._rollout_peak = float(torch.cuda.max_memory_allocated(self.device))
            self._rollout_reserved = float(torch.cuda.max_memory_reserved(self.device))
        timeline = self.engine.timeline[n0:]
        del self.engine.timeline[:]  # read once per rollout: a long run must not accumulate it
        if online and outs:
            # hidden has one row per position the target processed: the prompt and every token but the last
            ids = [torch.tensor(prompts[o.prompt_index] + o.token_ids[:-1]) for o in outs]
            self.buffer.add(step, ids, [o.hidden for o in outs])
            readers = [name for name, on in (("ceiling", self.cfg.logging.accept_ceiling),
                                             ("curve", self.frozen_drafter is not None)) if on]  # fmt: skip
            answers = [dict(ids=i, hidden=o.hidden, prompt_len=len(prompts[o.prompt_index]))
                       for i, o in zip(ids, outs, strict=True)] if readers else []  # fmt: skip
            self._answers = dict.fromkeys(readers, answers)
        if tail_stats is not None:
            self._push_drafter()
        samples = [Sample(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason) for o in outs]
        stats = stats_delta(self.engine.stats(), before)
        sd_policy = explain_policy(getattr(self.engine, "policy", None), timeline)
        return RolloutResult(self.rank, samples, timeline, stats, sd_policy, start, end, n_seqs, capacity, tail_stats)

    @torch.no_grad()
    def accept_ceiling(self) -> dict[str, tuple[int, int]]:
        """Per strategy, (tokens, steps) a perfect drafter would give on the last rollout's answers
        (`oracle_counts_by_shape`: each step accepts the sampled tokens while they lie in the target's top-k,
        at most `depth` of them); {} when that rollout kept no hidden states. Called after the step, outside its
        timing."""
        answers = self._answers.pop("ceiling", [])
        if not answers:
            return {}
        return oracle_counts_by_shape(self.heads, answers, self.cfg.rollout.temperature, self._shapes())

    @torch.no_grad()
    def drafter_curve(self, n_answers: int | None) -> dict[str, dict[str, tuple[int, int]]]:
        """{"online": ..., "frozen": ...}: per strategy, (tokens, steps) of the serving drafter and of the frozen
        starting one (`drafter_counts_by_shape`) on `n_answers` of the last rollout's answers picked evenly
        (None = all); {} when that rollout kept no hidden states, none is asked for, or the curve is off. Called
        after the step, outside its timing."""
        answers = self._answers.pop("curve", [])
        if n_answers is not None and n_answers < len(answers):
            answers = [answers[i * len(answers) // n_answers] for i in range(n_answers)]
        if not answers or self.frozen_drafter is None:
            return {}
        shapes = self._shapes()
        return {"online": drafter_counts_by_shape(self.serving_drafter, answers, shapes),
                "frozen": drafter_counts_by_shape(self.frozen_drafter, answers, shapes)}  # fmt: skip

    def _shapes(self) -> dict[str, tuple[int, int]]:
        """(topk, depth) of each configured strategy, by its name."""
        shapes = {}
        for text in self.cfg.rollout.strategies:
            s = Strategy.parse(text)
            shapes[text] = (s.topk, s.depth)
        return shapes

    def evaluate(self, prompts: list[list[int]], params: dict) -> list[Sample]:
        """Answer held-out prompts with the current policy. Nothing is kept for the drafter, and the engine's
        steps for them are left out of every RL step's timeline."""
        if not prompts:
            return []
        n0 = len(self.engine.timeline)
        outs = self.engine.generate(prompts, SamplingParams(**params))
        del self.engine.timeline[n0:]
        return [Sample(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason) for o in outs]

    # ------------------------------------------------------------------------- drafter training
    def _stop_event(self, epoch: int) -> threading.Event:
        with self._lock:  # the stop may arrive before the training call it stops
            return self._stops.setdefault(epoch, threading.Event())

    def train_drafter(self, epoch: int) -> DrafterTraining:
        """Train the drafter replica until `stop_drafter(epoch)`; the coordinator calls this on idle workers."""
        stop = self._stop_event(epoch)
        start = time.time()
        if self.buffer.num_tokens == 0 or stop.is_set():
            return DrafterTraining(self.rank, "idle", 0, start, start)
        out = self.trainer.train(stop, max_steps=self.cfg.drafter.max_spot_steps or None)
        return DrafterTraining(self.rank, "idle", int(out["steps"]), start, time.time(), out["loss"], out["top1"])

    def stop_drafter(self, epoch: int) -> None:
        self._stop_event(epoch).set()
        with self._lock:
            for old in [e for e in self._stops if e < epoch - 1]:
                del self._stops[old]

    @torch.no_grad()
    def merge_drafter(self, my_steps: int, total_steps: int) -> None:
        """Average the drafter replicas over the workers that trained, weighted by their steps; push to the engine.

        Collective: every worker calls it. Optimizer moments stay per worker (local-SGD style).
        """
        if self.world_size > 1 and total_steps > 0:
            tensors = [t for t in self.drafter.state_dict().values() if t.is_floating_point()]
            # scaled copies: if a peer dies mid-reduce, this replica is still whole
            shares = [t * (my_steps / total_steps) for t in tensors]
            all_reduce_sum(shares)
            for t, s in zip(tensors, shares, strict=True):
                t.copy_(s)
        if total_steps > 0:
            self._push_drafter()

    @torch.no_grad()
    def _push_drafter(self) -> None:
        self.serving_drafter.load_state_dict(self.drafter.state_dict())
        for d in (self.drafter, self.serving_drafter):
            if d.d2t is not None:
                d.refresh_head()

    # ----------------------------------------------------------------------------------- learner
    @contextlib.contextmanager
    def _engine_released(self):
        """With `rl.release_engine` on a GPU, the engine's KV cache and captured steps are given back meanwhile
        (until the next rollout would need them)."""
        released = None
        if self.device.type == "cuda" and self.cfg.rl.release_engine and hasattr(self.engine, "release_memory"):
            released = self.engine.release_memory()
        try:
            yield
        finally:
            if released is not None:
                self.engine.restore_memory(released)

    def learn(self, step: int, minibatches: list[MiniBatch]) -> LearnResult:
        self._maybe_fail("learn", step)
        cuda = self.device.type == "cuda"
        with self._engine_released():
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            if self.cfg.rl.recompute_logprobs:
                self.learner.recompute_logprobs([s for mb in minibatches for s in mb.samples])
            at = self.run_dir / "profile" / f"learner-step{step}-rank{self.rank}.txt"
            title = f"learner update, step {step}, rank {self.rank}"
            with profiled(at if step == self.cfg.logging.profile_learner_step else None, title, self.device):
                out = self.learner.update(minibatches)
        if cuda:
            out.peak_learn_bytes = float(torch.cuda.max_memory_allocated(self.device))
            out.peak_rollout_bytes = self._rollout_peak
            out.reserved_learn_bytes = float(torch.cuda.max_memory_reserved(self.device))
            out.reserved_rollout_bytes = self._rollout_reserved
            torch.cuda.reset_peak_memory_stats(self.device)  # the next rollout's peak starts here
        out.peak_flops = peak_flops(self.device)
        self._policy_updated()
        out.rank, out.version = self.rank, self.learner.version
        return out

    def _policy_updated(self) -> None:
        for d in (self.drafter, self.serving_drafter, self.frozen_drafter):
            if d is not None and d.d2t is not None:  # a reduced head is a copy of the policy's rows
                d.refresh_head()

    def version(self) -> int:
        return self.learner.version

    # ---------------------------------------------------------------------------- state transfer
    def export_state(self) -> dict:
        """Everything a replacement worker needs to continue as this one (weights, optimizer, drafter)."""
        return {
            "policy": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "learner": self.learner.state_dict(),
            "drafter": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
            "drafter_optimizer": self.trainer.optimizer.state_dict(),
        }

    @torch.no_grad()
    def import_state(self, state: dict) -> None:
        self.model.load_state_dict(state["policy"])
        self.learner.load_state_dict(state["learner"])
        self.drafter.load_state_dict(state["drafter"])
        self.trainer.optimizer.load_state_dict(state["drafter_optimizer"])
        self._push_drafter()

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, folder: str) -> None:
        """Rank 0 writes the shared state (policy in HF layout, optimizer, drafter); every rank its own RNG and
        SD policy. `folder` must be on a file system every worker sees."""
        folder = Path(folder)
        if self.rank == 0:
            save_target(self.model, folder / "policy")
            copy_tokenizer_files(self.cfg.model.path, folder / "policy")
            torch.save(self.learner.state_dict(), folder / "learner.pt")
            self.trainer.save_checkpoint(folder / "drafter", async_=False)
        policy = getattr(self.engine, "policy", None)
        torch.save(
            {"rng": rng_state(), "sd_policy": policy.state_dict() if hasattr(policy, "state_dict") else None},
            folder / f"worker_{self.rank}.pt",
        )

    def load_checkpoint(self, folder: str) -> None:
        """Restore what `save_checkpoint` wrote (the policy weights were loaded at construction)."""
        folder = Path(folder)
        self.learner.load_state_dict(load_pt(folder / "learner.pt"))
        with warnings.catch_warnings():  # the buffer starts empty after a restart; its cursor is moot
            warnings.simplefilter("ignore")
            self.trainer.load_checkpoint(folder / "drafter")
        self._push_drafter()
        own = folder / f"worker_{self.rank}.pt"
        if own.is_file():  # absent when resuming with more workers than before
            state = load_pt(own)
            set_rng_state(state["rng"])
            policy = getattr(self.engine, "policy", None)
            if state.get("sd_policy") is not None and hasattr(policy, "load_state_dict"):
                policy.load_state_dict(state["sd_policy"])
