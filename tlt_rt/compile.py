"""Precompile and profile every bucket: `tlt_rt.compile(config)` and `python -m tlt_rt.compile CONFIG [k=v ...]`.

For each batch bucket, plain decode and every configured strategy: capture the CUDA graphs (on CUDA),
time the step on a representative context, and write the cost table, keyed by model shape, dtype, device
and versions, to `$TLT_CACHE/costs/`. Engines built for the same key load it at start, so the SD policy
decides from measured costs from the first step; without it they profile lazily online.

A strategy's step cost is the sum of its parts: the draft step (catch-up, levels and reranking) and the
target's verify (graphs where captured), timed on synthetic sequences that write only to the caches'
trash blocks.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from tqdm import tqdm

from tlt_rt.ir.strategy import Strategy
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.default import cache_dir
from tlt_rt.rollout.costs import CostTable, cost_key
from tlt_rt.rollout.drafting import DraftInputs


def engine_cost_key(engine) -> dict:
    a = engine.target.arch
    shape = {
        k: getattr(a, k)
        for k in (
            "model_type",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
    }
    shape["block_size"] = engine.block_size
    return cost_key(shape, engine.target.lm_head.weight.dtype, engine.device)


def cost_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{digest}.json"


def _synthetic_tables(engine, b: int, tokens: int) -> torch.Tensor:
    width = min(engine.max_blocks_per_seq, -(-tokens // engine.block_size))
    return (torch.arange(b * width, device=engine.device, dtype=torch.int32) % engine.blocks.num_blocks).view(b, width)


def _synthetic_draft(engine, b: int, s: Strategy, ctx: int) -> DraftInputs:
    """A draft of b sequences of ctx cached tokens; valid 0 sends every write to the trash slot."""
    dev, r = engine.device, engine.drafter_runner.block_rows(s)
    hidden = torch.zeros(b, r, engine.target.arch.hidden_size, device=dev, dtype=engine.target.lm_head.weight.dtype)
    zeros = torch.zeros(b, dtype=torch.long, device=dev)
    tables = _synthetic_tables(engine, b, ctx + (s.depth - 1) * s.topk)
    return DraftInputs(torch.zeros(b, r, dtype=torch.long, device=dev), hidden, zeros, zeros + ctx, tables)


def _synthetic_meta(engine, b: int, t: int, w: int, ctx: int) -> tuple[AttnMetadata, torch.Tensor]:
    dev = engine.device
    tables = _synthetic_tables(engine, b, ctx + w)
    mask = torch.ones(t, w, dtype=torch.bool, device=dev).tril(w - t).expand(b, t, w).contiguous()
    meta = AttnMetadata(
        "decode" if t == 1 else "verify",
        torch.arange(0, b * t + 1, t, dtype=torch.int32, device=dev),
        torch.full((b,), ctx + w, dtype=torch.int32, device=dev),
        tables,
        torch.full((b * t,), -1, dtype=torch.long, device=dev),  # every write goes to the trash block
        t,
        None if t == 1 else mask,
    )
    return meta, torch.full((b * t,), ctx, dtype=torch.long, device=dev)


def _time(fn, iters: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def profile(engine, ctx: int = 512, iters: int = 10, progress: bool = True) -> tuple[CostTable, list[dict]]:
    """Measure step costs for every (bucket, option) of `engine`; returns the table and printable rows."""
    table = CostTable(engine_cost_key(engine))
    rows: list[dict] = []
    options: list[Strategy | None] = [None]
    if engine.drafter_runner is not None:
        options += engine.strategies
    work = [(b, s) for b in sorted(engine.buckets, reverse=True) for s in options]
    for b, s in tqdm(work, desc="profiling buckets", disable=not progress, file=sys.stderr):
        t = 1 if s is None else s.verify_tokens
        meta, pos = _synthetic_meta(engine, b, t, t, ctx)
        ids = torch.zeros(b * t, dtype=torch.long, device=engine.device)
        total = _time(lambda meta=meta, pos=pos, ids=ids: engine.runner.run(ids, pos, meta), iters)
        if s is not None:
            ins = _synthetic_draft(engine, b, s, ctx)
            total += _time(lambda s=s, ins=ins: engine.drafter_runner.draft_tree(s, ins), iters)
        table.set(b, s, total)
        rows.append({"bucket": b, "option": str(s) if s else "off", "ms": total * 1e3})
    return table, rows


def compile(config) -> dict:  # noqa: A001 - the public name this module is for
    """Build the engine a config describes, capture every graph, profile, save the cost table."""
    from tlt_rt.rollout import Engine

    r, m = config.rollout, config.model
    device = None if m.device == "auto" else m.device
    engine = Engine.from_pretrained(
        m.path, drafter_path=config.drafter.path, speculative=r.speculative, dtype=m.dtype, device=device,
        strategies=r.strategies, num_blocks=r.num_blocks, block_size=r.block_size, max_batch=r.max_batch,
        max_context=m.max_context, enforce_eager=r.enforce_eager,
    )  # fmt: skip
    mem = engine.capture(profile=False)  # profiled below, with rows to print
    table, rows = profile(engine)
    path = cost_path(table.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    return {"cost_table": str(path), "rows": rows, "graph_memory": mem}


def main(argv: list[str] | None = None) -> int:
    from tlt_rt.config import ConfigError, TLTConfig, load_config, parse_cli

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print("usage: python -m tlt_rt.compile CONFIG [key.sub=value ...]\n\n" + __doc__.split("\n\n", 1)[1])
        return 0
    path, overrides, flags = parse_cli(argv)
    try:
        config = load_config(TLTConfig, path, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    out = compile(config)
    print(f"{'bucket':>6} {'option':>8} {'step ms':>9}")
    for r in out["rows"]:
        print(f"{r['bucket']:6d} {r['option']:>8} {r['ms']:9.3f}")
    g = out["graph_memory"]
    print(f"graphs: {g['graphs']}, graph pool: {g['pool_bytes'] / 2**20:.1f} MiB; cost table: {out['cost_table']}")
    return 0


class _CallableModule(types.ModuleType):
    """Makes `tlt_rt.compile(config)` work: the module and its main function share the name."""

    def __call__(self, config) -> dict:
        return compile(config)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
