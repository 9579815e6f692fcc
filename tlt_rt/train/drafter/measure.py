"""What the drafter warm-up measures: accept length on held-out prompts, the perfect-drafter ceiling of the
same tree on the same answers, each strategy's pair on an engine of its own, and the accept-vs-tokens curve."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from tlt_rt.ir.strategy import Strategy, scratch_tokens
from tlt_rt.rollout import Engine, SamplingParams
from tlt_rt.train.drafter.eval import oracle_tree_steps


def accept_length(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Mean tokens emitted per speculative step on `prompts` (the engine must speculate on every step)."""
    return accept_and_answers(engine, prompts, params)[0]


def accept_and_answers(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[dict]]:
    """`accept_length`, and the answers it counted as `drafter_eval` samples ({"ids": prompt + answer on the
    target's device, "prompt_len"}), on which the perfect-drafter ceiling of the same steps is computed."""
    before = engine.stats()["accept_length_hist"]
    outs = engine.generate(prompts, params)
    hist = {k: v - before.get(k, 0) for k, v in engine.stats()["accept_length_hist"].items()}
    n = sum(hist.values())
    acc = sum(k * v for k, v in hist.items()) / n if n else float("nan")
    dev = engine.target.lm_head.weight.device
    answers = [
        {
            "ids": torch.tensor(prompts[o.prompt_index] + o.token_ids, device=dev),
            "prompt_len": len(prompts[o.prompt_index]),
        }
        for o in outs
    ]
    return acc, answers


def ceiling(target, answers: list[dict], temperature: float, strategy: str) -> float:
    """The perfect-drafter ceiling of `strategy`'s tree and verify budget on `answers` (oracle_tree_steps)."""
    st = Strategy.parse(strategy)
    chunk = 512 if target.lm_head.weight.device.type == "cuda" else 64  # root rows per batched walk
    return oracle_tree_steps(target, answers, temperature, st.depth, st.topk, st.verify_tokens, chunk)


BLOCK_SIZE = 16  # the KV-cache blocks of `strategy_accept`'s engines


def measuring_options(strategy: str, prompts: list[list[int]], max_new_tokens: int, n: int = 1) -> dict:
    """Engine options for measuring `strategy` on `prompts` (`n` answers each, at most `max_new_tokens`):
    speculation on every step, the context as long as the longest answer needs, and steps captured at the whole
    batch alone (padding rows change no accept length, and a capture and a compile per size cost more than
    padding the last answers' steps does)."""
    batch = max(1, len(prompts) * n)
    longest = max(len(p) for p in prompts) + max_new_tokens + scratch_tokens(Strategy.parse(strategy)) + 1
    return dict(speculative="on", strategies=(strategy,), max_batch=batch, graph_batches=[batch], max_context=longest)


def strategy_accept(target, drafter, strategy: str, prompts: list[list[int]], params: SamplingParams,
                    temperature: float) -> dict:  # fmt: skip
    """{"accept", "ceiling"} of `drafter` with `strategy` on `prompts` (an engine of its own, its KV cache sized
    for these prompts rather than half the free memory, released after)."""
    options = measuring_options(strategy, prompts, params.max_new_tokens, params.n)
    blocks = 2 * options["max_batch"] * -(-options["max_context"] // BLOCK_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(target, drafter=drafter, num_blocks=blocks, block_size=BLOCK_SIZE, **options)
    acc, answers = accept_and_answers(engine, prompts, params)
    out = {"accept": acc, "ceiling": ceiling(target, answers, temperature, strategy)}
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def plot_curve(curve: list[dict], path: Path, title: str) -> Path:
    """Accept length and its ceiling against the training tokens seen, with the ratio on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [c["train_tokens"] / 1e6 for c in curve]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [c["accept"] for c in curve], "o-", label="drafter")
    ax.plot(x, [c["ceiling"] for c in curve], "s--", label="perfect drafter (ceiling)")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("accept length (tokens a step)")
    ax.set_ylim(bottom=1.0)
    ratio = ax.twinx()
    ratio.plot(x, [c["accept"] / c["ceiling"] for c in curve], ":", color="grey", label="drafter / ceiling")
    ratio.set_ylabel("drafter / ceiling")
    ratio.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()
    more = ratio.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title(f"drafter warm-up: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
