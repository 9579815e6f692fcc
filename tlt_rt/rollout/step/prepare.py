"""Getting an engine ready before it is timed: the captured step of every (bucket, option, mode), the SD
policy's step costs, and the kernels and compiled glue a first step would otherwise compile mid-rollout.

`Engine.capture`, `Engine.profile_costs` and `Engine.warm_up` call these; they live apart from the engine's
scheduling loop because they run once, before any request. Loading a kernel for the first time can
synchronise the whole device (CUDA's lazy module loading), so a step that runs a kernel nobody ran before
would wait for a drafter trainer on another stream: everything a step runs is run here first.
"""

from __future__ import annotations

import logging

import torch

from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.policy.profiling import cost_path, profile
from tlt_rt.rollout.sequence import Sequence
from tlt_rt.rollout.step.target import draw

log = logging.getLogger(__name__)


def capture(engine, batch_sizes: list[int] | None = None, profile_missing: bool = True, modes=("greedy", "sampled")):
    """Capture every step ahead of generation, largest first, into the one shared pool. With
    `profile_missing` and no cost table loaded for this model (`python -m tlt_rt.compile` writes one), the
    captured steps are timed now and the table saved where the next engine for this model finds it, so the
    SD policy decides from measured costs from the first step. A table that lacks any of this engine's
    (bucket, option) cells is profiled again."""
    if engine.runner.pool is None:
        return {"graphs": 0, "pool_bytes": 0}
    engine.runner.capture(engine.graph_keys(batch_sizes, modes) + engine.runner.prefill_keys())
    known = all(engine.policy.costs.get(b, o) is not None for b in engine.buckets for o in engine.policy.options)
    if profile_missing and engine.speculative == "auto" and not known:
        profile_costs(engine, save=True)
    warm_up(engine)
    return engine.graph_memory()


def _warm_glue(engine) -> None:
    """Run one decoder layer's pieces on 1 and 3 rows as the forward calls them (same strides: q / k / v and
    gate / up are views of fused matmuls), so the compiled glue is specialised before any timed step."""
    target = engine.target
    layer, w = target.model.layers[0], target.lm_head.weight
    for n in (1, 3):
        x = torch.zeros(n, target.arch.hidden_size, dtype=w.dtype, device=w.device)
        _, h = layer.post_attention_layernorm.add(x, layer.input_layernorm(x))
        layer.self_attn._qkv(h, torch.zeros(n, dtype=torch.long, device=w.device), target.rotary)
        layer.mlp(h)


@torch.no_grad()
def warm_up(engine) -> None:
    """Compile and load what the eager parts of a rollout run: the compiled glue for one row and for several
    (dynamic shapes still specialise a dimension of 1), the first-token draw after a prefill (greedy and
    sampled), and the drafter's eager catch-up forward. Writes only to the trash block."""
    a, w = engine.target.arch, engine.target.lm_head.weight
    dev, trash = engine.device, engine.runner.trash_block
    if engine.glue is not None:
        _warm_glue(engine)
    logits = torch.zeros(2, a.vocab_size, dtype=w.dtype, device=dev)
    for params in (SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.9)):
        draw(logits, params, [0, 1], [0, 0])
    if engine.runner.drafter is not None:
        # one row (a sequence just past the catch-up window after a plain stretch: only `auto` makes it, and
        # a dimension of 1 compiles apart) and several
        for rows in sorted({1, min(3, engine.block_size)}):
            h = torch.zeros(rows, engine.target.feature_size, dtype=w.dtype, device=dev)
            fake = Sequence(-1, -1, -1, [0] * (rows + 1), 0, 1, num_cached=rows, hidden_chunks=[h])
            engine.runner.drafter.catch_up([fake], [[trash]])
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def profile_costs(engine, save: bool = False, iters: int = 5) -> None:
    """Time every (bucket, option) step on synthetic sequences (`rollout.policy.profiling.profile`) into the
    policy's cost table, keeping what it held for other strategies; the first step timed online replaces
    each profiled cost. `save` writes the table to the cache dir under this model's key."""
    table, _ = profile(engine, iters=iters, progress=False)
    table.merge_missing(engine.policy.costs)  # cells of strategies this engine does not run
    engine.policy.costs = table
    if save:
        path = cost_path(table.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        table.save(path)
        log.info("profiled step costs saved to %s", path)
