"""How a reduced draft vocabulary caps speculation: coverage and the perfect-drafter ceiling against its size.

    python benchmarks/vocab_ceiling.py [--prompts 128] [--samples 2] [--held-out 12] [--strategy 8_4_32]
        [--sizes 1024 2048 4096 8192 16384] [--temperature 1.0] [--out F.jsonl] [--tiny]
        [--target qwen2.5-coder-0.5b-instruct --config configs/qwen2.5-0.5b-math-gpu.yaml]

SmolLM2 (or --target) answers the RL workload (two-step two-digit word problems, or --config's task) at
--temperature. The training prompts'
sequences (prompt and answer: the rollouts the trainer's buffer holds) give each id a count, and each size a
draft vocabulary (`DraftVocab`: the most frequent ids, EOS always kept), built as the trainer builds it.
Held-out answers, at --temperature and greedy, then give per size:
  coverage  the share of the held-out answer tokens inside the vocabulary (a token outside is never drafted)
  ceiling   the perfect-drafter accept length of --strategy's tree and verify budget when the drafter ranks
            the target's distribution restricted to the vocabulary (`drafter_eval.oracle_tree_steps(vocab=)`),
            beside the full vocabulary's, on the same answers.
What a size costs is the draft head's share of a level (RESULTS.md, `step_phases.py --draft-vocab N` on a GPU);
what it caps is this. Runs on a GPU (bf16) or the CPU (fp32); --tiny is a quick check of the whole path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tlt_rt, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_rl import rl_prompts  # noqa: E402

from tlt_rt.ir.strategy import Strategy  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.train.drafter.eval import oracle_tree_steps  # noqa: E402
from tlt_rt.train.drafter.vocab import DraftVocab  # noqa: E402


def held_out(engine: Engine, prompts: list[list[int]], temperature: float, max_new: int, seed: int) -> list[dict]:
    """One answer per prompt as oracle samples ({"ids": prompt + answer on the target's device, "prompt_len"})."""
    dev = engine.target.lm_head.weight.device
    outs = engine.generate(prompts, SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new, seed=seed))
    return [{"ids": torch.tensor(prompts[o.prompt_index] + o.token_ids, device=dev),
             "prompt_len": len(prompts[o.prompt_index])} for o in outs]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128, help="training prompts whose answers make the counts")
    ap.add_argument("--samples", type=int, default=2, help="answers per training prompt")
    ap.add_argument("--held-out", type=int, default=12, help="prompts whose answers the ceilings walk")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0, help="the RL temperature")
    ap.add_argument("--strategy", default="8_4_32")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append one JSON line per (temperature, size)")
    ap.add_argument("--tiny", action="store_true", help="a quick CPU check of the whole path")
    ap.add_argument("--target", default=None, help="model path or registered name (default: SmolLM2)")
    ap.add_argument("--config", default=None, help="an RL config whose arithmetic task makes the prompts")
    a = ap.parse_args(argv)
    if a.tiny:
        a.prompts, a.samples, a.held_out, a.max_new_tokens, a.sizes, a.gen_batch = 4, 1, 2, 12, [256], 8
        a.strategy = "3_2_4"
    st = Strategy.parse(a.strategy)  # a bad name fails before any work
    if any(n < 1 for n in a.sizes):
        raise SystemExit(f"--sizes must be positive, got {a.sizes}")
    warnings.simplefilter("ignore")
    cuda = torch.cuda.is_available() and not a.tiny
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    if a.config or a.target:
        from tlt_rt.config import TLTConfig, load_config
        from tlt_rt.models.default import load_tokenizer
        from tlt_rt.train.rl.data import ArithmeticTask, format_prompt

        task = ArithmeticTask.from_config(load_config(TLTConfig, a.config).task) if a.config else None
        task = task or ArithmeticTask(digits=2, num_ops=2, word_problems=True, seed=a.seed)
        tok = load_tokenizer(a.target)
        prompts = [format_prompt(p, tok) for p in task.sample(a.prompts + a.held_out)]
    else:
        prompts = rl_prompts(a.prompts + a.held_out, a.seed)
    train, evals = prompts[: a.prompts], prompts[a.prompts :]
    engine = Engine.from_pretrained(a.target, speculative="off", dtype=dtype, device=device, max_batch=a.gen_batch)
    target, v = engine.target, engine.target.arch.vocab_size
    t0 = time.perf_counter()
    params = SamplingParams(n=a.samples, temperature=a.temperature, max_new_tokens=a.max_new_tokens, seed=a.seed)
    counter = DraftVocab(v, 1)  # its per-id counts over every sequence, prompt and answer
    counter.update([torch.tensor(train[o.prompt_index] + o.token_ids) for o in engine.generate(train, params)])
    counts, counted = counter.counts, int(counter.counts.sum())
    answers = {t: held_out(engine, evals, t, a.max_new_tokens, a.seed + 1) for t in dict.fromkeys([a.temperature, 0.0])}
    print(f"{counted} counted tokens, {len(evals)} held-out prompts; {time.perf_counter() - t0:.0f}s",
          flush=True)  # fmt: skip
    chunk = 512 if cuda else 64
    name = torch.cuda.get_device_name() if cuda else "cpu"
    keep = [i for i in target.arch.eos_token_ids if 0 <= i < v]
    rows = []
    for temp, samples in answers.items():
        tokens = torch.cat([s["ids"][s["prompt_len"] :].cpu() for s in samples])
        full = None
        for size in [v, *sorted({min(n, v) for n in a.sizes} - {v})]:
            t1 = time.perf_counter()
            vocab = None if size == v else DraftVocab(v, size, keep=keep).build(counts)
            ceil = oracle_tree_steps(target, samples, temp, st.depth, st.topk, st.verify_tokens, chunk, vocab)
            full = ceil if full is None else full
            row = {
                "temperature": temp, "strategy": a.strategy, "vocab": size, "full_vocab": v,
                "coverage": 1.0 if vocab is None else round(float(torch.isin(tokens, vocab).float().mean()), 4),
                "ceiling": round(ceil, 3), "ceiling_full": round(full, 3), "share": round(ceil / full, 3),
                "answer_tokens": int(tokens.numel()), "counted_tokens": counted,
                "seconds": round(time.perf_counter() - t1, 1), "device": name,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{rows[0]['device']}, {a.strategy}, {rows[0]['counted_tokens']} counted tokens")
    print(f"{'T':>4} {'vocab':>6} {'coverage':>9} {'ceiling':>8} {'of full':>8}")
    for r in rows:
        print(f"{r['temperature']:4g} {r['vocab']:6d} {r['coverage']:9.1%} {r['ceiling']:8.3f} {r['share']:8.1%}")
    return rows


if __name__ == "__main__":
    main()
