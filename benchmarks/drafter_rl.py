"""Drafter accept length on the RL workload's own answers against the perfect-drafter ceiling.

    python benchmarks/drafter_rl.py [--tiny] [--prompts 1024] [--samples 4] [--train-seconds 120]
        [--variants base,ttt3] [--strategies 8_4_32,8_8_64] [--out FILE]

1. SmolLM2 (bf16 on CUDA) answers the RL task's prompts (two-step two-digit word problems, the e2e run's
   task) at the RL temperature 1.0; the (token, hidden) rows are the training data.
2. Each variant trains a fresh drafter for --train-seconds (or --epochs passes, whichever ends first):
     base     today's warm-up: unroll 2 with the shifted context, token weight 1.0, targets at T=1
     ttt3     unroll 3 with the engine's exact chain context (training-time test), targets at T=1
     ttt3s    ttt3 plus a cross-entropy on the sampled next token (weight 0.5)
     vocab    ttt3 with a reduced draft vocabulary of --draft-vocab tokens (from the training answers)
     greedyT  ttt3 with one-hot targets (temperature 0), for comparison
     cos      vocab with a cosine learning-rate schedule (3% rise, fall to a tenth) at --lr
     cos3     cos at 3x --lr
     mix      cos, its data also holding each training prompt's greedy answer (warm-up --greedy-answers)
     mix3     mix at 3x --lr
     lr3      vocab at 3x --lr (constant)
     lr3e2    lr3 for twice the --epochs
     mixc3    lr3 on the data with greedy answers
     mix3e2   mixc3 for twice the --epochs (the warm-up's defaults)
   Cosine variants train the --epochs steps whole (--train-seconds does not cut their schedule short).
3. For every strategy, held-out accept length in the engine (SD on every step) at T=1.0 and greedy, the
   perfect-drafter ceiling of the same tree shape and verify budget on the answers that engine run emitted
   (`drafter_eval.oracle_tree_steps`, on the first --oracle-samples of them, 0 = all: the same answers the
   accept length counts), and their ratio.

--tiny runs the whole path on CPU in a few minutes (SmolLM2 fp32, a handful of prompts and tokens).
Prints one JSON line per (variant, strategy, temperature) and a table; --out appends the JSON lines.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tlt_rt.ir.strategy import Strategy
from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.drafter import Drafter
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.warmup import LR_WARMUP_SHARE, accept_and_answers, ceiling, generate_data
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt

VARIANTS = {
    "base": dict(unroll=2, unroll_context="shifted"),
    "ttt3": dict(unroll=3, unroll_context="chain"),
    "ttt3s": dict(unroll=3, unroll_context="chain", sampled_weight=0.5),
    "vocab": dict(unroll=3, unroll_context="chain", draft_vocab=True),
    "greedyT": dict(unroll=3, unroll_context="chain", temperature=0.0),
    "cos": dict(unroll=3, unroll_context="chain", draft_vocab=True, lr_schedule="cosine"),
    "cos3": dict(unroll=3, unroll_context="chain", draft_vocab=True, lr_schedule="cosine", lr_scale=3.0),
    "mix": dict(unroll=3, unroll_context="chain", draft_vocab=True, lr_schedule="cosine", greedy_data=True),
    "mix3": dict(
        unroll=3, unroll_context="chain", draft_vocab=True, lr_schedule="cosine", lr_scale=3.0, greedy_data=True
    ),
    "lr3": dict(unroll=3, unroll_context="chain", draft_vocab=True, lr_scale=3.0),
    "lr3e2": dict(unroll=3, unroll_context="chain", draft_vocab=True, lr_scale=3.0, epochs_scale=2.0),
    "mixc3": dict(unroll=3, unroll_context="chain", draft_vocab=True, lr_scale=3.0, greedy_data=True),
    "mix3e2": dict(
        unroll=3, unroll_context="chain", draft_vocab=True, lr_scale=3.0, greedy_data=True, epochs_scale=2.0
    ),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train_variant(target, buffers: dict[bool, DrafterBuffer], name: str, a) -> tuple[Drafter, dict]:
    opts = dict(VARIANTS[name])
    vocab = a.draft_vocab if opts.pop("draft_vocab", False) else 0
    lr = a.lr * opts.pop("lr_scale", 1.0)
    buffer = buffers[opts.pop("greedy_data", False)]
    steps = max(1, round(a.epochs * opts.pop("epochs_scale", 1.0) * buffer.num_tokens / a.batch_tokens))
    cosine = opts.get("lr_schedule") == "cosine"
    if cosine:
        opts.update(lr_warmup_steps=round(LR_WARMUP_SHARE * steps), lr_total_steps=steps)
    torch.manual_seed(a.seed)
    drafter = Drafter(target.arch, target).to(target.lm_head.weight.device)
    trainer = DrafterTrainer(
        drafter, buffer, lr=lr, batch_tokens=a.batch_tokens, seed=a.seed, token_weight=1.0, draft_vocab=vocab, **opts
    )
    t0, done, m = time.perf_counter(), 0, {}
    while done < steps and (cosine or time.perf_counter() - t0 < a.train_seconds):
        m = trainer.step()
        done += 1
    info = {"steps": done, "train_s": round(time.perf_counter() - t0, 1), "top1": m.get("top1"), "loss": m.get("loss")}
    info.update(draft_vocab=drafter.draft_vocab_size, lr=lr, train_tokens=buffer.num_tokens)
    log(f"{name}: {info}")
    return drafter.eval(), info


def spec_engine(target, drafter, strategy: str, a) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(target, drafter=drafter, speculative="on", strategies=(strategy,), max_batch=a.gen_batch)


def free(engine: Engine) -> None:
    """Give an engine's KV cache and captured steps back: each new engine sizes its cache by the free memory."""
    engine.release_memory()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluate(eng: Engine, prompts, temperature: float, a) -> tuple[float, list[dict]]:
    """(engine accept length, the emitted answers as oracle samples)."""
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=a.max_new_tokens, seed=a.seed + 1)
    return accept_and_answers(eng, prompts, params)


def rl_prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of the RL workload (two-step two-digit word problems of `seed`) as SmolLM2 token ids."""
    tok = load_tokenizer(None)
    return [format_prompt(p, tok) for p in ArithmeticTask(digits=2, num_ops=2, word_problems=True, seed=seed).sample(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized end-to-end check")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--held-out", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="the RL temperature of the training answers")
    ap.add_argument("--train-seconds", type=float, default=120.0, help="training budget of each variant")
    ap.add_argument("--epochs", type=float, default=5.0)
    ap.add_argument("--variants", default="base,ttt3")
    ap.add_argument("--strategies", default="8_4_32,8_8_64")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--oracle-samples", type=int, default=0, help="answers the ceiling is computed on (0: all)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.prompts, a.samples, a.held_out, a.max_new_tokens = 6, 2, 2, 16
        a.train_seconds, a.batch_tokens, a.draft_vocab, a.oracle_samples = 15.0, 256, 512, 2
        a.gen_batch = 8  # the engine sizes its KV cache by its batch: keep it small on CPU
        a.strategies = a.strategies.split(",")[0]
    for name in a.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {sorted(VARIANTS)}")
    strategies = a.strategies.split(",")
    for s in strategies:
        Strategy.parse(s)  # a bad name fails here, before any work
    cuda = torch.cuda.is_available() and not a.tiny
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")

    prompts = rl_prompts(a.prompts + a.held_out, a.seed)
    train_prompts, eval_prompts = prompts[: a.prompts], prompts[a.prompts :]
    plain = Engine.from_pretrained(None, speculative="off", dtype=dtype, device=device, max_batch=a.gen_batch)
    target = plain.target
    buffer = DrafterBuffer(max_steps=1)
    t0 = time.perf_counter()
    params = SamplingParams(n=a.samples, temperature=a.temperature, max_new_tokens=a.max_new_tokens, seed=a.seed)
    greedy_data = any(VARIANTS[v].get("greedy_data") for v in a.variants.split(","))
    mixed = DrafterBuffer(max_steps=1) if greedy_data else buffer
    n_tokens = generate_data(plain, train_prompts, params, buffer, also=(mixed,) if greedy_data else ())
    log(f"{n_tokens} answer tokens ({buffer.num_tokens} rows) generated in {time.perf_counter() - t0:.0f}s")
    if greedy_data:
        t0 = time.perf_counter()
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=a.max_new_tokens, seed=a.seed)
        n_greedy = generate_data(plain, train_prompts, greedy, mixed)
        log(f"{n_greedy} greedy answer tokens generated in {time.perf_counter() - t0:.0f}s")
    buffers = {False: buffer, True: mixed}
    free(plain)  # the target stays; the generating engine's cache goes

    rows = []
    for name in a.variants.split(","):
        drafter, info = train_variant(target, buffers, name, a)
        for strategy in strategies:
            eng = spec_engine(target, drafter, strategy, a)
            for temp in (a.temperature, 0.0):
                t1 = time.perf_counter()
                acc, samples = evaluate(eng, eval_prompts, temp, a)
                t2 = time.perf_counter()
                ceil = ceiling(target, samples[: a.oracle_samples or None], temp, strategy)
                row = {
                    "variant": name, "strategy": strategy, "temperature": temp, "accept_length": round(acc, 3),
                    "ceiling": round(ceil, 3), "ratio": round(acc / ceil, 3), **info,
                    "engine_s": round(t2 - t1, 1), "oracle_s": round(time.perf_counter() - t2, 1),
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            free(eng)
            del eng
        del drafter
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\n{device_name}, {n_tokens} training answer tokens at T={a.temperature}, {a.held_out} held-out prompts")
    print(f"{'variant':8} {'strategy':9} {'T':>4} {'accept':>7} {'ceiling':>8} {'ratio':>6} {'steps':>6}")
    for r in rows:
        print(
            f"{r['variant']:8} {r['strategy']:9} {r['temperature']:4.1f} {r['accept_length']:7.2f} "
            f"{r['ceiling']:8.2f} {r['ratio']:6.0%} {r['steps']:6d}"
        )
    if a.out:
        with Path(a.out).open("a") as f:
            for r in rows:
                f.write(json.dumps({**r, "device": device_name}) + "\n")


if __name__ == "__main__":
    main()
