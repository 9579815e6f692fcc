"""Sanity check of the whole drafter path on CPU: a drafter trained on a few greedy answers of SmolLM2 must
then accept most of its drafts on those same prompts (train, draft, verify and accept all agree).

    python benchmarks/drafter_overfit.py
"""

from __future__ import annotations

import time
import warnings

import torch

from tlt_rt.models.default import load_tokenizer
from tlt_rt.models.drafter import Drafter
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.data import DrafterBuffer
from tlt_rt.train.drafter.trainer import DrafterTrainer
from tlt_rt.train.drafter.warmup import accept_length, generate_data
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt


def main(steps: int = 120, strategy: str = "4_2_6") -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    tok = load_tokenizer(None)
    prompts = [format_prompt(p, tok) for p in ArithmeticTask(seed=0).sample(4)]
    plain = Engine.from_pretrained(None, speculative="off", dtype="float32", device="cpu")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40)
    buf = DrafterBuffer(max_steps=1)
    generate_data(plain, prompts, params, buf)
    drafter = Drafter(plain.target.arch, plain.target)
    spec = Engine(plain.target, drafter=drafter, speculative="on", strategies=(strategy,))
    before = accept_length(spec, prompts, params)
    trainer = DrafterTrainer(drafter, buf, lr=1e-3, batch_tokens=512)
    t0 = time.perf_counter()
    for _ in range(steps):
        m = trainer.step()
    after = accept_length(spec, prompts, params)
    print(
        f"{strategy}: accept length {before:.2f} -> {after:.2f} after {steps} steps "
        f"({time.perf_counter() - t0:.0f}s, last loss {m['loss']:.3f}, top-1 {m['top1']:.3f})"
    )


if __name__ == "__main__":
    main()
