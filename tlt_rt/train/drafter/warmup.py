"""Drafter warm-up: train a drafter from nothing on the target's own generations for the task's prompts.

    python -m tlt_rt.train.drafter.warmup --out runs/drafter-smollm2 [--target PATH] [--prompts 256] [--steps 2000]

1. the target generates `--samples` answers to each training prompt (plain decoding at the RL temperature,
   hidden states returned as tensors) and its greedy answer (unless --no-greedy-answers), so no external
   data is needed;
2. a fresh drafter trains on those (token, hidden) sequences with a progress bar;
3. accept length with strategy `--strategy` is measured on held-out prompts before and after training,
   then the drafter is exported as an EAGLE draft-model folder (`tlt_rt.models.eagle_export`).
"""

from __future__ import annotations

import argparse

from tlt_rt.rollout.config import DEFAULT_STRATEGIES
from tlt_rt.train.drafter.measure import accept_and_answers, accept_length, ceiling, strategy_accept
from tlt_rt.train.drafter.warmup_data import gen_buckets, generate_data
from tlt_rt.train.drafter.warmup_run import (
    BASE_LR,
    BASE_WIDTH,
    CPU_BATCH_TOKENS,
    GPU_BATCH_TOKENS,
    LR_WARMUP_SHARE,
    default_feature_layers,
    default_lr,
    warmup,
)
from tlt_rt.train.rl.data import ArithmeticTask

__all__ = [
    "BASE_LR", "CPU_BATCH_TOKENS", "GPU_BATCH_TOKENS", "LR_WARMUP_SHARE", "accept_and_answers", "accept_length",
    "ceiling", "default_feature_layers", "default_lr", "gen_buckets", "generate_data", "main", "strategy_accept",
    "warmup",
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--out", default="runs/drafter")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="default: --epochs passes over the generated data")
    ap.add_argument("--epochs", type=float, default=10.0)
    ap.add_argument("--noise-std", type=float, default=0.0, help="Gaussian noise on input features")
    ap.add_argument("--token-weight", type=float, default=1.0, help="CE weight of the next-token loss")
    ap.add_argument("--hidden-weight", type=float, default=1.0,
                    help="weight of the feature regression (0 = the token loss alone)")  # fmt: skip
    ap.add_argument("--unroll", type=int, default=3, help="training passes fed the drafter's own predictions")
    ap.add_argument("--unroll-context", choices=("chain", "shifted"), default="chain",
                    help="attention context of unrolled passes (drafter_loss)")  # fmt: skip
    ap.add_argument("--loss-temperature", type=float, default=1.0, help="temperature of the soft targets (0: argmax)")
    ap.add_argument("--sampled-weight", type=float, default=0.0, help="CE weight on the sampled next token")
    ap.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0 = full)")
    ap.add_argument("--feature-layers", nargs="*", default=[],
                    help="target layers whose outputs the drafter fuses with the last one's (EAGLE-3), or 'auto' "
                    "(the third and the middle layer); none = the last layer's feature alone")  # fmt: skip
    ap.add_argument("--no-fc-bias", action="store_true", help="a drafter without fc bias (vLLM serves it as is)")
    ap.add_argument("--format", default="sglang", choices=("sglang", "vllm"), help="layout of the exported drafter")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.9, help="sampling temperature of the training data")
    ap.add_argument("--eval-temperatures", type=float, nargs="*", default=[0.0],
                    help="accept length is also measured at these (0 = greedy)")  # fmt: skip
    ap.add_argument("--gen-batch", type=int, default=512,
                    help="batch of the engine that generates the data (the Qwen warm-ups' 512: 4.0M tokens "
                         "of the 1.5B in 110 s on an H200)")  # fmt: skip
    ap.add_argument("--strategy", default="8_4_48")
    ap.add_argument("--also-strategies", nargs="*", default=[],
                    help="measure the trained drafter with these strategies too ('default': the engine's default "
                    "set): accept and ceiling of each on the held-out answers")  # fmt: skip
    ap.add_argument("--lr", type=float, default=None,
                    help=f"peak rate (default: {BASE_LR:g} up to width {BASE_WIDTH}, then as 1/width)")  # fmt: skip
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    ap.add_argument("--no-greedy-answers", dest="greedy_answers", action="store_false",
                    help="train on the sampled answers only (default: each prompt's greedy answer too)")  # fmt: skip
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="tokens per training batch (default: 8192 on a GPU, 1024 on a CPU)",
    )
    ap.add_argument("--curve", type=int, default=0, help="points of the accept-vs-training-tokens curve (0 = none)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0,
                    help="fixes the answers, the drafter's initial weights and the data order")  # fmt: skip
    ap.add_argument(
        "--config",
        default=None,
        help="an RL config whose arithmetic task makes the prompts (the "
        "workload the drafter will serve); default: two-step two-digit word problems",
    )
    a = ap.parse_args(argv)
    task = None
    if a.config:
        try:
            task = ArithmeticTask.from_config_file(a.config)
        except ValueError as e:
            ap.error(f"--config {e}")
    rep = warmup(
        a.target,
        a.out,
        a.prompts,
        a.held_out,
        a.samples,
        a.steps,
        a.max_new_tokens,
        a.temperature,
        a.strategy,
        a.lr,
        a.batch_tokens,
        seed=a.seed,
        device=a.device,
        epochs=a.epochs,
        noise_std=a.noise_std,
        token_weight=a.token_weight,
        hidden_weight=a.hidden_weight,
        unroll=a.unroll,
        eval_temperatures=tuple(a.eval_temperatures),
        gen_batch=a.gen_batch,
        unroll_context=a.unroll_context,
        loss_temperature=a.loss_temperature,
        sampled_weight=a.sampled_weight,
        draft_vocab=a.draft_vocab,
        fc_bias=not a.no_fc_bias,
        export_format=a.format,
        task=task,
        lr_schedule=a.lr_schedule,
        greedy_answers=a.greedy_answers,
        curve_points=a.curve,
        feature_layers="auto" if a.feature_layers == ["auto"] else [int(i) for i in a.feature_layers],
        also_strategies=tuple(DEFAULT_STRATEGIES if a.also_strategies == ["default"] else a.also_strategies),
    )
    print(
        f"{rep['generated_tokens']} tokens generated in {rep['generation_seconds']:.0f}s, "
        f"{rep['train_steps']} steps in {rep['train_seconds']:.0f}s (of {rep['total_seconds']:.0f}s: loading "
        f"{rep['load_seconds']:.0f}s, measuring {rep['measure_seconds']:.0f}s); drafter in {rep['drafter']}"
    )
    g = rep["generation_split"]
    print(
        f"generation: prefill {g['prefill_seconds']:.1f}s, decode {g['decode_seconds'] + g['sd_seconds']:.1f}s in "
        f"{g['decode_steps']} steps of {g['mean_decode_batch']:.0f} sequences on average, between steps "
        f"{g['other_seconds']:.1f}s, {g['preemptions']} preemptions"
    )
    for t, acc in rep["accept_length"].items():
        print(
            f"accept length with {rep['strategy']} at T={t}: {acc['before']:.2f} untrained -> {acc['after']:.2f} "
            f"(a perfect drafter: {acc['ceiling']:.2f}, {acc['after'] / acc['ceiling']:.0%} of it)"
        )
    if len(rep["accept_by_strategy"]) > 1:
        rows = sorted(rep["accept_by_strategy"].items(), key=lambda kv: -kv[1]["ratio"])
        print(f"at T={rep['temperature']:g}, by strategy (accept of ceiling): " + ", ".join(
            f"{name} {r['accept']:.2f} of {r['ceiling']:.2f} ({r['ratio']:.0%})" for name, r in rows))  # fmt: skip
    for c in rep["curve"]:
        print(f"  after {c['train_tokens'] / 1e6:.2f}M training tokens ({c['seconds']:.0f}s): accept {c['accept']:.2f} "
              f"of {c['ceiling']:.2f} ({c['accept'] / c['ceiling']:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
