"""Tensor-parallel decode throughput: tokens/s of one engine at TP=N (default 2) against TP=1, random weights.

    python benchmarks/tp_throughput.py --shape qwen2.5-7b --batch 1 8 32 --max-new-tokens 128
    python benchmarks/tp_throughput.py --shape qwen2.5-32b --tp 4 --scale 0.5    # 32 of the 64 layers, 4 GPUs
    python benchmarks/tp_throughput.py --shape llama3-70b --scale 0.25     # 20 of the 80 layers
    python benchmarks/tp_throughput.py --smoke [--tp 4]                    # tiny shape, CPU, gloo, seconds
    python benchmarks/tp_throughput.py --batch 1 --profile tp-profile      # also where each row's time went
    python benchmarks/tp_throughput.py --batch 1 32 --allreduce oneshot fused --chain --pdl   # fused sums, PDL
    python benchmarks/tp_throughput.py --batch 1 --allreduce oneshot --chain --pdl --chain-max-weight 16777216
                                                        # the chain for weights of up to 16M elements, cuBLAS above
    python benchmarks/tp_throughput.py --batch 1 --allreduce oneshot --rounds 3 --pdl --chain-variants 0 16777216
                                                        # beside the default engines, the chain and the limited one

N processes (torch.multiprocessing spawn) form one group: NCCL on GPUs (NVLink multicast off), gloo on
CPU. Rank 0 first runs the unsharded model alone (TP=1: `--scale` keeps as many layers as one GPU holds);
then every rank cuts the same weights with `shard_for_tp` and runs the lockstep engine (TP=N). Greedy, plain
decoding (SD off: this measures the target's sharding), no stop tokens, so every run emits batch x
max_new_tokens tokens; `equal` says whether TP=N emitted exactly TP=1's tokens (in bf16 a different reduction
order may flip a near-tie; fp32 on CPU must match). ms/step is the timed generate's wall time over its decode
steps (prefill included). The markdown table is printed last.

`--profile DIR` profiles one more generate per row on rank 0 (torch profiler, `tlt_rt.train.profile.profiled`):
where a TP=N step's time goes beside TP=1's: matmuls, collectives, host waits between kernels.

`--host-profile DIR` runs one more generate per row under cProfile on rank 0 (every rank runs it): the engine
loop's host functions by own and by cumulative time, where a TP=N step's host work beyond TP=1's goes (a
lockstep broadcast, a wait on the device, the postprocessing).

`--overlap on off` times each plain engine with its steps queued one ahead of the host's postprocessing
(`rollout.overlap`, the default) and one step at a time (rows `plain serial`, priced in the last column against
`plain`): the host work the overlap hides.

`--no-overlap-speculative` runs the speculative engines' steps one at a time (`rollout.overlap_speculative`).

`--chain-variants W [W ...]` (with `--rounds`) adds plain engines with the decode chain (`rollout.decode_chain`, with
`--pdl` launched with PDL) whose Triton kernels take weights of at most W elements (`rollout.decode_chain_max_weight`;
0: all), TP=1 and TP=N, each over a model and shard of its own (an engine sets its model's kernels), timed in the same
interleaved rounds as the default engines: rows `plain chain<=W` (`plain chain` for 0), priced against `plain`.

`--rounds R` (R > 1) keeps every engine, TP=1's beside TP=N's, and times them in R interleaved rounds: round 0
captures and warms each up and times one generate, as a single round does; each round after it times one more
generate of every engine in turn (the TP=1 ones on rank 0 while the other ranks wait). A row's tok/s and ms/step
are then the median round's, and `x TP=1` the median over rounds of its tokens/s over the TP=1 row of the same mode
in the same round (one `--allreduce` kind: the kinds share one shard). With `--sd` the drafter's feature layers
are set on the model the plain engines share, so their steps hand those layers' outputs on too (a few adds a step),
at TP=1 and TP=N alike.

`--sd STRATEGY` also times speculative decoding with that strategy at TP=1 and TP=N: a drafter of random
weights (the same on every rank, replicated: it reads the target's full embedding and head, `TargetHeads`, its
own head over `--draft-vocab` ids as trained drafters have), greedy, so its tokens must again be TP=1's plain
ones. Its accept length is that of an untrained drafter, so what the rows tell is the cost of a speculative step:
`SD/plain` is its ms per step over the plain engine's at the same TP and batch. `--drafter-tp shard replicate`
times the TP=N engine's speculative steps with the drafter's decoder layer cut like the target's
(`shard_drafter_for_tp`) and whole on every rank, a row each (default `auto`: `lockstep_engine`'s rule, by the
layer's size).
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import os
import pstats
import signal
import socket
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tlt_rt.models.arch import ArchConfig  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.models.llama import CausalLM  # noqa: E402
from tlt_rt.models.shapes import KNOWN_SHAPES  # noqa: E402
from tlt_rt.models.tensor_parallel import (  # noqa: E402
    ALLREDUCE_KINDS,
    DRAFTER_TP_KINDS,
    check_tp_divisible,
    shard_for_tp,
    use_allreduce,
)
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.rollout.lockstep import TargetHeads, host_group_for, lockstep_engine  # noqa: E402
from tlt_rt.train.profile import CALLER_OPS, profiled  # noqa: E402

SMOKE = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip


def arch_for(args) -> ArchConfig:
    if args.smoke:  # as many KV heads as ranks, two query heads each: the tiny shape shards at any --tp
        kv = max(SMOKE["num_key_value_heads"], args.tp)
        arch = ArchConfig(**{**SMOKE, "num_key_value_heads": kv, "num_attention_heads": 2 * kv})
    else:
        arch = ArchConfig(**KNOWN_SHAPES[args.shape])
    layers = max(1, round(arch.num_hidden_layers * args.scale))
    return replace(arch, num_hidden_layers=layers)


def build(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Random weights, identical on every rank (same seed, same device type)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = CausalLM(arch)
        with torch.no_grad():  # checkpoint-like scale, so logits stay finite in bf16
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def timed(engine: Engine, prompts, max_new: int, device) -> tuple[list[list[int]], float, int, str]:
    """(tokens, seconds, decode steps, a line on the setup's seconds) of one timed greedy generate, after a short
    untimed one of the same prompts, with every step of this batch size and below captured first: they would
    otherwise be captured (and their glue compiled) inside the timed call on first use: seconds, once read as TP=2
    at batch 8 timing 41 tok/s against 396 at batch 1."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=[])
    t_start = time.perf_counter()
    # the batch's bucket (plain steps keep every sequence to the end: no stop tokens, max_new_tokens each) and, for
    # speculation, whose sequences finish at different steps, every bucket below it; then a short run of the prompts
    top = engine.bucket(len(prompts))
    sizes = [bk for bk in engine.buckets if bk <= top] if engine.speculative != "off" else [top]
    engine.capture(sizes, False, ("greedy",))
    t_capture = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[]))  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_warm = time.perf_counter()
    outs, secs, steps = timed_generate(engine, prompts, params, device)
    # where a slow run's time went (a capture compiles the step's glue): untimed work beside the timed call
    setup = (f"capture {t_capture - t_start:.1f} s (buckets {sizes}), warm-up {t_warm - t_capture:.1f} s, "
             f"timed {secs:.1f} s")  # fmt: skip
    return [o.token_ids for o in outs], secs, max(1, steps), setup


def timed_generate(engine: Engine, prompts, params: SamplingParams, device) -> tuple[list, float, int]:
    """(completions, seconds, decode steps) of one generate, the device drained before and after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    secs, after = time.perf_counter() - t0, engine.stats()
    return outs, secs, sum(after[k] - before[k] for k in ("decode_steps", "sd_steps"))


def drafter_for(arch: ArchConfig, target, device: torch.device, draft_vocab: int = 0) -> Drafter:
    """A drafter of random weights, identical on every rank (same seed), in the target's dtype; with draft_vocab > 0
    (and under the vocabulary's size) its head covers that many target ids, as a trained drafter's reduced head
    does (the first ids: what the head costs does not depend on which)."""
    torch.manual_seed(7)
    dtype = next(target.parameters()).dtype
    d2t = torch.arange(draft_vocab) if 0 < draft_vocab < arch.vocab_size else None
    with device:
        drafter = Drafter(arch, target, draft_vocab=d2t).to(dtype)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return drafter.eval()


def bare_step_ms(engine, batch: int, ctx: int, device, n: int = 20) -> float:
    """ms of one bare step of the engine's captured plain or speculative graph (inputs filled, replayed, its result
    copied to the host; `ModelRunner.synthetic_step`), no scheduling: what a timed row's ms/step pays beyond it is
    the engine loop's own host work. Collective: every rank calls it alike (the step's sums run inside it)."""
    strategy = engine.strategies[0] if engine.speculative != "off" else None
    step = engine.runner.synthetic_step(batch, strategy, "greedy", ctx)
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return 1e3 * (time.perf_counter() - t0) / n


def run_rows(engine, tp: str, mode: str, args, arch, device, ref, rows, rank: int) -> None:
    """Time `engine` at every batch size; rank 0 records (tp, batch, mode, tok/s, ms/step, equal to ref), tp the
    row's label: the rank count, and the all-reduce where it is not NCCL ("2 oneshot")."""
    g = torch.Generator().manual_seed(1)  # the same prompts for every engine
    for b in args.batch:
        prompts = torch.randint(0, arch.vocab_size, (b, args.prompt_len), generator=g).tolist()
        toks, secs, steps, setup = timed(engine, prompts, args.max_new_tokens, device)
        if ref is not None and b not in ref:
            ref[b] = toks
        bare = bare_step_ms(engine, b, args.prompt_len + args.max_new_tokens // 2, device)
        if rank == 0:
            equal = "-" if tp == "1" and mode == "plain" else ("yes" if toks == ref[b] else "NO")
            rows.append((tp, b, mode, b * args.max_new_tokens / secs, 1e3 * secs / steps, equal, bare, [secs]))
            print(f"TP={tp} {mode} batch {b}: {rows[-1][3]:.1f} tok/s, {rows[-1][4]:.2f} ms/step (bare step "
                  f"{bare:.2f}), equal {equal} ({setup})", flush=True)  # fmt: skip
        if args.host_profile is not None:  # one more generate under cProfile on rank 0 (all ranks run it)
            params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
            prof = cProfile.Profile() if rank == 0 else None
            if prof is not None:
                prof.enable()
            engine.generate(prompts, params)
            if prof is not None:
                prof.disable()
                args.host_profile.mkdir(parents=True, exist_ok=True)
                path = args.host_profile / f"host-tp{tp}-{mode}-b{b}.txt".replace(" ", "-")
                with path.open("w") as f:
                    f.write(f"# TP={tp} {mode}, batch {b}: one generate of {args.max_new_tokens} tokens, cProfile, "
                            f"rank 0\n")  # fmt: skip
                    for key in ("tottime", "cumulative"):
                        pstats.Stats(prof, stream=f).sort_stats(key).print_stats(30)
                print(f"  host profile: {path}", flush=True)
        if args.profile is not None:  # one more generate of the same prompts, profiled on rank 0 (all ranks run it)
            path = args.profile / f"tp{tp}-{mode}-b{b}.txt".replace(" ", "-") if rank == 0 else None
            params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
            with profiled(path, f"TP={tp} {mode}, batch {b}: one generate of {args.max_new_tokens} tokens", device,
                          CALLER_OPS):  # fmt: skip
                engine.generate(prompts, params)
            if path is not None:
                print("  " + "\n  ".join(path.read_text().splitlines()[1:3]), flush=True)  # wall and kernels by kind


def time_rounds(engines: list, args, arch, device, ref: dict, rows: list, rank: int) -> None:
    """`--rounds`: every engine of `engines` [(tp label, mode, engine or None where this rank has none)] at each
    batch size in interleaved rounds; rank 0 records each row as `run_rows` does, with every round's seconds and
    the median round's tok/s and ms/step. A TP=1 engine runs on rank 0 alone; before every TP=N engine's call the
    ranks meet at a barrier, so each call starts on all of them together."""
    g = torch.Generator().manual_seed(1)  # the prompts `run_rows` gives each batch
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
    for b in args.batch:
        prompts = torch.randint(0, arch.vocab_size, (b, args.prompt_len), generator=g).tolist()
        secs: list[list[float]] = [[] for _ in engines]
        first: list[tuple | None] = [None] * len(engines)
        for r in range(args.rounds):
            for i, (tp, _mode, engine) in enumerate(engines):
                if tp != "1":
                    dist.barrier()
                if engine is None:
                    continue
                if r == 0:  # capture, warm-up, then the first timed call
                    toks, s, steps, setup = timed(engine, prompts, args.max_new_tokens, device)
                    first[i] = (toks, steps, setup)
                else:
                    s = timed_generate(engine, prompts, params, device)[1]
                secs[i].append(s)
            if rank == 0:  # each round as it ends: a run cut short keeps what it measured
                done = ", ".join(f"TP={tp} {mode} {1e3 * secs[i][-1] / first[i][1]:.2f}"
                                 for i, (tp, mode, engine) in enumerate(engines) if engine is not None)  # fmt: skip
                print(f"round {r + 1}/{args.rounds}, batch {b}, ms/step: {done}", flush=True)
        for i, (tp, mode, engine) in enumerate(engines):
            if tp != "1":
                dist.barrier()
            if engine is None:
                continue
            toks, steps, setup = first[i]
            if ref is not None and b not in ref:
                ref[b] = toks
            bare = bare_step_ms(engine, b, args.prompt_len + args.max_new_tokens // 2, device)
            if rank == 0:
                mid = sorted(secs[i])[len(secs[i]) // 2]
                equal = "-" if tp == "1" and mode == "plain" else ("yes" if toks == ref[b] else "NO")
                rows.append((tp, b, mode, b * args.max_new_tokens / mid, 1e3 * mid / max(1, steps), equal, bare,
                             secs[i]))  # fmt: skip
                spread = f"{1e3 * min(secs[i]) / steps:.2f}-{1e3 * max(secs[i]) / steps:.2f}"
                print(
                    f"TP={tp} {mode} batch {b}: {rows[-1][3]:.1f} tok/s, {rows[-1][4]:.2f} ms/step over "
                    f"{len(secs[i])} rounds ({spread}; bare step {bare:.2f}), equal {equal} ({setup})",
                    flush=True,
                )


def paired(rows: list) -> dict:
    """(tp, batch, mode) -> the median over rounds of the row's tokens/s over the TP=1 row of the same mode and
    batch in the same round (its seconds over the row's); rows of TP=1, or without a TP=1 twin, have none."""
    whole = {(b, mode): secs for tp, b, mode, *_, secs in rows if tp == "1"}
    out = {}
    for tp, b, mode, *_, secs in rows:
        base = whole.get((b, mode))
        if tp != "1" and base is not None and len(base) == len(secs):
            ratios = sorted(t1 / t for t1, t in zip(base, secs, strict=True))
            out[tp, b, mode] = ratios[len(ratios) // 2]
    return out


FUSED_KEYS = {"bn": "block_n", "bk": "block_k", "w": "num_warps", "s": "num_stages"}


def fused_settings(kind: str) -> tuple[dict | None, int | None, bool | None]:
    """The launch of `--allreduce fused[:bn=4,bk=2048,w=4,s=3,tail=1024,f=0|1]` (meta, tail, flat; None: the
    kernel's own). f: one row's products in the slab's layout (`tp_sum.ROW_FLAT`) or broadcast over three dimensions."""
    _, _, spec = kind.partition(":")
    meta, tail, flat = {}, None, None
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key == "tail":
            tail = int(value)
        elif key == "f" and value in ("0", "1"):
            flat = value == "1"
        elif key in FUSED_KEYS:
            meta[FUSED_KEYS[key]] = int(value)
        else:
            raise ValueError(f"--allreduce {kind}: unknown setting {key!r} (bn, bk, w, s, tail, f=0|1)")
    return meta or None, tail, flat


def allreduce_kind(text: str) -> str:
    """argparse type of --allreduce: nccl, oneshot, or fused with optional launch settings."""
    if text in ALLREDUCE_KINDS or text == "fused":
        return text
    if text.startswith("fused:"):
        try:
            fused_settings(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: one of {ALLREDUCE_KINDS}, fused or fused:bn=..,w=..,s=..,tail=..,f=0|1"
    )


def note(rank: int, t0: float, what: str) -> None:
    """A progress line from rank 0 with the seconds since its start (where a run past its limit spent them)."""
    if rank == 0:
        print(f"[{time.perf_counter() - t0:7.1f} s] {what}", flush=True)


def _rank(rank: int, port: int, args, out: dict) -> None:
    t_rank = time.perf_counter()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` (or `timeout -s USR1`) dumps stacks
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.tp))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.tp, timeout=timedelta(seconds=600))  # fmt: skip
    try:
        dtype = getattr(torch, args.dtype) if cuda else torch.float32
        arch = arch_for(args)
        kw = dict(speculative="off", max_batch=max(args.batch), block_size=16, enforce_eager=args.eager,
                  decode_chain=args.chain, pdl=args.pdl and args.chain,
                  decode_chain_max_weight=args.chain_max_weight)  # fmt: skip
        variants = [(chain_mode(w), dict(kw, decode_chain=True, pdl=args.pdl, decode_chain_max_weight=w))
                    for w in args.chain_variants]  # fmt: skip
        sd = dict(kw, speculative="on", strategies=(args.sd,), overlap_speculative=args.overlap_speculative) if (
            args.sd) else None  # fmt: skip
        rows = []
        ref: dict[int, list] = {}
        plain_modes = [("plain" if ov == "on" else "plain serial", ov == "on") for ov in args.overlap]
        build_args = (args, arch, device, kw, sd, plain_modes, rank, t_rank)
        if args.rounds > 1:  # every engine kept: TP=1's over a whole model of their own, beside the shard's
            whole = build(arch, dtype, device) if rank == 0 else None
            engines = list(whole_engines(whole, *build_args))
            for mode, kw_v in variants:  # each over a model of its own: an engine sets its model's kernels
                whole_v = build(arch, dtype, device) if rank == 0 else None
                engines += whole_engines(whole_v, args, arch, device, kw_v, None, [(mode, True)], rank, t_rank)
            model = build(arch, dtype, device)
        else:  # one engine at a time, timed as it is built
            model = build(arch, dtype, device)
            if rank == 0:  # TP=1: the whole model on one device
                for tp, mode, engine in whole_engines(model, *build_args):
                    run_rows(engine, tp, mode, args, arch, device, ref, rows, rank)
                    del engine
                del model  # the engines set their backend and glue on the model: shard a fresh build
                if cuda:
                    torch.cuda.empty_cache()
                model = build(arch, dtype, device)
        dist.barrier()
        heads = TargetHeads(model) if sd else None  # the replicated drafter's full embedding and head
        host_group = host_group_for()  # the SD policy's choices between the hosts (None under gloo)
        shard = shard_for_tp(model)
        if cuda:
            torch.cuda.empty_cache()
        sums = TPSums(shard, args.pdl, args.tp)
        for kind in args.allreduce:  # the same shard, its sums through each all-reduce in turn (steps captured anew)
            label = sums.use(kind)
            if args.rounds > 1:  # one kind (main checks): time every engine in interleaved rounds
                engines += shard_engines(shard, heads, label, host_group, *build_args)
                for mode, kw_v in variants:
                    shard_v = shard_for_tp(build(arch, dtype, device))
                    TPSums(shard_v, args.pdl, args.tp).use(kind)
                    engines += shard_engines(shard_v, None, label, host_group, args, arch, device, kw_v, None,
                                             [(mode, True)], rank, t_rank)  # fmt: skip
                time_rounds(engines, args, arch, device, ref if rank == 0 else None, rows, rank)
                break
            for tp, mode, engine in shard_engines(shard, heads, label, host_group, *build_args):
                run_rows(engine, tp, mode, args, arch, device, ref if rank == 0 else None, rows, rank)
                del engine
        if rank == 0:
            out["rows"] = rows
            out["arch"] = f"{args.shape if not args.smoke else 'smoke'} ({arch.num_hidden_layers} layers, {dtype})"
    except BaseException:
        dist.destroy_process_group()
        raise
    if cuda:  # every row is done: leave without tearing the group or the interpreter down; both hung CUDA ranks for
        # minutes after their last row (2x H200, NCCL, symmetric memory: an exit at the end of the rank, then
        # destroy_process_group before it, each hung)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def chain_mode(max_weight: int) -> str:
    """The rows' mode of a `--chain-variants` entry."""
    return "plain chain" if max_weight == 0 else f"plain chain<={max_weight}"


def whole_engines(model, args, arch, device, kw: dict, sd: dict | None, plain_modes, rank: int, t_rank: float):
    """TP=1's engines over `model`, built one at a time as (tp label, mode, engine): the plain ones, then the
    speculative one with `--sd`. Without a model (the ranks but 0, under `--rounds`) the same rows, no engine."""
    for mode, overlap in plain_modes:
        engine = None if model is None else Engine(model, **kw, overlap=overlap)
        note(rank, t_rank, f"TP=1 {mode} engine built")
        yield "1", mode, engine
        del engine  # before the next one is built (the caller lets go of its own)
    if sd:
        engine = None
        if model is not None:
            engine = Engine(model, drafter=drafter_for(arch, model, device, args.draft_vocab), **sd)
        note(rank, t_rank, f"TP=1 {args.sd} engine built")
        yield "1", args.sd, engine


def shard_engines(shard, heads, label: str, host_group, args, arch, device, kw: dict, sd: dict | None, plain_modes,
                  rank: int, t_rank: float):  # fmt: skip
    """TP=N's lockstep engines over `shard`, built one at a time as (tp label, mode, engine): the plain ones, then
    with `--sd` one per `--drafter-tp` kind (the drafter whole on every rank, or cut like the target)."""
    for mode, overlap in plain_modes:
        engine = lockstep_engine(shard, None, host_group=host_group, **kw, overlap=overlap)
        note(rank, t_rank, f"TP={label} {mode} engine built")
        yield label, mode, engine
        del engine
    for how in args.drafter_tp if sd else []:
        drafter = drafter_for(arch, heads, device, args.draft_vocab)
        engine = lockstep_engine(shard, None, drafter, drafter_tp=how, host_group=host_group, **sd)
        mode = args.sd if len(args.drafter_tp) == 1 else f"{args.sd} {how}"
        cut = "sharded" if getattr(drafter, "tp", None) else "whole"
        note(rank, t_rank, f"TP={label} {mode} engine built (drafter {cut})")
        yield label, mode, engine
        del engine, drafter


class TPSums:
    """The shard's sums through one `--allreduce` kind after another (`use`); a fused kind without f= runs with
    the kernel's own one-row layout, as it was before any kind set it."""

    def __init__(self, shard, pdl: bool, world: int):
        self.shard, self.pdl, self.world, self.default_flat = shard, pdl, world, None

    def use(self, kind: str) -> str:
        """Route the shard's sums through `kind`; returns its rows' tp label ("2", "2 oneshot", ...)."""
        if kind.startswith("fused"):
            from tlt_rt.codegen.kernels import tp_sum  # local: Triton, for GPU runs only

            if self.default_flat is None:
                self.default_flat = tp_sum.ROW_FLAT
            meta, tail, flat = fused_settings(kind)
            tp_sum.ROW_FLAT = self.default_flat if flat is None else flat  # read as each step is captured
            tp_sum.use_fused_sums(self.shard, pdl=self.pdl, meta=meta, tail=tail)
        else:
            use_allreduce(self.shard, kind)
        return f"{self.world}" if kind == "nccl" else f"{self.world} {kind}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(KNOWN_SHAPES))
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the shape's layers to keep")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="GPU dtype (CPU runs fp32)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs / compiled glue (enforce_eager)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU over gloo, a few tokens")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (one GPU each)")
    ap.add_argument("--allreduce", nargs="+", default=["nccl"], type=allreduce_kind,
                    help="the TP=N engine's sums: NCCL, a one-shot sum over symmetric memory, and/or that sum with "
                    "the o and down projections of decode steps one kernel each, summing inside (fused; "
                    "fused:bn=4,w=4,tail=1024 sets its launch)")  # fmt: skip
    ap.add_argument("--chain", action="store_true",
                    help="every engine (TP=1 too) with rollout.decode_chain: a one-row step's matmuls, norms and "
                    "attention as the chain of Triton kernels")  # fmt: skip
    ap.add_argument(
        "--pdl",
        action="store_true",
        help="with --chain: its kernels (and the fused sum's) launched with programmatic dependent launch",
    )
    ap.add_argument("--chain-max-weight", type=int, default=0, metavar="ELEMENTS",
                    help="with --chain: the largest weight its Triton kernels take (rollout.decode_chain_max_weight; "
                    "a 7B TP=2 rank's q/k/v is 8.3M elements, o 6.4M, gate/up 68M, down 34M); 0: all")  # fmt: skip
    ap.add_argument("--chain-variants", type=int, nargs="+", default=[], metavar="ELEMENTS",
                    help="with --rounds: also plain engines with the decode chain whose kernels take weights of at "
                    "most this many elements (0: all), each over a model of its own, in the same rounds")  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="after each timed row, profile one more generate of it on rank 0 into DIR (kernels by "
                    "kind: matmul, collectives, ...; the wall time's busy share; host waits by caller)")  # fmt: skip
    ap.add_argument("--host-profile", type=Path, default=None, metavar="DIR",
                    help="after each timed row, one more generate of it under cProfile on rank 0 into DIR (host "
                    "functions by own and cumulative time)")  # fmt: skip
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="with --sd: target ids the random drafter's head covers, as a trained one's reduced head "
                    "(8,192 in the Qwen configs); 0 = the full vocabulary")  # fmt: skip
    ap.add_argument("--drafter-tp", nargs="+", default=["auto"], choices=DRAFTER_TP_KINDS,
                    help="with --sd, the TP=N engine's drafter: cut like the target (shard), whole on every rank "
                    "(replicate), or by its layer's size (auto); several: a row each")  # fmt: skip
    ap.add_argument("--overlap", nargs="+", default=["on"], choices=("on", "off"),
                    help="plain engines with rollout.overlap on (the next step queued while the host postprocesses "
                    "this one) and/or off (one step at a time: rows 'plain serial', priced against 'plain'); SD "
                    "steps are priced against the 'plain' row")  # fmt: skip
    ap.add_argument("--overlap-speculative", action=argparse.BooleanOptionalAction, default=True,
                    help="with --sd: each speculative step queued while the host postprocesses the one before "
                    "(rollout.overlap_speculative, the default)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1,
                    help="R > 1: keep every engine and time them in R interleaved rounds (the median round's row, "
                    "and x TP=1 paired within rounds); one --allreduce kind")  # fmt: skip
    ap.add_argument("--sd", default=None, metavar="STRATEGY",
                    help="also time speculative steps of this strategy (e.g. 8_4_32), a random drafter")  # fmt: skip
    args = ap.parse_args(argv)
    if args.tp < 2:
        ap.error(f"--tp must be >= 2 (TP=1 is the baseline every run measures), got {args.tp}")
    if args.smoke:
        args.batch, args.max_new_tokens, args.prompt_len = [1, 4], 8, 8
    gpu_sums = [k for k in args.allreduce if k != "nccl"]
    if gpu_sums and (args.smoke or not torch.cuda.is_available()):
        ap.error(f"--allreduce {' '.join(gpu_sums)} needs CUDA devices (symmetric memory over NVLink)")
    elif args.pdl and not (args.chain or args.chain_variants):
        ap.error("--pdl needs --chain or --chain-variants (the decode chain's kernels are what PDL launches)")
    elif args.chain_variants and args.rounds < 2:
        ap.error("--chain-variants times its engines beside the others in interleaved rounds: give --rounds 2 or more")
    elif any(w < 0 for w in args.chain_variants):
        ap.error(f"--chain-variants takes weights of 0 elements or more, got {args.chain_variants}")
    elif args.chain_max_weight and not args.chain:
        ap.error("--chain-max-weight needs --chain")
    elif args.chain_max_weight < 0:
        ap.error(f"--chain-max-weight must be >= 0, got {args.chain_max_weight}")
    elif not 0 < args.scale <= 1:
        ap.error("--scale must be in (0, 1]")
    elif args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    elif args.rounds > 1 and len(args.allreduce) > 1:
        ap.error("--rounds keeps every engine over one shard: give one --allreduce kind")
    elif args.rounds > 1 and (args.profile is not None or args.host_profile is not None):
        ap.error("--profile / --host-profile run with one round (each row profiled after its timing)")
    if not args.smoke and torch.cuda.is_available() and torch.cuda.device_count() < args.tp:
        ap.error(f"TP={args.tp} needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    if not args.smoke:
        try:
            check_tp_divisible(arch_for(args), args.tp)  # before any process starts
        except ValueError as e:
            ap.error(f"--shape {args.shape} --tp {args.tp}: {e}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by the ranks)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # and off for symmetric memory too
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.spawn(_rank, args=(port, args, out), nprocs=args.tp, join=False)
        # pass a stack-dump request on to the ranks (they are where a collective would hang)
        signal.signal(signal.SIGUSR1, lambda *_: [os.kill(p.pid, signal.SIGUSR1) for p in ctx.processes])
        while not ctx.join():
            pass
        rows, arch = out["rows"], out["arch"]
    print(
        f"\n{arch}, prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens, greedy, "
        f"{'plain and ' + args.sd + ' (a random drafter)' if args.sd else 'plain decoding'}\n"
    )
    plain_ms = {(tp, b): ms for tp, b, mode, _, ms, *_ in rows if mode == "plain"}
    pairs = paired(rows)
    order = {label: i for i, label in enumerate(dict.fromkeys(r[0] for r in rows))}  # as they ran
    print("bare step: the captured step alone (inputs in, replay, result out), no scheduling\n")
    rounds = max(len(r[7]) for r in rows)
    how = f"the median over {rounds} interleaved rounds" if rounds > 1 else "one round, the rows one after another"
    print(f"x TP=1: tokens/s over the TP=1 row of the same mode and batch ({how})\n")
    print("| tp | batch | mode | tok/s | x TP=1 | ms/step | bare step ms | SD/plain step | equal |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|:---:|")
    for tp, b, mode, tps, ms, eq, bare, _ in sorted(rows, key=lambda r: (r[1], r[2] != "plain", order[r[0]])):
        ratio = f"{ms / plain_ms[tp, b]:.2f}x" if mode != "plain" and (tp, b) in plain_ms else "-"
        x = f"{pairs[tp, b, mode]:.2f}x" if (tp, b, mode) in pairs else "-"
        print(f"| {tp} | {b} | {mode} | {tps:.1f} | {x} | {ms:.2f} | {bare:.2f} | {ratio} | {eq} |")
    return 0 if all(r[5] != "NO" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
