"""What an engine counts as it runs: steps by kind, the accept-length histogram and strategy use, the
step timeline (one entry a step: what ran, on how many sequences, for how long) and generation time."""

from __future__ import annotations

import time
from collections import Counter


class EngineStats:
    def __init__(self) -> None:
        # counts the scheduler adds to as well: prefill_steps, generated_tokens, preemptions
        self.counts: Counter = Counter()
        self.accept_hist: Counter = Counter()  # tokens emitted per speculative step (accepted + 1)
        self.strategy_use: Counter = Counter()
        self.timeline: list[dict] = []
        self.gen_time = 0.0
        self.t_start = time.perf_counter()  # the timeline's zero: the start of the current generate call

    def decode_step(self, strategy, accept_len) -> None:
        """Count one decode step: plain (`strategy` None) or speculative with per-sequence `accept_len`."""
        self.counts["steps"] += 1
        if strategy is not None:
            self.counts["sd_steps"] += 1
            self.strategy_use[str(strategy)] += 1
            self.accept_hist.update([a + 1 for a in accept_len])

    def record(self, kind, strategy, batch, tokens, t0, running, seconds=None, behind: int = 0) -> None:
        """A timeline entry for a step that began at perf_counter `t0`; `behind`: the drafter rows a
        speculative step caught up eagerly before its block, as the policy counted them (0 where not counted)."""
        self.timeline.append(
            {
                "kind": kind,
                "strategy": str(strategy) if strategy else None,
                "batch": batch,
                "tokens": tokens,
                "start": t0 - self.t_start,
                "seconds": time.perf_counter() - t0 if seconds is None else seconds,
                "running": running,
                "behind": behind,
            }
        )

    def summary(self) -> dict:
        c, hist = self.counts, dict(sorted(self.accept_hist.items()))
        n_sd = sum(hist.values())
        return {
            "steps": c["steps"],
            "sd_steps": c["sd_steps"],
            "decode_steps": c["steps"] - c["sd_steps"],
            "prefill_steps": c["prefill_steps"],
            "generated_tokens": c["generated_tokens"],
            "preemptions": c["preemptions"],
            "accept_length_hist": hist,
            "mean_accept_length": (sum(k * v for k, v in hist.items()) / n_sd) if n_sd else None,
            "strategy_use": dict(self.strategy_use),
            "tokens_per_second": c["generated_tokens"] / self.gen_time if self.gen_time else 0.0,
        }


def timeline_split(entries: list[dict], wall: float) -> dict:
    """Where `wall` seconds of generation went, from the timeline entries of those seconds: seconds in prefill,
    plain (`decode`) and speculative (`sd`) steps, keyed `<kind>_seconds` by the timeline's kinds, and the rest
    (`other_seconds`: host work between steps, set-up, the end); with the decode steps' count, rows and mean
    batch, so a slow generation says whether its steps or its batches were the cause."""
    split = dict.fromkeys(("prefill", "decode", "sd"), 0.0)
    decode_rows = decode_steps = 0
    for e in entries:
        split[e["kind"]] += e["seconds"]
        if e["kind"] != "prefill":
            decode_steps += 1
            decode_rows += e["batch"]
    out = {f"{k}_seconds": v for k, v in split.items()}
    out["other_seconds"] = wall - sum(split.values())
    out["decode_steps"], out["decode_rows"] = decode_steps, decode_rows
    out["mean_decode_batch"] = decode_rows / decode_steps if decode_steps else 0.0
    return out
