"""A worker's rollout engine and what reads the answers it gives: the step's rollout (which feeds the drafter's
buffer and may train it in the engine's tail), held-out evaluation, the accept ceiling and the drafter curve.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from tlt_rt.ir.strategy import Strategy
from tlt_rt.models.drafter import Drafter
from tlt_rt.rollout import SamplingParams
from tlt_rt.train.cluster.drafter_role import DrafterRole
from tlt_rt.train.cluster.results import RolloutResult, Sample
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.drafter.eval import drafter_counts_by_shape, oracle_counts_by_shape
from tlt_rt.train.drafter.tail import TailTrainer, tail_training_on
from tlt_rt.train.rl.checkpoint import load_pt, rng_state, set_rng_state
from tlt_rt.train.rl.metrics import stats_delta
from tlt_rt.train.rl.sd_explain import explain_policy


class RolloutRole:
    """Owns the engine (None until a sharded worker builds it in `form_group`), the last rollout's answers per
    reader and its GPU memory peaks. The drafter role is shared: the engine drafts with its serving copy, and
    a rollout fills its buffer and may train its replica in the tail."""

    def __init__(self, engine, drafter: DrafterRole, cfg: TLTConfig, rank: int, device: torch.device) -> None:
        self.engine, self.drafter = engine, drafter
        self.cfg, self.rank, self.device = cfg, rank, device
        self.collects = True  # keeps (token, hidden) rows for the drafter and may train it in the tail
        self._answers: dict[str, list[dict]] = {}  # the last rollout's answers, per reader (read once)
        self.peak_bytes: float | None = None  # GPU bytes allocated at most in the last rollout
        self.reserved_bytes: float | None = None  # and held by the allocator

    @staticmethod
    def engine_options(cfg: TLTConfig, serving: Drafter) -> dict:
        drafter = serving if cfg.rollout.speculative != "off" else None
        return dict(drafter=drafter, config=cfg.rollout.engine(), max_context=cfg.model.max_context)

    @contextlib.contextmanager
    def released(self):
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

    def rollout(self, step: int, prompts: list[list[int]], params: dict) -> RolloutResult:
        """Generate this worker's share; store (tokens, hidden) for the drafter; return tokens and timings."""
        start = time.time()
        n0, before = len(self.engine.timeline), self.engine.stats()
        online = self.cfg.drafter.train_online and self.collects
        tail = None
        n_seqs = len(prompts) * params["n"]
        capacity = min(n_seqs, self.engine.max_batch)  # the batch the engine runs before its tail
        if online and prompts and tail_training_on(self.cfg) and self.drafter.buffer.num_tokens > 0:
            d = self.cfg.drafter
            tail = TailTrainer(
                self.engine, self.drafter.trainer, n0, capacity, d.tail_fraction, d.max_spot_steps or None,
                rank=self.rank, sms=d.tail_sms, duty=d.tail_duty, micro_tokens=d.tail_micro_tokens,
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
            self.peak_bytes = float(torch.cuda.max_memory_allocated(self.device))
            self.reserved_bytes = float(torch.cuda.max_memory_reserved(self.device))
        timeline = self.engine.timeline[n0:]
        del self.engine.timeline[:]  # read once per rollout: a long run must not accumulate it
        if online and outs:
            # hidden has one row per position the target processed: the prompt and every token but the last
            ids = [torch.tensor(prompts[o.prompt_index] + o.token_ids[:-1]) for o in outs]
            self.drafter.buffer.add(step, ids, [o.hidden for o in outs])
            readers = [name for name, on in (("ceiling", self.cfg.logging.accept_ceiling),
                                             ("curve", self.drafter.frozen is not None)) if on]  # fmt: skip
            answers = [dict(ids=i, hidden=o.hidden, prompt_len=len(prompts[o.prompt_index]))
                       for i, o in zip(ids, outs, strict=True)] if readers else []  # fmt: skip
            self._answers = dict.fromkeys(readers, answers)
        if tail_stats is not None:
            self.drafter.push()
        samples = [Sample(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason) for o in outs]
        stats = stats_delta(self.engine.stats(), before)
        sd_policy = explain_policy(getattr(self.engine, "policy", None), timeline)
        return RolloutResult(self.rank, samples, timeline, stats, sd_policy, start, end, n_seqs, capacity, tail_stats)

    def evaluate(self, prompts: list[list[int]], params: dict) -> list[Sample]:
        """Answer held-out prompts with the current policy. Nothing is kept for the drafter, and the engine's
        steps for them are left out of every RL step's timeline."""
        if not prompts:
            return []
        n0 = len(self.engine.timeline)
        outs = self.engine.generate(prompts, SamplingParams(**params))
        del self.engine.timeline[n0:]
        return [Sample(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason) for o in outs]

    # ------------------------------------------------------------------- readers of the last answers
    @torch.no_grad()
    def accept_ceiling(self) -> dict[str, tuple[int, int]]:
        """Per strategy, (tokens, steps) a perfect drafter would give on the last rollout's answers
        (`oracle_counts_by_shape`: each step accepts the sampled tokens while they lie in the target's top-k,
        at most `depth` of them); {} when that rollout kept no hidden states. Called after the step, outside its
        timing."""
        answers = self._answers.pop("ceiling", [])
        if not answers:
            return {}
        return oracle_counts_by_shape(self.drafter.heads, answers, self.cfg.rollout.temperature, self._shapes())

    @torch.no_grad()
    def drafter_curve(self, n_answers: int | None) -> dict[str, dict[str, tuple[int, int]]]:
        """{"online": ..., "frozen": ...}: per strategy, (tokens, steps) of the serving drafter and of the frozen
        starting one (`drafter_counts_by_shape`) on `n_answers` of the last rollout's answers picked evenly
        (None = all); {} when that rollout kept no hidden states, none is asked for, or the curve is off. Called
        after the step, outside its timing."""
        answers = self._answers.pop("curve", [])
        if n_answers is not None and n_answers < len(answers):
            answers = [answers[i * len(answers) // n_answers] for i in range(n_answers)]
        if not answers or self.drafter.frozen is None:
            return {}
        shapes = self._shapes()
        return {"online": drafter_counts_by_shape(self.drafter.serving, answers, shapes),
                "frozen": drafter_counts_by_shape(self.drafter.frozen, answers, shapes)}  # fmt: skip

    def _shapes(self) -> dict[str, tuple[int, int]]:
        """(topk, depth) of each configured strategy, by its name."""
        shapes = {}
        for text in self.cfg.rollout.strategies:
            s = Strategy.parse(text)
            shapes[text] = (s.topk, s.depth)
        return shapes

    # -------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, folder: Path) -> None:
        """Every rank writes its own file: the process's random state and the engine's SD policy."""
        policy = getattr(self.engine, "policy", None)
        torch.save(
            {"rng": rng_state(), "sd_policy": policy.state_dict() if hasattr(policy, "state_dict") else None},
            folder / f"worker_{self.rank}.pt",
        )

    def load_checkpoint(self, folder: Path) -> None:
        own = folder / f"worker_{self.rank}.pt"
        if own.is_file():  # absent when resuming with more workers than before
            state = load_pt(own)
            set_rng_state(state["rng"])
            policy = getattr(self.engine, "policy", None)
            if state.get("sd_policy") is not None and hasattr(policy, "load_state_dict"):
                policy.load_state_dict(state["sd_policy"])
