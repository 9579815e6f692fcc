"""`python -m tlt_rt.demo`: the default model answering a few arithmetic problems (greedy).

A quick look that the embedded SmolLM2, its tokenizer and chat template, the task generator and the reward
all work on this machine, before a training run.
"""

from __future__ import annotations

import argparse
import time

import torch

from tlt_rt.models import load_target
from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.generate import generate_simple
from tlt_rt.train.rl.data import ArithmeticTask, Problem, format_prompt
from tlt_rt.train.rl.reward import extract_answer, reward


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num", type=int, default=4, help="how many generated problems")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model = load_target(args.model, dtype="auto")
    tok = load_tokenizer(args.model)
    problems = [Problem("What is 17*3?", "51", {})]
    problems += ArithmeticTask(digits=1, num_ops=1, word_problems=False, seed=args.seed).sample(args.num // 2)
    problems += ArithmeticTask(digits=2, num_ops=1, word_problems=True, seed=args.seed).sample(args.num - args.num // 2)
    # the first is asked bare, the generated ones with the task's step-by-step instruction
    prompts = [format_prompt(problems[0], tok, instruction=None)]
    prompts += [format_prompt(p, tok) for p in problems[1:]]
    t0 = time.perf_counter()
    outs = generate_simple(model, prompts, max_new_tokens=args.max_new_tokens)
    dt = time.perf_counter() - t0
    correct = 0
    for p, out in zip(problems, outs, strict=True):
        text = tok.decode(out, skip_special_tokens=True).strip()
        r = reward(text, p.answer)
        correct += int(r)
        print(f"Q: {p.question}\nA: {text}\n   extracted={extract_answer(text)!r} expected={p.answer} reward={r}\n")
    n_tok = sum(len(o) for o in outs)
    print(f"{correct}/{len(problems)} correct, {n_tok} tokens in {dt:.1f}s ({n_tok / dt:.1f} tok/s, batch {len(outs)})")


if __name__ == "__main__":
    main()
