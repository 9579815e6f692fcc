"""Why speculative decoding ran or not: the step costs and accept lengths the SD policy decided from.

A worker reads its engine's policy after a rollout (`explain_policy`); the driver turns the result into one
line for the step log and the run summary (`sd_reason`), e.g.

    SD unused: at batch <= 4 the best strategy 4_2_6 costs 2.7 plain steps and emits 1.3 tokens (measured):
    0.48x plain decoding, so the policy kept plain decoding
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def explain_policy(policy: Any, timeline: Sequence[dict]) -> dict | None:
    """Per batch bucket this rollout decoded at: plain decoding's step cost and the best-looking strategy's
    cost ratio, accept length (measured or prior) and implied speedup. None without a policy to read."""
    needed = ("mode", "strategies", "bucket", "costs", "accept")
    if policy is None or not all(hasattr(policy, n) for n in needed):
        return None
    batches = {e["batch"] for e in timeline if e.get("kind") in ("decode", "sd")}
    out: dict[str, dict] = {}
    for b in sorted({policy.bucket(n) for n in batches}):
        plain = policy.costs.interpolate(b, None)
        best: dict | None = None
        for s in policy.strategies if plain else ():
            cost = policy.costs.interpolate(b, s)
            if cost is None:
                continue
            measured = policy.accept.measured(b, s)
            accept = measured if measured is not None else policy.accept.mean(b, s)
            row = {"strategy": str(s), "cost_ratio": cost / plain, "accept": accept, "measured": measured is not None,
                   "speedup": accept * plain / cost}  # fmt: skip
            if best is None or row["speedup"] > best["speedup"]:
                best = row
        out[str(b)] = {"plain_ms": plain * 1e3 if plain else None, **(best or {})}
    return {"mode": policy.mode, "buckets": out}


def sd_why(record: dict, speculative: str) -> str:
    """The numbers behind the policy's choice at the smallest batch decoded (the tail, where speculation
    pays first): the best strategy's cost in plain steps, its accept length and the speedup they imply."""
    if speculative == "off":
        return "rollout.speculative=off"
    if speculative == "on":
        return "rollout.speculative=on: every decode step speculates, and no plain step is timed to price it against"
    why = record.get("sd_policy") or {}
    rows = [(int(b), r) for b, r in (why.get("buckets") or {}).items() if r.get("strategy")]
    if not rows:
        return "the policy has no step cost for a strategy yet (it times plain decoding first)"
    bucket, r = min(rows)
    source = "measured" if r["measured"] else "estimated: too few speculative steps to measure"
    numbers = (
        f"at batch <= {bucket} the best strategy {r['strategy']} costs {r['cost_ratio']:.1f} plain steps and emits "
        f"{r['accept']:.2f} tokens ({source}): {r['speedup']:.2f}x plain decoding"
    )
    if (record.get("sd_share") or 0.0) > 0:
        return numbers
    verdict = "so the policy kept plain decoding" if r["speedup"] <= 1 else "but it is held back until measured"
    return f"{numbers}, {verdict}"


def sd_reason(record: dict, speculative: str) -> str:
    """One line: how much of decoding was speculative, and the numbers that decided it."""
    if speculative == "off":
        return "SD off (rollout.speculative=off)"
    share = record.get("sd_share") or 0.0
    return (
        f"SD {share:.0%} of decode time; {sd_why(record, speculative)}"
        if share
        else f"SD unused: {sd_why(record, speculative)}"
    )
