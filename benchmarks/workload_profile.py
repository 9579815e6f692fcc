"""What a config's RL workload looks like before any training: the policy's accuracy and its answers' length
distribution (median, p90, p99, the tail's ratio to the median, the share cut at max_new_tokens) at the rollout
temperature, on the config's own task. Use it to pick a difficulty that starts at 20-50% and has a real tail.

    python benchmarks/workload_profile.py --config configs/qwen2.5-0.5b-math-gpu.yaml --prompts 32 \\
        [--variants "" "task.digits=2 task.max_ops=5"] [-- KEY=VALUE ...]

Each variant (space-separated KEY=VALUE overrides, "" for the config as it is) answers the same number of
prompts, `rl.group_size` samples each, with plain decoding (speculation off). CPU or GPU (model.device).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tlt_rt.config import TLTConfig, load_config  # noqa: E402
from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt  # noqa: E402
from tlt_rt.train.rl.metrics import percentile  # noqa: E402
from tlt_rt.train.rl.reward import resolve_reward  # noqa: E402


def profile(cfg: TLTConfig, engine: Engine, tokenizer, prompts: int, seed: int) -> dict:
    if cfg.task.kind != "arithmetic":
        raise SystemExit(f"workload_profile generates arithmetic problems; task.kind is {cfg.task.kind}")
    problems = ArithmeticTask.from_config(cfg.task, seed_offset=seed).sample(prompts)
    ids = [format_prompt(p, tokenizer, instruction=cfg.task.instruction or None) for p in problems]
    r = cfg.rollout
    params = SamplingParams(n=cfg.rl.group_size, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                            max_new_tokens=r.max_new_tokens, seed=seed)  # fmt: skip
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    seconds = time.perf_counter() - t0
    score = resolve_reward(cfg.task.reward)
    lengths = [len(o.token_ids) for o in outs]
    right = [score(tokenizer.decode(o.token_ids, skip_special_tokens=True), problems[o.prompt_index].answer)
             for o in outs]  # fmt: skip
    p50 = percentile(lengths, 50)
    return dict(answers=len(outs), accuracy=sum(x >= 1.0 for x in right) / len(outs), p50=p50,
                p90=percentile(lengths, 90), p99=percentile(lengths, 99), max=max(lengths),
                tail=percentile(lengths, 99) / max(p50, 1),
                cut=sum(o.finish_reason == "length" for o in outs) / len(outs),
                tokens=sum(lengths), seconds=seconds)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keys = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-0.5b-math-gpu.yaml")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--variants", nargs="*", default=[""])
    ap.add_argument("--seed", type=int, default=7, help="task seed offset: problems apart from the RL run's")
    args = ap.parse_args(argv)
    cfg = load_config(TLTConfig, args.config, keys)
    device = torch.device(cfg.model.device if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(cfg.model.path)
    from tlt_rt.models import load_target

    target = load_target(cfg.model.path, dtype=cfg.model.dtype if device.type == "cuda" else "float32",
                         device=device)  # fmt: skip
    # the config's engine (its KV cache size among the rest) without speculation; on a CPU the automatic cache is
    # capped at 512 MiB, so long answers of many samples need rollout.num_blocks or they preempt each other
    engine = Engine(target, config=cfg.rollout.engine(), speculative="off", max_context=cfg.model.max_context)
    print(f"# KV cache: {engine.blocks.num_blocks} blocks of {engine.block_size} tokens")
    print(f"# workload_profile: {cfg.model.path} on {device}, T={cfg.rollout.temperature}, {args.prompts} prompts x "
          f"{cfg.rl.group_size}, max_new_tokens {cfg.rollout.max_new_tokens}")  # fmt: skip
    print("| variant | answers | accuracy | p50 | p90 | p99 | max | p99 / p50 | cut | tokens | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant in args.variants:
        vcfg = load_config(TLTConfig, args.config, [*keys, *variant.split()])
        m = profile(vcfg, engine, tokenizer, args.prompts, args.seed)
        print(f"| {variant or '(config)'} | {m['answers']} | {m['accuracy']:.2f} | {m['p50']:.0f} | {m['p90']:.0f} | "
              f"{m['p99']:.0f} | {m['max']} | {m['tail']:.1f} | {m['cut']:.0%} | {m['tokens']} | "
              f"{m['seconds']:.0f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
