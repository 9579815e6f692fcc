"""Precompile and profile every bucket: `tlt_rt.compile(config)` and `python -m tlt_rt.compile CONFIG [k=v ...]`.

For each batch bucket, plain decode and every configured strategy: capture the step's CUDA graph (on
CUDA), time it on a representative context, and write the cost table, keyed by model shape, dtype, device
and versions, to `$TLT_CACHE/costs/`. Engines built for the same key load it at start, so the SD policy
decides from measured costs from the first step; without it they profile lazily online. The work itself
lives in `tlt_rt.rollout.policy.profiling`; this module is its command line.
"""

from __future__ import annotations

import sys
import types

from tlt_rt.config import ConfigError, TLTConfig, load_config, parse_cli
from tlt_rt.rollout import Engine
from tlt_rt.rollout.policy.profiling import cost_path, engine_cost_key, profile

__all__ = ["compile", "cost_path", "engine_cost_key", "main", "profile"]


def compile(config) -> dict:  # noqa: A001 - the public name this module is for
    """Build the engine a config describes, capture every graph, profile, save the cost table."""
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
