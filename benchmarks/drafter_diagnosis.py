"""Drafter diagnosis on CPU: where accept length is lost (alignment, paged vs dense, depth, data, recipe).

    python benchmarks/drafter_diagnosis.py [--train 16] [--held-out 8] [--steps 200] [--temperature 0.9] ...

For the target's answers to `--train` arithmetic prompts (plus `--held-out` others), it reports
- the engine's returned hidden states against a dense target forward (the data the drafter trains on);
- the oracle bound: tokens per step of a perfect drafter with top-k trees under the engine's tree
  acceptance (a sampled token is accepted when the drafter offered it, probability p of it), from the
  target's own samples;
- after training a fresh drafter: teacher-forced top-1 agreement with the target at depth 1..D on response
  rows (depth j >= 2 feeds the drafter's own hidden back, true tokens; context rows use true features), on
  the training and the held-out answers, and the chain accept length that agreement implies;
- the engine's accept length with a chain strategy (D_1_{D+1}) and with `--strategy`, greedy and at
  `--temperature`. With greedy data, the engine's chain accept length on the training prompts must equal
  the dense teacher-forced one: that is the paged-vs-dense check end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch

from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.drafter import Drafter, draft_vocab_from_counts
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.data import DrafterBuffer, collect_hidden
from tlt_rt.train.drafter.eval import chain_agreement, chain_steps, oracle_steps
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.warmup import accept_length
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt


def sample_answers(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    """[{ids [L], hidden [L, H], prompt_len}] of every answer (the last token, which has no hidden row, dropped)."""
    outs = engine.generate(prompts, SamplingParams(**{**params.__dict__, "return_hidden": True}))
    return [
        {
            "ids": torch.tensor(prompts[o.prompt_index] + o.token_ids)[:-1],
            "hidden": o.hidden.float().cpu(),
            "prompt_len": len(prompts[o.prompt_index]),
        }
        for o in outs
    ]


def reduced_vocab(samples: list[dict], vocab_size: int, size: int) -> torch.Tensor | None:
    """The `size` most frequent token ids of the samples as a draft vocabulary (None when size is 0)."""
    if not size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s["ids"], minlength=vocab_size)
    return draft_vocab_from_counts(counts, size)


def agreement_report(drafter: Drafter, samples: list[dict], depth: int) -> dict:
    oks = [chain_agreement(drafter, s, depth) for s in samples]
    cat = torch.cat(oks, 1).float()
    cond = [float((cat[: j + 1].prod(0)).sum() / cat[:j].prod(0).sum().clamp(min=1)) for j in range(depth)]
    return {
        "top1_by_depth": [round(float(x), 3) for x in cat.mean(1)],
        "top1_given_prefix_right": [round(x, 3) for x in cond],
        "chain_steps": round(sum(chain_steps(o) for o in oks) / len(oks), 3),
    }


def train(drafter: Drafter, samples: list[dict], a, log) -> dict:
    buf = DrafterBuffer(max_steps=1, seed=a.seed)
    buf.add(0, [s["ids"] for s in samples], [s["hidden"] for s in samples])
    trainer = DrafterTrainer(
        drafter,
        buf,
        lr=a.lr,
        batch_tokens=a.batch_tokens,
        token_weight=a.token_weight,
        hidden_weight=a.hidden_weight,
        noise_std=a.noise_std,
        unroll=a.unroll,
        seed=a.seed,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        trainer.optimizer, lambda i: min(1.0, (i + 1) / max(1, a.steps // 20)) * (1 - i / a.steps) if a.decay else 1.0
    )
    t0, m = time.perf_counter(), {}
    for i in range(a.steps):
        m = trainer.step()
        sched.step()
        if (i + 1) % max(1, a.steps // 5) == 0:
            log(f"  step {i + 1}: loss {m['loss']:.3f} hidden {m['hidden_loss']:.3f} top1 {m['top1']:.3f}")
    return {"train_seconds": round(time.perf_counter() - t0, 1), "final_loss": m["loss"], "final_top1": m["top1"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=16, help="training prompts")
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--samples", type=int, default=1, help="answers per training prompt")
    ap.add_argument("--data-temperature", type=float, default=0.0, help="0: greedy training answers")
    ap.add_argument("--temperature", type=float, default=0.9, help="the RL temperature, for the sampled checks")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--decay", action="store_true", help="warm-up then linear decay of the learning rate")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--token-weight", type=float, default=0.1)
    ap.add_argument("--hidden-weight", type=float, default=1.0)
    ap.add_argument("--noise-std", type=float, default=0.0)
    ap.add_argument("--unroll", type=int, default=1, help="training-time-test passes (drafter_loss)")
    ap.add_argument("--cache", default=None, help="file to keep the generated answers in between runs")
    ap.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0: full)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--strategy", default="", help="also measure this tree strategy in the engine")
    ap.add_argument("--engine", action="store_true", help="measure accept lengths in the engine too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the report as one JSON line")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(a.seed)
    torch.set_grad_enabled(True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    tok = load_tokenizer(None)
    task = ArithmeticTask(digits=2, num_ops=2, seed=a.seed)
    prompts = [format_prompt(p, tok) for p in task.sample(a.train + a.held_out)]
    train_prompts, eval_prompts = prompts[: a.train], prompts[a.train :]
    plain = Engine.from_pretrained(None, speculative="off", dtype="float32", device="cpu")
    target = plain.target
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=a.max_new_tokens)
    hot = SamplingParams(n=1, temperature=a.temperature, max_new_tokens=a.max_new_tokens, seed=a.seed + 1)
    data_params = SamplingParams(
        n=a.samples, temperature=a.data_temperature, max_new_tokens=a.max_new_tokens, seed=a.seed
    )
    t0 = time.perf_counter()
    key = (a.train, a.held_out, a.samples, a.data_temperature, a.temperature, a.max_new_tokens, a.seed)
    cached = torch.load(a.cache) if a.cache and os.path.exists(a.cache) else None
    if cached is not None and cached["key"] == key:
        data, train_greedy, eval_greedy, eval_hot = cached["sets"]
    else:
        data = sample_answers(plain, train_prompts, data_params)
        same = a.data_temperature == 0 and a.samples == 1
        train_greedy = data if same else sample_answers(plain, train_prompts, greedy)
        eval_greedy = sample_answers(plain, eval_prompts, greedy)
        eval_hot = sample_answers(plain, eval_prompts, hot)
        if a.cache:
            torch.save({"key": key, "sets": (data, train_greedy, eval_greedy, eval_hot)}, a.cache)
    rep: dict = {"args": vars(a), "data_tokens": sum(s["ids"].numel() for s in data)}
    rep["generate_seconds"] = round(time.perf_counter() - t0, 1)
    dense = collect_hidden(target, [s["ids"] for s in eval_greedy])
    rep["engine_vs_dense_hidden_maxdiff"] = max(
        float((d - s["hidden"]).abs().max()) for d, s in zip(dense, eval_greedy, strict=True)
    )
    rep["oracle_steps"] = {
        f"T={a.temperature} top{k} depth{a.depth}": round(oracle_steps(target, eval_hot, a.temperature, k, a.depth), 3)
        for k in (1, 4)
    }
    log(json.dumps({k: rep[k] for k in ("data_tokens", "engine_vs_dense_hidden_maxdiff", "oracle_steps")}))

    drafter = Drafter(target.arch, target, draft_vocab=reduced_vocab(data, target.arch.vocab_size, a.draft_vocab))
    rep.update(train(drafter, data, a, log))
    drafter.eval()
    rep["train_agreement"] = agreement_report(drafter, train_greedy, a.depth)
    rep["held_out_agreement"] = agreement_report(drafter, eval_greedy, a.depth)
    rep["held_out_agreement_T"] = agreement_report(drafter, eval_hot, a.depth)
    log(json.dumps({k: rep[k] for k in ("train_agreement", "held_out_agreement", "held_out_agreement_T")}))
    if a.engine:
        chain = f"{a.depth}_1_{a.depth + 1}"
        for strat in [chain] + ([a.strategy] if a.strategy else []):
            spec = Engine(target, drafter=drafter, speculative="on", strategies=(strat,))
            rep[f"engine {strat} greedy train"] = round(accept_length(spec, train_prompts, greedy), 3)
            rep[f"engine {strat} greedy held-out"] = round(accept_length(spec, eval_prompts, greedy), 3)
            rep[f"engine {strat} T={a.temperature} held-out"] = round(accept_length(spec, eval_prompts, hot), 3)
            log(json.dumps({k: v for k, v in rep.items() if k.startswith(f"engine {strat}")}))
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(json.dumps(rep) + "\n")
    return rep


if __name__ == "__main__":
    main()
