"""What a step logs beside its own rollout, outside its timing: held-out accuracy (`logging.eval_every`) and
the perfect-drafter ceiling of accept length on the step's answers (`logging.accept_ceiling`), and the
online drafter's accept length beside a frozen copy of the run's starting drafter on those answers
(`logging.drafter_curve`).

Held-out problems are never trained on: an arithmetic or reasoning-gym task holds out the problems of another
seed, a dataset task reads `task.eval_path`. Evaluation answers each once, greedy by default, with the same
engine as the rollout (so with speculation on, through the speculative path: greedy output is identical either
way).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tlt_rt.options import ConfigError
from tlt_rt.train.batching import split_even
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.rl.data import ArithmeticTask, Problem, ReasoningGymTask, format_prompt, load_dataset_file
from tlt_rt.train.rl.metrics import percentile

# added to task.seed for the held-out arithmetic problems: "arith:{seed}:{index}" strings of another seed
# share no random stream with the training prompts
HELD_OUT_SEED_OFFSET = 1_000_003


def held_out_problems(cfg: TLTConfig) -> list[Problem]:
    """The fixed held-out set of `logging.eval_prompts` problems; [] when evaluation is off."""
    t, n = cfg.task, cfg.logging.eval_prompts
    if not cfg.logging.eval_every:
        return []
    if t.kind == "arithmetic":
        task = ArithmeticTask.from_config(t, HELD_OUT_SEED_OFFSET)
        return task.sample(n)
    if t.kind == "reasoning_gym":
        return ReasoningGymTask.from_config(t, held_out=True).sample(n)
    if not t.eval_path:
        raise ConfigError(
            "task.eval_path",
            f"is needed for logging.eval_every={cfg.logging.eval_every} with task.kind={t.kind}: a file of "
            "held-out records (or set logging.eval_every=0)",
        )
    problems = load_dataset_file(t.eval_path, t.question_field, t.answer_field)
    if not problems:
        raise ConfigError("task.eval_path", f"{t.eval_path} holds no records")
    return problems[:n]


def due(cfg: TLTConfig, step: int) -> bool:
    """Whether a held-out evaluation runs before `step` (step 0, then every eval_every steps)."""
    every = cfg.logging.eval_every
    return bool(every) and step % every == 0


def evaluate(pool, tokenizer, problems: list[Problem], cfg: TLTConfig, score: Callable[[str, Problem], float]) -> dict:
    """Answer `problems` over the workers once each, `score(text, problem)` scoring each answer; returns the
    held-out metrics for the step record."""
    t0 = time.time()
    lg, r = cfg.logging, cfg.rollout
    prompts = [format_prompt(p, tokenizer, instruction=cfg.task.instruction or None) for p in problems]
    bounds = split_even(len(prompts), pool.size)
    params = dict(n=1, temperature=lg.eval_temperature, max_new_tokens=lg.eval_max_new_tokens or r.max_new_tokens,
                  seed=cfg.rl.seed)  # fmt: skip
    if lg.eval_temperature > 0:
        params.update(top_p=r.top_p, top_k=r.top_k)
    results = pool.call_all("evaluate", [(prompts[lo:hi], params) for lo, hi in bounds])
    rewards, lengths = [], []
    for (lo, _), samples in zip(bounds, results, strict=True):
        for s in samples:
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            rewards.append(score(text, problems[lo + s.prompt_index]))
            lengths.append(len(s.token_ids))
    n = max(len(rewards), 1)
    return {
        "heldout_accuracy": sum(x >= 1.0 for x in rewards) / n,
        "heldout_reward": sum(rewards) / n,
        "heldout_len_p50": percentile(lengths, 50),
        "heldout_n": len(rewards),
        "eval_seconds": time.time() - t0,
    }


def _per_strategy(parts: list[dict[str, tuple[int, int]]]) -> dict[str, float]:
    """Tokens per step of each strategy, from (tokens, steps) counts summed over the workers' parts."""
    totals: dict[str, list[int]] = {}
    for part in parts:
        for name, (tokens, steps) in part.items():
            acc = totals.setdefault(name, [0, 0])
            acc[0], acc[1] = acc[0] + tokens, acc[1] + steps
    return {name: tokens / steps for name, (tokens, steps) in totals.items() if steps}


def _most_used(by: dict[str, float], strategy_use: dict[str, int]) -> str:
    """The strategy the step used most among those of `by` (the first of `by` when none was used)."""
    used = [s for s in sorted(strategy_use, key=strategy_use.get, reverse=True) if s in by]
    return used[0] if used else next(iter(by))


def accept_ceiling(pool, strategy_use: dict[str, int]) -> dict:
    """The step's perfect-drafter ceiling per strategy, summed over workers, and the one of the strategy the
    step used most (the one its accept length is compared with); {} when no worker kept hidden states."""
    by = _per_strategy(pool.call_all("accept_ceiling", [()] * pool.size))
    if not by:
        return {}
    return {"accept_ceiling": by[_most_used(by, strategy_use)], "accept_ceiling_by_strategy": by}


def drafter_curve(pool, n_answers: int, strategy_use: dict[str, int]) -> dict:
    """The online drafter's and the frozen starting drafter's accept length on the step's answers (the
    measure of `accept_ceiling` with the drafter's top-k), per strategy and for the one the step used most;
    `n_answers` (0 = all) is spread over the workers. {} when no worker kept hidden states."""
    t0 = time.time()
    shares = [(hi - lo,) for lo, hi in split_even(n_answers, pool.size)] if n_answers else [(None,)] * pool.size
    parts = [p for p in pool.call_all("drafter_curve", shares) if p]
    online, frozen = (_per_strategy([p[key] for p in parts]) for key in ("online", "frozen"))
    if not online:
        return {}
    name = _most_used(online, strategy_use)
    return {"drafter_accept_online": online[name], "drafter_accept_frozen": frozen[name],
            "drafter_accept_online_by_strategy": online, "drafter_accept_frozen_by_strategy": frozen,
            "drafter_curve_seconds": time.time() - t0}  # fmt: skip
