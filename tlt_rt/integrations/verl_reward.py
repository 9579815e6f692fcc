"""verl's custom reward function over the project's verifiable reward (`tlt_rt.train.rl.reward.reward`).

    reward.custom_reward_function.path=$PWD/tlt_rt/integrations/verl_reward.py \\
    reward.custom_reward_function.name=compute_score

(or `path=pkg://tlt_rt.integrations.verl_reward`). verl's reward manager calls
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` for each response, the
response decoded without special tokens; the score is 1.0 when the response's final answer ("The answer is
N.", a `\\boxed{}`, else its last number) equals the ground truth by value, else 0.0. The returned dict also
carries `acc` and the extracted answer (`pred`) for verl's reward metrics. Imports no verl: the function
runs wherever tlt_rt does.
"""

from __future__ import annotations

from typing import Any

from tlt_rt.train.rl.reward import extract_answer, reward


def compute_score(
    data_source: str | None = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """{"score": 1.0 or 0.0, "acc": the same, "pred": the extracted answer or ""}."""
    answer = None if ground_truth is None else str(ground_truth)
    score = reward(solution_str, answer)
    pred = extract_answer(solution_str) if isinstance(solution_str, str) else None
    return {"score": score, "acc": score, "pred": pred or ""}
