"""The rollout engine: continuous batching over a paged KV cache with adaptive speculative steps.

    engine = Engine.from_pretrained(target_path, drafter_path=None, speculative="auto")
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=0.9, max_new_tokens=512))

Each prompt is prefilled once (in chunks) and forked into its `n` samples, which share the prompt's KV
blocks. Every step either prefills waiting work or advances all running samples by one plain decode step
or one speculative step chosen by the SD policy. When blocks run out the youngest sample is preempted and
later recomputed from its tokens; nothing is lost. Every sample draws from its own counter-based random
stream, so with plain decoding (and with greedy speculation) its continuation is the same as if it had
never been preempted; sampled speculation stays exactly distributed but may take another valid draw.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter

import torch

from tlt_rt.codegen.backend import select_backend
from tlt_rt.codegen.model_kernels import engine_glue
from tlt_rt.ir.strategy import Strategy, batch_buckets, bucket_for, scratch_tokens
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout.block_manager import BlockManager, auto_num_blocks, blocks_per_sequence
from tlt_rt.rollout.config import PREFILL_GRAPH_TOKENS, EngineConfig, engine_config
from tlt_rt.rollout.model_runner import ModelRunner, engine_drafter, on_stream
from tlt_rt.rollout.params import Completion, SamplingParams, check_prompts
from tlt_rt.rollout.policy import SDPolicy
from tlt_rt.rollout.policy.catchup import rows_once
from tlt_rt.rollout.policy.costs import option_name
from tlt_rt.rollout.policy.profiling import load_costs
from tlt_rt.rollout.scheduler import Scheduler
from tlt_rt.rollout.sequence import PrefillJob, Sequence, flush_hidden
from tlt_rt.rollout.stats import EngineStats
from tlt_rt.rollout.step import prepare
from tlt_rt.rollout.step.ahead import keeps, launch_ahead
from tlt_rt.rollout.step.prefill import prefill
from tlt_rt.rollout.step.rng import sequence_seed

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        target: CausalLM,
        drafter=None,
        config: EngineConfig | None = None,
        *,
        max_context: int | None = None,
        **options,
    ):
        """Built from `config` (rollout/config.py declares every setting and its default); keyword `options`
        replace single fields (`Engine(target, speculative="on", max_batch=8, epsilon=0.0)`). `max_context`
        is the model's (model.max_context in a run; None = the architecture's)."""
        self.config = cfg = engine_config(config, **options)
        speculative, strategies, block_size = cfg.speculative, cfg.strategies, cfg.block_size
        max_batch, num_blocks, enforce_eager = cfg.max_batch, cfg.num_blocks, cfg.enforce_eager
        attn_backend = cfg.attn_backend
        self.target = target
        self.device = target.lm_head.weight.device
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.max_context = max_context or target.arch.max_position_embeddings
        self.strategies = [Strategy.parse(s) for s in strategies]
        # the engine chooses the kernels of the model it is given: attention backend, compiled glue, fused
        # projections (the learner sharing the model computes the same function through them)
        target.attn_backend = select_backend(
            self.device, attn_backend, fuse_rope=cfg.fuse_rope or cfg.decode_chain, pdl=cfg.pdl
        )
        self.glue = engine_glue(target) if self.device.type == "cuda" and not enforce_eager else None
        if self.glue is not None:
            self.glue.decode_chain(cfg.decode_chain, pdl=cfg.pdl, rows=cfg.decode_chain_rows,
                                   max_weight=cfg.decode_chain_max_weight)  # fmt: skip
            self.glue.fused_norm = cfg.fuse_norm or cfg.decode_chain
        target.fuse_projections()
        self.buckets = sorted({*cfg.graph_batches, max_batch}) if cfg.graph_batches else batch_buckets(max_batch)
        self.enforce_eager = enforce_eager
        self.speculative = speculative
        self.max_blocks_per_seq = blocks_per_sequence(self.max_context, self._max_scratch_for(speculative), block_size)
        if num_blocks <= 0:
            num_blocks = auto_num_blocks(target, block_size, most=max_batch * self.max_blocks_per_seq)
        self.blocks = BlockManager(num_blocks, block_size)
        rows = 0
        if speculative != "off":
            drafter = engine_drafter(drafter, target, self.glue)
            # the deepest strategy's catch-up block; in auto mode one row more, so that one plain step between
            # two speculative ones (the policy exploring plain decoding) leaves no sequence beyond the block and
            # the next speculative step runs no eager catch-up (one drafter forward, ~5 ms at batch 128)
            rows = max(s.depth for s in self.strategies) + 1 + (speculative == "auto")
        else:
            drafter = None
        graphed = not enforce_eager and self.device.type == "cuda"
        prefill_graphs = cfg.prefill_graph_tokens if cfg.prefill_graph_tokens >= 0 else PREFILL_GRAPH_TOKENS * graphed
        self.runner = ModelRunner(
            target, drafter, num_blocks, block_size, self.max_blocks_per_seq,
            None if enforce_eager else self.buckets, window_rows=rows, prefill_graph_tokens=prefill_graphs,
        )  # fmt: skip
        # its own stream, of high priority: a drafter trainer on another stream neither waits for a step nor
        # enters its timing, and the engine's kernels are scheduled first when both have work ready
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.policy = SDPolicy(self.strategies, self.buckets, load_costs(self), mode=speculative, config=cfg.policy)
        self._stats = EngineStats()
        self.timeline = self._stats.timeline  # read by benchmarks, the tail trainer and the RL records
        self._next_id = 0
        self._last_step: str | None = None  # what the last step ran: "prefill" or a decode option's name
        self._pending = None  # a plain step queued ahead and not yet collected (`EngineConfig.overlap`)
        self._decided = None  # (strategy, seq ids): the SD policy's choice for the next step, made while one ran
        self._t_collected = 0.0  # perf_counter when the last decode step was collected

    @property
    def drafter_runner(self):
        """The drafter's runner (its model and paged cache), None with speculation off."""
        return self.runner.drafter

    # ------------------------------------------------------------------------------------------ set-up
    @classmethod
    def from_pretrained(
        cls,
        target_path=None,
        drafter_path=None,
        speculative: str = "auto",
        dtype: str = "auto",
        device: str | None = None,
        **options,
    ) -> Engine:
        # local: only from_pretrained loads from a folder; no circle, could move to the top with a rollout change
        from tlt_rt.models.loader import load_target

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        target = load_target(target_path, dtype=dtype, device=device)
        drafter = None
        if drafter_path is not None:
            # local: as load_target above
            from tlt_rt.models.eagle_export import load_eagle

            drafter = load_eagle(drafter_path, target)
        return cls(target, drafter=drafter, speculative=speculative, **options)

    def new_id(self) -> int:
        """A fresh id for a sequence or a prefill job (block-manager owner)."""
        self._next_id += 1
        return self._next_id

    # ---------------------------------------------------------------------------------------- checks
    def validate(self, prompts: list[list[int]]) -> None:
        """What `check_prompts` cannot know: the context and the KV cache this engine has."""
        for i, p in enumerate(prompts):
            if len(p) >= self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {self.max_context}")
        need = -(-(max(len(p) for p in prompts) + 1 + self._max_scratch()) // self.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"the KV cache ({self.blocks.num_blocks} blocks) cannot hold one prompt ({need} blocks)")

    def _max_scratch(self) -> int:
        return self._max_scratch_for("off" if self.runner.drafter is None else self.speculative)

    def _max_scratch_for(self, speculative: str) -> int:
        if speculative == "off":
            return 1
        return max(scratch_tokens(s) for s in self.strategies)

    # -------------------------------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Sample `params.n` continuations of every prompt; returns them ordered by (prompt, sample)."""
        prompts, params = check_prompts(prompts, params, self.target.arch.vocab_size)
        self.validate(prompts)
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else self.target.arch.eos_token_ids)
        keep_hidden = params.return_hidden or self.runner.drafter is not None
        sched = self.scheduler(stop)
        seen: Counter = Counter()
        for i, p in enumerate(prompts):
            occurrence = seen[tuple(p)]
            seen[tuple(p)] += 1
            group = [
                Sequence(self.new_id(), i, j, p, sequence_seed(params.seed, i, j, occurrence), params.max_new_tokens)
                for j in range(params.n)
            ]
            # a group never outgrows the running batch: larger n prefills the prompt once per slice
            for k in range(0, len(group), self.max_batch):
                sched.waiting.append(PrefillJob(self.new_id(), list(p), group=group[k : k + self.max_batch]))
        self._stats.t_start = t_start = time.perf_counter()
        self.discard_pending()  # a step another scheduler left queued (a failed call) is nobody's now
        with self.on_stream():
            while sched.busy:
                self._step(sched, params, keep_hidden, self.config.overlap)
            if params.return_hidden:
                flush_hidden(sched.done)
        self._stats.gen_time += time.perf_counter() - t_start
        sched.done.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return [s.completion(params.return_hidden) for s in sched.done]

    def scheduler(self, stop=frozenset()) -> Scheduler:
        """A scheduler over this engine's blocks and limits, counting into its stats."""
        counts = self._stats.counts
        return Scheduler(self.blocks, self.max_batch, self.max_prefill_tokens, counts, stop, self.max_context,
                         self.config.prefill_min_samples)  # fmt: skip

    def _step(self, sched: Scheduler, params: SamplingParams, keep_hidden: bool, overlap: bool = False) -> None:
        """schedule -> run -> postprocess: a prefill of waiting work, else a decode step of the running.
        overlap: plain steps may be queued one ahead (`EngineConfig.overlap`; within one generate call)."""
        jobs = sched.admit()
        if jobs:
            self._collect_pending(sched, params, keep_hidden)  # the step in flight first, as without overlap
            t0 = time.perf_counter()
            n = prefill(self.runner, sched, jobs, params, keep_hidden)
            self._stats.record("prefill", None, len(jobs), n, t0, len(sched.running))
            self._last_step = "prefill"
        elif sched.running:
            self._decode_step(sched, params, keep_hidden, overlap)
        else:
            raise RuntimeError("no sequence can run: the KV cache is too small for the waiting work")

    def _decode_step(self, sched: Scheduler, params: SamplingParams, keep_hidden: bool, overlap: bool) -> None:
        """One plain or speculative step of every running sample, as the SD policy decides; with `overlap`, each
        plain step is queued before the one before it is collected (`step/ahead.py`)."""
        step, self._pending = self._pending, None
        decided, self._decided = self._decided, None
        if step is None:
            strategy, behind = None, 0
            if self.runner.drafter is not None:  # rows an SD step would catch up first, counted only when needed
                auto = self.speculative == "auto"
                count = rows_once(functools.partial(self.runner.drafter.rows_behind, sched.running)) if auto else 0
                if decided is not None and decided[1] == [s.seq_id for s in sched.running]:
                    strategy = decided[0]  # decided while the plain step before ran, for this very batch
                else:
                    strategy = self.policy.decide(len(sched.running), count)
                behind = count() if strategy is not None and auto else 0  # the policy's count, if it made one
            sched.reserve(1 if strategy is None else scratch_tokens(strategy))
            if not sched.running:
                return
            seqs = list(sched.running)
            tables = self.blocks.packed([s.seq_id for s in seqs])
            if not overlap or (strategy is not None and not self.config.overlap_speculative):  # one at a time
                t0 = time.perf_counter()
                out = self.runner.step(seqs, tables, strategy, params, keep_hidden)
                self._apply(sched, seqs, strategy, out, t0, behind)
                return
            step = self.runner.launch(seqs, tables, strategy, params, keep_hidden)
            step.behind = behind
        ahead, self._decided = launch_ahead(self, sched, step, params, keep_hidden) if overlap else (None, None)
        out, seqs = self.runner.collect(step), step.seqs
        if any(s.finished for s in seqs):  # queued ahead: rows of samples that stopped (or were aborted) since
            keep = [i for i, s in enumerate(seqs) if not s.finished]
            seqs, out = [seqs[i] for i in keep], out.rows(keep)
        if seqs:
            self._apply(sched, seqs, step.strategy, out, max(step.t0, self._t_collected), step.behind)
        if ahead is not None and not keeps(self, sched, ahead, params):
            self.runner.discard(ahead)  # dropped: run again on the samples left
            ahead = None
        self._pending = ahead

    def _apply(self, sched: Scheduler, seqs: list[Sequence], strategy, out, t0: float, behind: int) -> None:
        """Postprocess a collected step begun at `t0` (a step queued ahead: where the one before was collected)
        and count it for the policy and the stats."""
        emitted = sched.postprocess(seqs, out)
        t_end = time.perf_counter()
        dt, self._t_collected = t_end - t0, t_end
        b = len(seqs)
        # a step after another kind of step may carry that one's leftovers (a sync, cold caches): the policy
        # keeps such a plain step out of plain decoding's price
        option, last = option_name(strategy), self._last_step
        self._last_step = option
        self.policy.observe(b, strategy, dt, emitted / b, behind, switched=last != option)
        self._stats.decode_step(strategy, out.accept_len)
        self._stats.record("sd" if strategy else "decode", strategy, b, emitted, t0, len(sched.running), dt, behind)

    def on_stream(self):
        """The engine's own CUDA stream as a context (`model_runner.on_stream`)."""
        return on_stream(self.stream, self.device)

    # ----------------------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Steps, tokens, accept lengths and strategy use so far (`rollout.stats`), the memory the KV cache
        and the captured steps hold, and the SD policy's state."""
        return {
            **self._stats.summary(),
            "kv_cache_bytes": self.runner.target.cache.nbytes(),
            "graph_memory": self.graph_memory(),
            "policy": self.policy.stats(),
        }

    def graph_keys(self, batch_sizes: list[int] | None = None, modes=("greedy", "sampled")) -> list:
        """Keys of the captured steps: one per (bucket, option, acceptance mode), where an option is plain
        decoding or a strategy and a mode greedy, sampled or filtered (rollout/step/graph.py)."""
        return self.runner.graph_keys(batch_sizes or self.buckets, self.strategies, modes)

    def capture(self, batch_sizes: list[int] | None = None, profile: bool = True, modes=("greedy", "sampled")) -> dict:
        """Capture every step ahead of generation, largest first, into the one shared pool; profile missing
        step costs (`rollout.step.prepare.capture`)."""
        with self.on_stream():
            return prepare.capture(self, batch_sizes, profile, modes)

    def warm_up(self) -> None:
        """Compile what a first step would compile mid-rollout (`rollout.step.prepare.warm_up`)."""
        with self.on_stream():
            prepare.warm_up(self)

    def profile_costs(self, save: bool = False, iters: int = 5) -> None:
        """Time every (bucket, option) step into the policy's cost table (`rollout.step.prepare.profile_costs`)."""
        with self.on_stream():
            prepare.profile_costs(self, save, iters)

    def graph_memory(self) -> dict:
        """Captured steps and the bytes their shared pool holds."""
        pool = self.runner.pool
        if pool is None:
            return {"graphs": 0, "pool_bytes": 0}
        return {"graphs": len(pool.graphs), "pool_bytes": pool.pool_bytes}

    def bucket(self, batch: int) -> int:
        return bucket_for(batch, self.buckets)

    # ------------------------------------------------------------------------- serving (AsyncEngine)
    def step_once(self, sched: Scheduler, params: SamplingParams, keep_hidden: bool = False) -> None:
        """One schedule -> run -> postprocess step of a scheduler that outlives generate calls
        (`rollout.async_engine`): a prefill of waiting work, else one plain or speculative step. With
        `EngineConfig.overlap` the next step may be left queued on the device (`drain` collects it); samples
        dropped from the scheduler meanwhile (an abort) must be marked finished, and their rows are left out."""
        with self.on_stream():
            self._step(sched, params, keep_hidden or self.runner.drafter is not None, self.config.overlap)

    def drain(self, sched: Scheduler, params: SamplingParams, keep_hidden: bool = False) -> None:
        """Collect and postprocess the step `step_once` left queued, if any, queuing none: before the weights, the
        cache or the running samples change other than by a step."""
        with self.on_stream():
            self._collect_pending(sched, params, keep_hidden or self.runner.drafter is not None)
        self._decided = None

    def _collect_pending(self, sched: Scheduler, params: SamplingParams, keep_hidden: bool) -> None:
        """Postprocess the step left queued, if any, queuing none after it."""
        if self._pending is not None:
            self._decode_step(sched, params, keep_hidden, overlap=False)

    def discard_pending(self) -> None:
        """Let go of a queued step without applying it (after a failed step: its samples are being dropped)."""
        step, self._pending, self._decided = self._pending, None, None
        if step is not None:
            self.runner.discard(step)

    def load_weights(self, named_tensors) -> int:
        """Copy (HF name, tensor) pairs into the target's parameters in place (`ModelRunner.load_weights`)."""
        with self.on_stream():
            return self.runner.load_weights(named_tensors)

    def release_memory(self) -> list:
        """Free the KV caches and the captured steps; returns the keys to capture again on restore."""
        return self.runner.release_memory()

    def restore_memory(self, keys: list | None = None) -> None:
        """Give the KV caches their memory back (zeroed) and capture `keys` again."""
        with self.on_stream():
            self.runner.restore_memory(keys)
