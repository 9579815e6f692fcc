"""Decode and verify step costs against the HBM floor, on a GPU.

    python benchmarks/step_costs.py --model qwen2.5-coder-1.5b --batch 1 8 32 --ctx 1024 --verify 16 48
    python benchmarks/step_costs.py --model qwen2.5-coder-1.5b-instruct --batch 1 8 32 --ctx 1024  # fetched
    python benchmarks/step_costs.py --model qwen2.5-7b --batch 1 4 16 64 --ctx 1024 8192 --profile

For each (batch, context, mode) one paged forward is captured as a CUDA graph and its replays are timed
with CUDA events (median of --iters). The floor of a step is (weight bytes + KV bytes read) / the HBM
bandwidth measured in the same run by a large device-to-device copy; "% of floor" is floor / measured.
--model takes a shape of tlt_rt/models/shapes.py (random bf16 weights, nothing is downloaded), "smollm2"
(the embedded default model), a registered model that `python -m tlt_rt.models.fetch` fetched, a .gguf file
or a converted model folder (the last four read by the project's loader, in bf16). --profile prints the
first decode shape's kernels by time, their count per step and per layer, and their summed time against
the step's replay time (the rest is gaps between kernels inside the graph).
Prints a table and, with --out, appends JSON lines.

--compare V1 V2 ... times variants of the engine's glue and attention side by side in one process (each shape
captured once per variant, then `--rounds` rounds of replays taking the variants in turn; median per variant, ratio
to the first):
    base        the engine's default (`KernelGlue()`, `TritonAttention()`)
    fused-norm  + the residual add and RMSNorm inside the q/k/v and gate/up projections (`kernels.norm_linear`),
                for one-row steps
    rope-attn   + a decode step's rotary and K/V write inside its attention kernel (`kernels.decode_rope_attention`)
    skinny      + the skinny Triton matmul for one-row steps (weights from --skinny-min-weight elements up)
    fused       fused-norm and rope-attn;  fused+skinny  all three
    pdl         fused+skinny with the skinny kernel for every one-row matmul, all of a one-row step's Triton kernels
                launched with programmatic dependent launch (`kernels.pdl`)
    pdl+prefetch  pdl, each matmul pulling its weight slab into L2 before it waits for the kernel before
    pdl-end, pdl-end+prefetch  the same with each kernel signalling the next at the end of its main loop, not at
                its start
With --profile, each variant's kernels for the first decode shape.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import statistics
import time
from pathlib import Path

import torch

from tlt_rt.models import load_target
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.default import DEFAULT_NAME, fetched_gguf, not_fetched
from tlt_rt.models.llama import CausalLM, Rotary
from tlt_rt.models.registry import MODELS
from tlt_rt.models.shapes import SHAPES
from tlt_rt.train.profile import exposed_by, kernel_rows


def model_source(name: str) -> str:
    """What `--model name` is: "shape" for a name of SHAPES (random weights), "checkpoint" for what the loader
    reads ("smollm2", a fetched registered model, a .gguf file, a model folder or its config.json).
    ValueError naming what is accepted otherwise, before anything touches the GPU."""
    if name in SHAPES:
        return "shape"
    if name == DEFAULT_NAME:
        return "checkpoint"
    if name in MODELS:
        if not fetched_gguf(name).is_file():
            raise ValueError(not_fetched(name))
        return "checkpoint"
    p = Path(name).expanduser()
    if (p.is_file() and (p.suffix == ".gguf" or p.name == "config.json")) or (p / "config.json").is_file():
        return "checkpoint"
    raise ValueError(
        f"--model {name}: not a shape ({', '.join(SHAPES)}), {DEFAULT_NAME!r}, a registered model "
        f"({', '.join(MODELS)}), a .gguf file nor a model folder with config.json"
    )


def build_model(name: str, device: str = "cuda") -> CausalLM:
    """The bf16 model `--model name` names: random weights of a shape, or a checkpoint through the loader."""
    if model_source(name) == "checkpoint":
        return load_target(name, dtype="bfloat16", device=device)
    return random_model(ArchConfig(**SHAPES[name]), device)


def random_model(arch: ArchConfig, device: str = "cuda") -> CausalLM:
    """A bf16 model of `arch` with N(0, 0.02) weights, built on `device` without a CPU copy first."""
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device).to(torch.bfloat16)
    if arch.tie_word_embeddings:  # to_empty gives the head its own tensor: the tie is made again, as the loader does
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(arch).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def hbm_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def table_blocks(ctx: int, tree: int, block_size: int, table: int = 0) -> int:
    """Blocks of one sequence's table in `graphed_step`: its ctx + tree positions, or `table` positions if wider."""
    return -(-max(ctx + tree, table) // block_size)


def graphed_step(model: CausalLM, batch: int, ctx: int, tree: int = 1, block_size: int = 16, table: int = 0):
    """One paged forward captured as a CUDA graph: decode (tree=1) or a verify of `tree` tokens per sequence
    after `ctx` cached ones, each sequence's block table `table` positions wide where that is more (an engine's:
    its longest context, from which the attention kernels choose their split count) and else just wide enough.
    Returns (graph, held, logits): `held` holds everything the graph reads or writes that was made outside it (the
    cache, token ids, positions, the metadata's tables, lengths and slots) and must live as long as the graph is
    replayed: a graph keeps no tensor alive, and a later capture's `empty_cache` returns freed blocks to the
    driver, so a replay of a graph whose inputs were dropped reads unmapped memory (how multi-variant runs on the
    1.5B's shape faulted at their first replay); the logits are the graph's output (the same token ids for a shape
    in every call, so variants compare)."""
    dev = model.lm_head.weight.device
    per_seq = table_blocks(ctx, tree, block_size, table)
    cache = model.make_cache(batch * per_seq + 1, block_size)
    tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
    n = batch * tree
    pos = torch.arange(ctx, ctx + tree, device=dev).repeat(batch)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=dev)).flatten(1)[:, ctx : ctx + tree]
    mode = "decode" if tree == 1 else "verify"
    mask = torch.ones(tree, tree, dtype=torch.bool, device=dev).tril().expand(batch, tree, tree).contiguous()
    meta = AttnMetadata(
        mode,
        torch.arange(0, n + 1, tree, dtype=torch.int32, device=dev),
        torch.full((batch,), ctx + tree, dtype=torch.int32, device=dev),
        tables,
        slots.flatten().long(),
        tree,
        mask if mode == "verify" else None,
    )
    gen = torch.Generator(device=dev).manual_seed(batch * 100_003 + ctx * 101 + tree)
    ids = torch.randint(0, model.arch.vocab_size, (n,), device=dev, generator=gen)
    with torch.no_grad():
        for _ in range(2):
            model.forward_paged(ids, pos, cache, meta)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model.forward_paged(ids, pos, cache, meta)
    return g, (cache, ids, pos, meta), out.logits


def step_cost(
    model: CausalLM, batch: int, ctx: int, tree: int, block_size: int = 16, iters: int = 30, table: int = 0
) -> float:
    """Median seconds of one graphed paged forward: decode (tree=1) or a verify of `tree` tokens."""
    g, held, _ = graphed_step(model, batch, ctx, tree, block_size, table)
    sec = time_replays(g, iters)
    del g, held
    torch.cuda.empty_cache()
    return sec


def time_replays(g: torch.cuda.CUDAGraph, iters: int) -> float:
    """Median seconds of one replay of `g` over `iters` replays, each timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def append_jsonl(path: str | None, rows: list[dict]) -> None:
    """Append `rows` to the JSON-lines file at `path` (nothing when path is None)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def kernel_table(prof, per: int) -> list[tuple[str, float, float]]:
    """(kernel name, us, launches) per `per` units (steps, replays) from a finished torch profiler, by time."""
    return [(name, us / per, n / per) for name, us, n in kernel_rows(prof.events())]


def print_kernel_table(rows: list[tuple[str, float, float]], title: str, top: int = 14) -> None:
    total, launches = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{title}: {total / 1e3:.3f} ms of kernels, {launches:.0f} launches")
    for name, us, n in rows[:top]:
        print(f"  {us:9.1f} us {n:6.1f}x  {name[:100]}")


def step_summary(rows: list[tuple[str, float, float]], layers: int, replay_s: float) -> str:
    """One step's kernel count, per layer and outside the layers, and the kernels' summed time against the
    graph's replay time. A kernel launched k * layers + r times a step counts k per layer and r outside them
    (embedding, final norm, LM head); `rows` are `kernel_table`'s per step."""
    launches = [round(n) for _, _, n in rows]
    per_layer, outside = sum(n // layers for n in launches), sum(n % layers for n in launches)
    kernels_ms, replay_ms = sum(r[1] for r in rows) / 1e3, replay_s * 1e3
    gaps = replay_ms - kernels_ms
    return (
        f"{sum(launches)} kernels a step: {per_layer} per layer x {layers} layers + {outside} outside them; "
        f"kernels {kernels_ms:.3f} ms of a {replay_ms:.3f} ms replay, {gaps:.3f} ms "
        f"({100 * gaps / replay_ms:.0f}%) between kernels"
    )


def print_breakdown(model: CausalLM, batch: int, ctx: int, replays: int = 20, top: int = 14, table: int = 0) -> None:
    """Kernel time per decode step by kernel name (torch profiler over graph replays), then `step_summary`."""
    from torch.profiler import ProfilerActivity, profile

    g, held, _ = graphed_step(model, batch, ctx, table=table)
    g.replay()
    torch.cuda.synchronize()
    replay_s = time_replays(g, replays)  # outside the profiler, which slows the replays down
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    rows = kernel_table(prof, replays)
    print_kernel_table(rows, f"kernel breakdown, batch {batch} ctx {ctx}, per step", top)
    print(step_summary(rows, model.arch.num_hidden_layers, replay_s))
    layers = model.arch.num_hidden_layers
    per_step = {name: round(n) for name, _, n in rows}

    def role(name: str, k: int) -> str:
        """The kernel's place in the step: its i-th launch in a layer (of n a layer), or after the layers."""
        n = per_step.get(name, 0)
        k %= max(n, 1)
        per_layer = n // layers
        if per_layer > 1 or n % layers:
            where = f"#{k % per_layer + 1}/{per_layer} a layer" if k < per_layer * layers else "after the layers"
            return f"{name[:60]} ({where})"
        return name

    exposed = [
        (name, ex / replays, busy / replays, n / replays) for name, ex, busy, n in exposed_by(prof.events(), role)
    ]
    total = sum(r[1] for r in exposed)
    print(f"exposed kernel time (what each adds to the step's timeline, overlaps counted once): {total / 1e3:.3f} ms")
    for name, ex, busy, n in exposed[:top]:
        print(f"  {ex:9.1f} us exposed {busy:9.1f} us busy {n:6.1f}x  {name[:90]}")
    del g, held
    torch.cuda.empty_cache()


def weight_bytes(model: CausalLM) -> int:
    """Weight bytes one step reads: every parameter once, except an untied embedding table (only its looked-up
    rows are read); a tied one is the LM head and counts once (parameters() yields a shared tensor once)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or tied)


def floor_seconds(model: CausalLM, batch: int, ctx: int, tree: int, bandwidth: float) -> float:
    """(weight bytes + bf16 KV bytes read) / bandwidth, for `tree` tokens per sequence after `ctx` cached ones."""
    a = model.arch
    kv = batch * (ctx + tree) * a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 2
    return (weight_bytes(model) + kv) / bandwidth


def print_rows(rows: list[dict]) -> None:
    """The table of `main`'s rows; "% of floor" is floor / measured."""
    width = max([12, *(len(r["model"]) for r in rows)])
    print(f"{'model':{width}} {'batch':>5} {'ctx':>6} {'tokens':>6} {'ms':>8} {'floor ms':>8} {'% of floor':>10}")
    for r in rows:
        print(
            f"{r['model']:{width}} {r['batch']:5d} {r['ctx']:6d} {r['tokens']:6d} {r['ms']:8.3f} "
            f"{r['floor_ms']:8.3f} {100 * r['floor_fraction']:10.1f}"
        )


NORM = {"fused_norm": True}  # one-row steps, its default (at 8 rows it measured 4-6x slower a step)
ROPE = {"fuse_rope": True}
# name -> (KernelGlue keywords, TritonAttention keywords)
VARIANTS = {
    "base": ({}, {}),
    "fused-norm": (NORM, {}),
    "rope-attn": ({}, ROPE),
    "skinny": ({"skinny": True}, {}),
    "fused": (NORM, ROPE),
    "fused+skinny": ({**NORM, "skinny": True}, ROPE),
    # every one-row kernel of the step Triton's (the skinny kernel from weights of 0 elements), launched with PDL
    "pdl": ({**NORM, "skinny": True, "skinny_min_weight": 0, "pdl": True}, {**ROPE, "pdl": True}),
    "pdl+prefetch": (
        {**NORM, "skinny": True, "skinny_min_weight": 0, "pdl": True, "prefetch": True},
        {**ROPE, "pdl": True},
    ),
    # the chain for steps of up to 64 rows too (rollout.decode_chain_rows): 9+ rows' products on tensor cores
    "pdl-rows": (
        {**NORM, "skinny": True, "skinny_min_weight": 0, "pdl": True, "norm_rows": 64, "skinny_rows": 64},
        {**ROPE, "pdl": True},
    ),
    # the chain of up to 64 rows with the add + norm of more than one row in the compiled glue and their products
    # through kernels.rows_gemm (KNOBS: skinny_gemm.DOT_KERNEL "split")
    "pdl-rows2": (
        {**NORM, "skinny": True, "skinny_min_weight": 0, "pdl": True, "norm_rows": 1, "skinny_rows": 64},
        {**ROPE, "pdl": True},
    ),
    # the same, each kernel's programs signalling the next at the end of their main loop (kernels.pdl.SIGNAL_AT_END)
    "pdl-end": ({**NORM, "skinny": True, "skinny_min_weight": 0, "pdl": 2}, {**ROPE, "pdl": 2}),
    "pdl-end+prefetch": (
        {**NORM, "skinny": True, "skinny_min_weight": 0, "pdl": 2, "prefetch": True},
        {**ROPE, "pdl": 2},
    ),
}
SKINNY, ROPE_ATTN = "tlt_rt.codegen.kernels.skinny_gemm", "tlt_rt.codegen.kernels.decode_rope_attention"
PDL = "tlt_rt.codegen.kernels.pdl"
STREAMED = {(SKINNY, "WHOLE_ELEMS"): 0}  # rows wider than one tile streamed in tiles, not loaded whole
LATE_KV = {(ROPE_ATTN, "EARLY_LOADS"): False}  # attention reads nothing before its wait
# pdl with some of the chain's kernel settings as they were before: name -> (module, attribute) -> value, set while
# the variant's graphs are captured (the launches' constexprs are fixed there)
FOUR_ROWS = {(SKINNY, "ONE_ROW_WIDE"): {"block_n": 4, "block_k": 2048, "num_warps": 4, "num_stages": 3}}
ONE_ROW = {(SKINNY, "ONE_ROW_NARROW"): {"block_n": 1, "block_k": 2048, "num_warps": 2, "num_stages": 2}}
# one row's products broadcast over three dimensions (the slab converted through shared memory), with the wide
# launch tuned for them: the chain as it was at 925a864
THREE_D = {(SKINNY, "ROW_FLAT"): False,
           (SKINNY, "ONE_ROW_WIDE"): {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3}}  # fmt: skip
KNOBS = {
    "pdl-streamed": STREAMED,
    "pdl-late-kv": LATE_KV,
    "pdl-four-rows": FOUR_ROWS,  # gate/up and the head in programs of 4 rows over 4 warps (SKINNY_META[1])
    "pdl-one-row": ONE_ROW,  # q/k/v, o and down in programs of one row over 2 warps, not 2 rows over 4
    "pdl-3d": THREE_D,
    # launches of these classes signal before their wait (kernels.pdl.SIGNAL_FIRST): the kernel after attention
    # (o) placed while q/k/v runs, the one after o (gate/up) while attention runs, ..., or every kernel of the chain
    "pdl-first-attn": {(PDL, "SIGNAL_FIRST"): frozenset({"attention"})},
    "pdl-first-o": {(PDL, "SIGNAL_FIRST"): frozenset({"narrow"})},
    "pdl-first-attn-o": {(PDL, "SIGNAL_FIRST"): frozenset({"attention", "narrow"})},
    "pdl-first-all": {(PDL, "SIGNAL_FIRST"): frozenset({"attention", "norm", "narrow", "long", "wide"})},
    "pdl-before": {**STREAMED, **LATE_KV, **THREE_D, **FOUR_ROWS, **ONE_ROW},
}
for _name in KNOBS:
    VARIANTS[_name] = VARIANTS["pdl"]
ROWS_SPLIT = {(SKINNY, "DOT_KERNEL"): "split"}
KNOBS["pdl-rows2"] = ROWS_SPLIT


def wide_variant(name: str) -> bool:
    """`pdl:bn=..,bk=..,w=..,s=..`: pdl with the one-row launch meta for weights of many rows whose rows fit one
    tile (gate/up, the head; `skinny_gemm.ONE_ROW_WIDE`) set from the name, keys left out kept;
    `pdl:narrow:bn=..` the same for weights of fewer rows (q/k/v, o, down: `skinny_gemm.ONE_ROW_NARROW`);
    `pdl:attn:bn=..,w=..,s=..,sw=..,mt=..,r=..` decode attention's (`decode_rope_attention.DECODE_META`, sw its
    split_waves, mt the merge's tile in fp32 elements, r a cap on registers a thread, tm=1 the merge over the
    group's rows); `pdl:tree:bm=..,mt=..,w=..` tree attention's of the verify rows (`tree_attention.TREE_META`, bm its
    row block, mt its combine's tile); `pdl:dot:bn=..` /
    `pdl:dotnarrow:bn=..` the tensor-core launch of 9-64 rows for weights of many / fewer rows
    (`skinny_gemm.DOT_META` / `DOT_NARROW`); `pdl-rows2:split:bn=..,bk=..,w=..,s=..,p=..,t=..` the launch of
    `kernels.rows_gemm` (`ROWS_META`, p its programs, t the fewest tiles a program). `pc=1`: rows within one tile
    in power-of-two pieces, not padded (meta "pieces", `row_tiles`). `f=0|1` (any kind) sets
    `skinny_gemm.ROW_FLAT`: one row's products broadcast over three dimensions or in the slab's layout (the
    default). `pdl-rows:...` the same on the chain of up to 64 rows. Registers the variant; False for other names."""
    base, colon, rest = name.partition(":")
    if not colon or base not in ("pdl", "pdl-rows", "pdl-rows2"):
        return False
    from tlt_rt.codegen.kernels import decode_rope_attention, rows_gemm, skinny_gemm, tree_attention

    keys = {"bn": "block_n", "bk": "block_k", "w": "num_warps", "s": "num_stages", "sw": "split_waves",
            "pc": "pieces", "p": "programs", "t": "min_tiles", "mt": "merge_tile", "r": "maxnreg",
            "tm": "tight_merge", "bm": "block_m"}  # fmt: skip
    kind, _, spec = rest.rpartition(":")
    module, attr = {
        "": (skinny_gemm, "ONE_ROW_WIDE"),
        "narrow": (skinny_gemm, "ONE_ROW_NARROW"),
        "attn": (decode_rope_attention, "DECODE_META"),
        "tree": (tree_attention, "TREE_META"),
        "dot": (skinny_gemm, "DOT_META"),
        "dotnarrow": (skinny_gemm, "DOT_NARROW"),
        "split": (rows_gemm, "ROWS_META"),
    }.get(kind, (None, None))
    if module is None:
        raise ValueError(
            f"{name}: expected pdl:, pdl:narrow:, pdl:attn:, pdl:tree:, pdl:dot:, pdl:dotnarrow: or pdl-rows2:split: "
            "before settings"
        )
    meta = dict(getattr(module, attr))
    knobs = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key == "f" and value in ("0", "1"):
            knobs[(SKINNY, "ROW_FLAT")] = value == "1"
            continue
        if key not in keys or not value.isdigit():
            raise ValueError(
                f"{name}: expected pdl:bn=..,bk=..,w=..,s=..,pc=..,mt=..,r=..,tm=..,bm=..,f=0|1 (any of them), "
                f"got {item!r}"
            )
        meta[keys[key]] = int(value)
    KNOBS[name] = {(module.__name__, attr): meta, **KNOBS.get(base, {}), **knobs}
    VARIANTS[name] = VARIANTS[base]
    return True


def compare_variants(model: CausalLM, args, bw: float) -> list[dict]:
    """`--compare`: every shape captured under each variant's glue, then replays in interleaved rounds."""
    from tlt_rt.codegen.backend import TritonAttention
    from tlt_rt.codegen.model_kernels import KernelGlue
    from tlt_rt.models.layers import set_glue

    base = model.compile_glue(KernelGlue())  # compiled once; the other variants share its compiled pieces
    glues = {name: KernelGlue(pieces=base, **VARIANTS[name][0]) for name in args.compare}
    backends = {name: TritonAttention(**VARIANTS[name][1]) for name in args.compare}

    knobs = {key for name in args.compare for key in KNOBS.get(name, {})}
    defaults = {key: getattr(importlib.import_module(key[0]), key[1]) for key in knobs}

    def use(name: str) -> None:
        set_glue(model, glues[name])
        model.attn_backend = backends[name]
        for key, default in defaults.items():
            setattr(importlib.import_module(key[0]), key[1], KNOBS.get(name, {}).get(key, default))

    if args.profile:
        for name in glues:
            use(name)
            print(f"--- {name}")
            print_breakdown(model, args.batch[0], args.ctx[0], table=args.table)
    rows = []
    for ctx in args.ctx:
        for b in args.batch:
            for t in [1, *args.verify]:
                graphs = {}
                for name in glues:
                    use(name)
                    graphs[name] = graphed_step(model, b, ctx, t, table=args.table)
                times: dict[str, list[float]] = {name: [] for name in glues}
                for r in range(args.rounds):
                    for name, (g, _, _) in graphs.items():
                        try:
                            times[name].append(time_replays(g, args.iters))
                        except RuntimeError:  # a fault surfaces at the next sync: name the graph it surfaced in
                            print(f"replaying {name} (batch {b}, ctx {ctx}, tokens {t}, round {r}) failed; captured: "
                                  f"{', '.join(graphs)}", flush=True)  # fmt: skip
                            raise
                fl = floor_seconds(model, b, ctx, t, bw)
                first = statistics.median(times[args.compare[0]])
                ref = graphs[args.compare[0]][2].float()
                for name in glues:
                    sec = statistics.median(times[name])
                    logits = graphs[name][2]
                    rows.append(dict(model=args.model, label=name, batch=b, ctx=ctx, table=args.table, tokens=t,
                                     ms=sec * 1e3,
                                     floor_ms=fl * 1e3, pct_floor=100 * fl / sec, floor_fraction=fl / sec,
                                     vs_first=first / sec, hbm_gbs=bw / 1e9, logits_digest=digest(logits),
                                     max_diff_vs_first=(logits.float() - ref).abs().max().item(),
                                     device=torch.cuda.get_device_name()))  # fmt: skip
                del graphs
                torch.cuda.empty_cache()
    set_glue(model, base)
    model.attn_backend = TritonAttention()
    for key, default in defaults.items():
        setattr(importlib.import_module(key[0]), key[1], default)
    return rows


def digest(t: torch.Tensor) -> str:
    """A short hash of a tensor's bytes: equal outputs of two variants read the same."""
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:10]


def print_compare(rows: list[dict], first: str) -> None:
    print(
        f"variants side by side (median over interleaved rounds); 'x {first}': {first}'s ms over the variant's; "
        f"logits: a hash of the step's output (the last replay's) and its largest difference from {first}'s"
    )
    print(f"{'variant':18} {'batch':>5} {'ctx':>6} {'tokens':>6} {'ms':>8} {'floor ms':>8} {'% of floor':>10} "
          f"{'x ' + first:>10} {'logits':>10} {'max diff':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['label']:18} {r['batch']:5d} {r['ctx']:6d} {r['tokens']:6d} {r['ms']:8.3f} {r['floor_ms']:8.3f} "
              f"{r['pct_floor']:10.1f} {r['vs_first']:10.3f} {r['logits_digest']:>10} "
              f"{r['max_diff_vs_first']:9.2e}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="qwen2.5-7b",
        help=f"a shape ({', '.join(SHAPES)}), {DEFAULT_NAME}, a registered model ({', '.join(MODELS)}), "
        "a .gguf file or a converted model folder",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--table", type=int, default=0, metavar="POSITIONS",
                    help="each sequence's block table at least this wide, as an engine's of that longest "
                    "context (attention chooses its splits from it); 0: just wide enough for the context")  # fmt: skip
    ap.add_argument("--verify", type=int, nargs="*", default=[16, 48])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager-glue", action="store_true", help="plain-torch norms/rotary/activation, as before fusion")
    ap.add_argument("--unfused", action="store_true", help="separate q/k/v and gate/up matmuls")
    ap.add_argument("--skinny", action="store_true", help="one-row matmuls of large weights through the Triton kernel")
    ap.add_argument(
        "--skinny-min-weight",
        type=int,
        default=None,
        help="with --skinny: the smallest weight (elements) the kernel takes (default its MIN_WEIGHT)",
    )
    ap.add_argument("--no-fused-rope", action="store_true", help="rotary and the KV write as separate kernels")
    ap.add_argument("--separate-merge", action="store_true", help="split-K partials merged by a second kernel")
    ap.add_argument("--decode-meta", default=None, help="JSON file of decode attention meta-parameters to use")
    ap.add_argument("--profile", action="store_true", help="kernels of the first decode shape: time, count, gaps")
    ap.add_argument("--label", default="", help="tag written into each row (variant under test)")
    ap.add_argument("--compare", nargs="+", default=None, metavar="VARIANT",
                    help=f"glue variants side by side, the first the baseline ({', '.join(VARIANTS)}; "
                         "pdl[-rows|-rows2]:[narrow:|attn:|dot:|dotnarrow:|split:]bn=..,.. for pdl with another "
                         "launch setting: see wide_variant)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="with --compare: interleaved rounds of --iters replays")
    args = ap.parse_args(argv)
    for name in args.compare or []:
        try:
            if not (name in VARIANTS or wide_variant(name)):
                ap.error(
                    f"--compare: unknown variant {name!r}; one of {', '.join(VARIANTS)} or "
                    "pdl[-rows|-rows2]:[narrow:|attn:|dot:|dotnarrow:|split:]bn=.."
                )
        except ValueError as e:
            ap.error(str(e))
    if args.compare and (args.eager_glue or args.skinny or args.no_fused_rope):
        ap.error("--compare builds each variant's glue itself: leave out --eager-glue, --skinny, --no-fused-rope")
    try:
        model_source(args.model)
    except ValueError as e:
        ap.error(str(e))
    from tlt_rt.codegen.backend import select_backend

    if args.decode_meta:  # e.g. the best of `bench_attention.py --tune --best-out`
        from tlt_rt.codegen.kernels import decode_attention

        with open(args.decode_meta) as f:
            decode_attention.DECODE_META.update(json.load(f))
        print(f"decode meta-parameters: {decode_attention.DECODE_META}")
    if args.separate_merge:
        from tlt_rt.codegen.kernels import decode_attention

        decode_attention.split_counters = lambda device, n: None  # the launchers then merge in a second kernel
    bw = hbm_bandwidth()
    model = build_model(args.model)
    model.attn_backend = select_backend("cuda")
    if args.compare:
        if args.skinny_min_weight is not None:
            from tlt_rt.codegen.kernels import skinny_gemm

            skinny_gemm.MIN_WEIGHT = args.skinny_min_weight
        if not args.unfused:
            model.fuse_projections()
        rows = compare_variants(model, args, bw)
        print(f"HBM copy bandwidth: {bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
        print_compare(rows, args.compare[0])
        append_jsonl(args.out, rows)
        return
    if not args.eager_glue:  # the fused RMSNorm / rotary / SwiGLU the engine runs with on CUDA
        from tlt_rt.codegen.model_kernels import KernelGlue

        if args.skinny_min_weight is not None:
            from tlt_rt.codegen.kernels import skinny_gemm

            skinny_gemm.MIN_WEIGHT = args.skinny_min_weight
        model.compile_glue(KernelGlue(skinny=args.skinny, fused_rope=not args.no_fused_rope))
    if not args.unfused:
        model.fuse_projections()
    if args.profile:
        print_breakdown(model, args.batch[0], args.ctx[0], table=args.table)
    rows = []
    for ctx in args.ctx:
        for b in args.batch:
            for t in [1, *args.verify]:
                t0 = time.perf_counter()
                sec = step_cost(model, b, ctx, t, iters=args.iters, table=args.table)
                fl = floor_seconds(model, b, ctx, t, bw)
                rows.append(
                    dict(
                        model=args.model,
                        label=args.label,
                        batch=b,
                        ctx=ctx,
                        table=args.table,
                        tokens=t,
                        ms=sec * 1e3,
                        floor_ms=fl * 1e3,
                        pct_floor=100 * fl / sec,
                        floor_fraction=fl / sec,
                        hbm_gbs=bw / 1e9,
                        device=torch.cuda.get_device_name(),
                        wall=time.perf_counter() - t0,
                    )
                )
    print(f"HBM copy bandwidth: {bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
    print_rows(rows)
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
