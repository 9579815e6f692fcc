"""Getting an engine ready before it is timed: CUDA graphs of every bucket, the SD policy's step costs, and
the kernels and compiled glue that a first speculative step would otherwise compile mid-rollout.

`Engine.capture`, `Engine.profile_costs` and `Engine.warm_up` call these; they live apart from the engine's
scheduling loop because they run once, before any request.
"""

from __future__ import annotations

import logging

import torch

from tlt_rt.rollout.sequence import Sequence

log = logging.getLogger(__name__)


def capture(engine, batch_sizes: list[int] | None = None, profile: bool = True) -> dict:
    """Capture every graph ahead of generation, largest first, into the one shared pool. With `profile`
    and no cost table loaded for this model (`python -m tlt_rt.compile` writes one), the captured steps
    are timed now and the table saved where the next engine for this model finds it, so the SD policy
    decides from measured costs from the first step instead of trying each option online. A table that
    lacks any of this engine's (bucket, option) cells is profiled again."""
    pool = engine.runner.run.pool
    if pool is None:
        return {"graphs": 0, "pool_bytes": 0}
    target_keys, draft_keys = engine.graph_keys(batch_sizes)
    pool.capture(target_keys + draft_keys)
    known = all(engine.policy.costs.get(b, o) is not None for b in engine.buckets for o in engine.policy.options)
    if profile and engine.speculative == "auto" and not known:
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
    """Compile what a first speculative step would otherwise compile inside a timed rollout: the compiled
    glue for one row and for several (dynamic shapes still specialise a dimension of 1: a catch-up of one
    row recompiled all three, ~0.45 s, on an H200), the acceptance kernel (greedy and sampled) and the KV
    commit for every strategy, and the drafter's eager catch-up forward. Writes only to trash blocks."""
    a, w = engine.target.arch, engine.target.lm_head.weight
    if engine._glue is not None:
        _warm_glue(engine)
    if engine.drafter_runner is None:
        return
    from tlt_rt.codegen.kernels.accept import accept_tree
    from tlt_rt.codegen.kernels.kv_commit import kv_commit, kv_commit_reference

    dev, trash = engine.device, engine.blocks.num_blocks  # caches hold num_blocks + 1 blocks, the last one trash
    cuda = dev.type == "cuda"
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    for s in engine.strategies:
        t, d = s.verify_tokens, s.depth
        logits = torch.zeros(1, t, a.vocab_size, dtype=w.dtype, device=dev)
        tokens = torch.zeros(1, t, dtype=torch.long, device=dev)
        parents = (torch.arange(t, device=dev) - 1).clamp(max=0).view(1, t)  # a root and its t-1 children
        uniforms = torch.zeros(1, d + 1, 2, device=dev)
        for greedy in (True, False):
            temp = torch.full((1,), 0.0 if greedy else 1.0, device=dev)
            accept_tree(logits, tokens, parents, temp, torch.full((1,), -1, dtype=torch.int32, device=dev),
                        torch.ones(1, device=dev), uniforms, d, all_greedy=greedy, filtering=False,
                        backend="triton" if cuda else "torch")  # fmt: skip
        nodes = torch.full((1, d), -1, dtype=torch.long, device=dev)
        layers = [(engine.runner.cache.k[i], engine.runner.cache.v[i]) for i in range(engine.runner.cache.num_layers)]
        for width in (1, 3, 16):  # Triton specialises the table stride: 1, a multiple of 16, or neither
            table = torch.full((1, width), trash, dtype=torch.int32, device=dev)
            (kv_commit if cuda else kv_commit_reference)(layers, table, zero, nodes, zero)  # accepts nothing
    rows = min(3, engine.block_size)
    h = torch.zeros(rows, a.hidden_size, dtype=w.dtype, device=dev)
    fake = Sequence(-1, -1, -1, [0] * (rows + 1), 0, 1, num_cached=rows, hidden_chunks=[h])
    engine.drafter_runner.catch_up([fake], [[trash]])
    if cuda:
        torch.cuda.current_stream(dev).synchronize()


def profile_costs(engine, save: bool = False, iters: int = 5) -> None:
    """Time every (bucket, option) step on synthetic sequences (`tlt_rt.compile.profile`) into the policy's
    cost table, keeping what it held for other strategies; the first step timed online replaces each
    profiled cost. `save` writes the table to the cache dir under this model's key."""
    from tlt_rt.compile import cost_path, profile

    table, _ = profile(engine, iters=iters, progress=False)
    table.merge_missing(engine.policy.costs)  # cells of strategies this engine does not run
    engine.policy.costs = table
    if save:
        path = cost_path(table.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        table.save(path)
        log.info("profiled step costs saved to %s", path)
