"""How a step runs: the model runner owns the target and drafter runners, the CUDA-graph pool and the
captured steps. It offers two calls:

    out = runner.prefill(tokens, layout, logits_rows)       # eager chunked prefill -> ModelOutput
    res = runner.step(seqs, tables, strategy, params)       # one plain (strategy None) or SD step -> StepOut

A step is one captured graph per (batch bucket, option, acceptance mode) (rollout/step/graph.py), so the
device runs it without the host in between, and its results reach the host in one copy that waits for
the runner's own stream only. What the step means for the requests (append tokens, stops, finishes,
blocks) is the scheduler's business (`Scheduler.postprocess`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch

from tlt_rt.codegen.graphs import GraphPool, Key
from tlt_rt.ir.strategy import Strategy, bucket_for, scratch_tokens
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM, ModelOutput, fuse_projections, set_glue
from tlt_rt.models.loader import IGNORED_SUFFIXES
from tlt_rt.rollout.block_manager import Tables
from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.policy.costs import option_name
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.ahead import Launched, args_after
from tlt_rt.rollout.step.drafting import DrafterRunner
from tlt_rt.rollout.step.graph import StepArgs, StepGraphs, StepValues, layout
from tlt_rt.rollout.step.io import (
    PinnedRing,
    StepOut,
    Uniforms,
    distinct,
    pack_floats,
    pack_ints,
    parse_host,
    row_params,
)
from tlt_rt.rollout.step.target import Layout, PaddedPrefill, TargetRunner, batch_mode, prefill_graph_sizes

log = logging.getLogger(__name__)
PLAIN = option_name(None)  # the option name of a plain step


def engine_drafter(drafter: Drafter | None, target: CausalLM, glue) -> Drafter:
    """The drafter as the engine runs it: the target's attention backend and glue, fused projections (a
    freshly initialised one, with a warning, when none is given)."""
    if drafter is None:
        warnings.warn("no drafter given: using a freshly initialised one (accept lengths will be low)", stacklevel=3)
        w = target.lm_head.weight
        drafter = Drafter(target.arch, target).to(w.device, w.dtype).eval()
    # the target hands over the layers the drafter fuses (EAGLE-3 features): every hidden buffer of the
    # engine is `target.feature_size` wide from here on
    target.set_feature_layers(drafter.feature_layers)
    drafter.attn_backend = target.attn_backend
    fuse_projections(drafter)
    if glue is not None:
        set_glue(drafter, glue)
    return drafter


@contextlib.contextmanager
def on_stream(stream, device):
    """Run the enclosed work on `stream` (None: as is), ordered after the caller's stream (weights it updated)
    and before what the caller queues next (results it reads)."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


class ModelRunner:
    """The target (and drafter) with their paged caches, the graph pool and the captured steps."""

    def __init__(
        self,
        target: CausalLM,
        drafter,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        buckets: list[int] | None,
        window_rows: int = 0,
        prefill_graph_tokens: int = 0,
    ):
        self.device = target.lm_head.weight.device
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.trash_block = num_blocks  # caches hold num_blocks + 1 blocks, the last one trash
        self.target = TargetRunner(target, num_blocks, block_size)
        self.drafter = None if drafter is None else DrafterRunner(drafter, num_blocks, block_size, window_rows)
        self.buckets = list(buckets or [])
        self.pool = GraphPool(self.device) if self.buckets and self.device.type == "cuda" else None
        self.compiled = self.pool is not None  # the draft rerank as one Triton launch inside captured steps
        self.steps = StepGraphs(self)
        self.uniforms = Uniforms(2 * max(1, window_rows))
        self.ring = PinnedRing(self.device)
        if self.pool is not None:
            self.pool.register(("step",), self.steps)
        # one sequence's short prefill at a fixed padded size: captured on CUDA, run eagerly elsewhere
        sizes = prefill_graph_sizes(prefill_graph_tokens)
        self.padded = PaddedPrefill(self.target, self.width, sizes) if sizes else None
        if self.padded is not None and self.pool is not None:
            self.pool.register(("prefill",), self.padded)
        self._head_version = None if self.drafter is None else self.drafter.drafter.head_version

    # ---- prefill ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, tokens: list[int], layout: Layout, logits_rows: list[int]) -> ModelOutput:
        """Chunked prefill of packed prompts: eager, but for one sequence's chunk that fits a padded size
        (`prefill_graph_tokens`), which replays its captured graph (its logits are the chunk's last row)."""
        if self.padded is not None and len(layout.q_lens) == 1:
            t = self.padded.size_for(layout.starts[0], layout.q_lens[0])
            if t is not None:
                args = (tokens, layout.starts[0], layout.tables[0])
                if self.pool is None:
                    return self.padded(*args, t)
                key = ("prefill", t)
                if not self.pool.has(key):
                    self.pool.capture([key])
                return self.pool.replay(key, *args)
        return self.target.forward(tokens, layout, "prefill", logits_rows=logits_rows)

    def prefill_keys(self) -> list[Key]:
        """Keys of the captured one-sequence prefills (none unless `prefill_graph_tokens`)."""
        return [] if self.padded is None else [("prefill", t) for t in self.padded.sizes]

    # ---- graphs ----------------------------------------------------------------------------------------
    def key(self, batch: int, option: str, mode: str, table_width: int) -> Key | None:
        """The captured step serving this batch, or None (eager)."""
        if self.pool is None or batch > self.buckets[-1] or table_width > self.width:
            return None
        return ("step", bucket_for(batch, self.buckets), option, mode)

    def graph_keys(self, batches: list[int], strategies: list[Strategy], modes=("greedy", "sampled")) -> list[Key]:
        options = [option_name(None)] + ([str(s) for s in strategies] if self.drafter is not None else [])
        return [("step", b, o, m) for b in batches for o in options for m in modes]

    def capture(self, keys: list[Key]) -> None:
        if self.pool is not None:
            self.pool.capture(keys)

    # ---- one step --------------------------------------------------------------------------------------
    def step_args(
        self,
        seqs: list[Sequence],
        tables: Tables | list[list[int]],
        strategy: Strategy | None,
        rows: list[SamplingParams],
    ) -> StepArgs:
        """The packed inputs of a step (step/graph.py, step/io.py), `rows` each sequence's settings; SD steps
        bring the drafter within reach first."""
        if strategy is None:
            depth, r, window = 0, 1, None
        else:
            depth, r = strategy.depth, self.drafter.block_rows(strategy)
            window = self.drafter.prepare(seqs, tables, r)[:, -r:]
        ints = pack_ints(seqs, tables if isinstance(tables, Tables) else Tables.of(tables), r, depth)
        floats = pack_floats(seqs, rows, depth, self.uniforms)
        return StepArgs(self.ring.stage("ints", ints), self.ring.stage("floats", floats), window)

    def drop_stale_steps(self) -> list[Key]:
        """Forget the captured speculative steps when the drafter's head became other tensors since they were
        captured (`Drafter.head_version`: a reduced vocabulary set, resized or cleared); a captured step keeps
        reading the head it was captured with, so it would go on drafting through the old one. Returns the keys
        dropped (they capture anew on their next use)."""
        if self.drafter is None or self.drafter.drafter.head_version == self._head_version:
            return []
        self._head_version = self.drafter.drafter.head_version
        if self.pool is None:
            return []
        stale = [key for key in self.pool.graphs if key[0] == "step" and key[2] != PLAIN]
        if stale:
            log.warning("the drafter's head changed after %d speculative steps were captured: capturing them anew",
                        len(stale))  # fmt: skip
            self.pool.drop(stale)
        return stale

    def run_args(self, option: str, mode: str, args: StepArgs) -> StepValues:
        """Replay the captured step for these inputs (capturing it on first use), else run it eagerly."""
        b, c = args.ints.shape
        r, _ = layout(self, option)
        key = self.key(b, option, mode, c - 2 - r)
        if key is None:
            return self.steps.eager(option, mode, args)
        if option != PLAIN:
            self.drop_stale_steps()
        if not self.pool.has(key):
            self.pool.capture([key])
        return self.pool.replay(key, args)

    @torch.no_grad()
    def step(
        self,
        seqs: list[Sequence],
        tables: Tables | list[list[int]],
        strategy: Strategy | None,
        params: SamplingParams,
        keep_hidden: bool = False,
    ) -> StepOut:
        """One plain or speculative step of every sequence; results come back to the host in one copy."""
        return self.collect(self.launch(seqs, tables, strategy, params, keep_hidden))

    @torch.no_grad()
    def launch(
        self,
        seqs: list[Sequence],
        tables: Tables | list[list[int]],
        strategy: Strategy | None,
        params: SamplingParams,
        keep_hidden: bool = False,
        after: Launched | None = None,
        roots: list[int] | None = None,
    ) -> Launched:
        """Queue one step on the device; `collect` brings its results to the host.

        after: a step queued and not yet collected that this one continues (a plain step after a plain one, a
        speculative step after one of the same strategy): its sequences are that far further than they say,
        which the device works out from `after`'s results. roots: the positions of this step's sequences in
        `after`'s batch (None: all of them, in order)."""
        rows = row_params(seqs, params)
        mode = batch_mode(distinct(rows))
        option = option_name(strategy)
        t0 = time.perf_counter()
        if after is None:
            args = self.step_args(seqs, tables, strategy, rows)
        else:
            if option_name(after.strategy) != option:
                raise ValueError(f"a {option} step cannot continue a {option_name(after.strategy)} step on the device")
            self.stash(after)  # before this step's replay overwrites its outputs
            args = args_after(self, seqs, tables, strategy, rows, after, roots)
        out = self.run_args(option, mode, args)
        # a replayed graph's outputs are overwritten by its next replay: keep a copy, queued before the wait
        hidden = out.hidden.clone() if keep_hidden else None
        if mode != "greedy":  # host work that needs no result, while the device runs; after a plain step, a
            # plain step's two (the plain step beside a drafter draws what it draws without one; a switch to
            # speculation draws its own)
            self.uniforms.prefetch(seqs, 2 if strategy is None else None, ahead=0 if after is None else 1)
        return Launched(list(seqs), strategy, mode, out, hidden, t0, ahead=after is not None)

    def stash(self, step: Launched) -> None:
        """Keep what the next replay would overwrite of `step`'s outputs: its host row copied into pinned memory,
        its moved windows cloned, then its end marked (CUDA; once)."""
        if step.done is not None or self.device.type != "cuda":
            return
        out = step.out
        if out.window is not None:
            step.out = out = StepValues(out.host, out.hidden, out.window.clone())
        step.host = self.ring.take("host", tuple(out.host.shape), out.host.dtype)
        step.host.copy_(out.host, non_blocking=True)
        step.done = torch.cuda.Event()
        step.done.record()

    def discard(self, step: Launched) -> None:
        """Let go of a launched step whose results are not wanted (dropped): nothing of it reaches the sequences
        or the drafter's windows; the host waits for it, so the buffers it was given are free again."""
        if step.done is not None:
            step.done.synchronize()
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def collect(self, step: Launched) -> StepOut:
        """Wait for a launched step and parse its results (the one device-to-host copy)."""
        if step.done is not None:
            step.done.synchronize()
            host = step.host.numpy()
        else:
            host = step.out.host.cpu().numpy()  # waits for this stream alone
        strategy, seqs = step.strategy, step.seqs
        accept_len, tokens, logprobs = parse_host(host, 0 if strategy is None else strategy.depth)
        if strategy is not None:
            if step.ahead:  # what `DrafterRunner.prepare` marks at the start of a step packed on the host
                for s in seqs:
                    s.draft_cached = s.num_cached
            ends = [s.num_cached + a + 1 for s, a in zip(seqs, accept_len, strict=True)]
            self.drafter.keep_windows(seqs, step.out.window, ends)
        elif self.drafter is not None and step.hidden is not None:
            self.drafter.move_windows(seqs, step.hidden)
        return StepOut(accept_len, tokens, logprobs, step.hidden)

    # ---- weights and memory (serving) -----------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors) -> int:
        """Copy (HF name, tensor) pairs into the target's parameters in place: storage (so data_ptr, fused
        projections and captured steps) is kept, dtype and device are converted by the copy. Returns the
        number of tensors copied; an unknown name or a wrong shape raises before that tensor is copied."""
        model = self.target.model
        params = model.state_dict(keep_vars=True)
        tied = getattr(model.arch, "tie_word_embeddings", False)
        n = 0
        for name, t in named_tensors:
            if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight" and name not in params):
                continue
            p = params.get(name)
            if p is None:
                raise KeyError(f"update_weights: {name!r} is not a parameter of the target")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"update_weights: {name!r} is {tuple(t.shape)}, the target has {tuple(p.shape)}")
            p.copy_(t)
            n += 1
        return n

    def _caches(self) -> list:
        return [self.target.cache] + ([self.drafter.cache] if self.drafter is not None else [])

    def release_memory(self) -> list:
        """Free the KV caches' memory and the captured steps (their pool holds addresses in the caches);
        returns the keys that were captured. Only while no sequence holds cached rows."""
        keys = []
        if self.pool is not None:
            keys = list(self.pool.graphs)
            self.pool = self.pool.fresh()
        for c in self._caches():
            for t in (c.k, c.v):
                t.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return keys

    def restore_memory(self, keys: list | None = None) -> None:
        """Give the KV caches their memory back (zeroed) and capture `keys` again (`release_memory`)."""
        for c in self._caches():
            for t in (c.k, c.v):
                t.untyped_storage().resize_(t.numel() * t.element_size())
                t.zero_()
        if keys:
            self.capture(keys)

    # ---- profiling -------------------------------------------------------------------------------------
    @torch.no_grad()
    def synthetic_step(self, batch: int, strategy: Strategy | None, mode: str, ctx: int):
        """A callable running one step of `batch` sequences of `ctx` cached tokens, as `step` does (fill,
        replay or eager run, the host copy). Its writes land in the first blocks of the cache: call it only
        while no request is live (between generate calls)."""
        option = option_name(strategy)
        r, depth = layout(self, option)
        tokens = ctx + (1 if strategy is None else scratch_tokens(strategy))  # what the engine reserves
        w = min(self.width, -(-tokens // self.block_size))
        tables = (torch.arange(batch * w) % self.trash_block).view(batch, w)
        lead = torch.tensor([ctx, 0] + [0] * r).expand(batch, -1)  # ctx_len 0: drafter writes go to the trash
        floats = torch.zeros(batch, 2 * (depth + 1) + 3)
        floats[:, -3:] = torch.tensor([1.0, -1.0, 1.0])
        window = None
        if strategy is not None:
            h = self.target.model.feature_size
            window = torch.zeros(batch, r, h, dtype=self.target.model.lm_head.weight.dtype, device=self.device)
        args = StepArgs(torch.cat([lead, tables], 1), floats, window)
        return lambda: self.run_args(option, mode, args).host.cpu()
