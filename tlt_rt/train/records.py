"""A step's metrics record, its per-worker timelines and its one-line summary for the console."""

from __future__ import annotations

from tlt_rt.train.cluster.results import StepRollout
from tlt_rt.train.rl.learner import LearnResult
from tlt_rt.train.rl.metrics import percentile, rollout_metrics, spot_metrics, worker_timeline


def step_record(
    step,
    outcome,
    rewards,
    responses,
    drop,
    samples,
    learn: list[LearnResult],
    t0,
    t_rollout,
    t_end,
    *,
    kl: bool,
    version: int,
    restarts: int,
) -> dict:
    """The metrics record of one step, as `metrics.jsonl` holds it."""
    lengths = [len(c[0]) for row in responses for c in row]
    results = outcome.results
    rollout_s = outcome.end - outcome.start
    trainings = list(outcome.trainings.values()) + [res.tail for res in results if res.tail]
    idle = sum(max(0.0, outcome.end - res.end) for res in results)
    ends = [res.end - outcome.start for res in results]  # each worker's rollout, from the step's start
    # preemption waits for the current drafter micro-step: how long that held the step up
    overrun = max([t.end - outcome.end for t in outcome.trainings.values() if t.steps], default=0.0)
    tokens = sum(x.tokens for x in learn)
    rec = {
        "step": step,
        "reward_mean": float(rewards.mean()),
        "accuracy": float((rewards >= 1.0).float().mean()),
        "response_len_p50": percentile(lengths, 50),
        "response_len_p90": percentile(lengths, 90),
        "response_len_p99": percentile(lengths, 99),
        "response_len_max": max(lengths) if lengths else 0,
        "response_lengths": lengths,  # the step's length histogram (report.py, e2e plots)
        "truncated_share": sum(c[2] == "length" for row in responses for c in row) / max(len(lengths), 1),
        "groups_dropped": int(drop.sum()),
        "samples_trained": len(samples),
        **rollout_metrics(results, rollout_s),
        "worker_rollout_seconds": ends,
        # the workers' tail: from the first worker done to the last (0 with one worker)
        "worker_gap_seconds": max(ends) - min(ends) if ends else 0.0,
        **spot_metrics(trainings, idle),
        "spot_overrun_seconds": max(0.0, overrun),
        "learner_seconds": t_end - t_rollout,
        **learner_rates(learn),
        "loss": sum(x.loss for x in learn) if learn else None,
        "grad_norm": learn[0].grad_norm if learn else None,
        "clip_low_share": sum(x.clipped_low for x in learn) / tokens if tokens else None,
        "clip_high_share": sum(x.clipped_high for x in learn) / tokens if tokens else None,
        # exp(new - old log-prob) averaged over tokens: 1 on the first mini-batch when the engine's
        # log-probs are the policy's own
        "ratio_mean": sum(x.ratio_sum for x in learn) / tokens if tokens else None,
        "kl": sum(x.kl_sum for x in learn) / tokens if tokens and kl else None,
        "policy_version": version,
        "step_seconds": t_end - t0,
        "rollout_share": rollout_s / (t_end - t0) if t_end > t0 else None,
        "worker_restarts": restarts,
        "sd_policy": merge_sd_policy([res.sd_policy for res in results]),
    }
    return rec


def learner_rates(learn: list[LearnResult]) -> dict:
    """The update's speed (forward tokens/s per worker, model TFLOP/s, MFU against the device's bf16 peak) and
    the GPU memory peaks of the step's two phases (GiB, the largest over workers): allocated by tensors
    (gpu_peak_*) and held by the allocator (gpu_reserved_*, which also counts the captured steps' pool and
    cached free blocks: what the device must have)."""
    busy = [x for x in learn if x.seconds > 0 and x.forward_tokens > 0]
    out: dict = {"learner_tokens_per_second": None, "learner_tflops": None, "learner_mfu": None}
    if busy:
        out["learner_tokens_per_second"] = sum(x.forward_tokens / x.seconds for x in busy) / len(busy)
        out["learner_tflops"] = sum(x.flops / x.seconds for x in busy) / len(busy) / 1e12
        if all(x.peak_flops for x in busy):
            out["learner_mfu"] = sum(x.flops / x.seconds / x.peak_flops for x in busy) / len(busy)
    if learn:  # the update's own clock (the slowest worker), and what can make one much slower
        out["learner_update_seconds"] = max(x.seconds for x in learn)
        out["learner_alloc_retries"] = int(sum(x.alloc_retries for x in learn))
        out["learner_compiles"] = int(sum(x.compiles for x in learn))
    for phase in ("rollout", "learn"):
        for kind in ("peak", "reserved"):
            peaks = [getattr(x, f"{kind}_{phase}_bytes") for x in learn]
            peaks = [p for p in peaks if p is not None]
            out[f"gpu_{kind}_{phase}_gib"] = max(peaks) / 2**30 if peaks else None
    return out


def timelines(outcome: StepRollout) -> dict[str, list]:
    """Per worker, its rollout and drafter-training bars of the step, relative to the rollout's start."""
    t0, end = outcome.start, outcome.end - outcome.start
    out = {}
    for res in outcome.results:
        roll = {"start": res.start - t0, "end": res.end - t0, "timeline": res.timeline}
        if res.tail and res.tail.steps:
            roll["tail_training"] = [res.tail.start - t0, res.tail.end - t0]
        tr = outcome.trainings.get(res.rank)
        tr = {"steps": tr.steps, "start": tr.start - t0, "end": tr.end - t0} if tr and tr.steps else None
        out[str(res.rank)] = worker_timeline(roll, tr, max(end, tr["end"] if tr else end))
    return out


def merge_sd_policy(parts: list[dict | None]) -> dict | None:
    """The workers' SD policy readings in one: per batch bucket, the first worker's that decoded there."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    buckets: dict[str, dict] = {}
    for p in parts:
        for b, row in p["buckets"].items():
            buckets.setdefault(b, row)
    return {"mode": parts[0]["mode"], "buckets": dict(sorted(buckets.items(), key=lambda kv: int(kv[0])))}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary_line(r: dict) -> str:
    ceiling = f" of {r['accept_ceiling']:.2f} ceiling" if r.get("accept_ceiling") is not None else ""
    if r.get("drafter_accept_online") is not None:  # logging.drafter_curve, on the step's answers
        ceiling += f" (drafter {r['drafter_accept_online']:.2f} online, {r['drafter_accept_frozen']:.2f} frozen)"
    held = f" | held-out acc {r['heldout_accuracy']:.2f}" if r.get("heldout_accuracy") is not None else ""
    if r.get("rollout_share") is not None:
        held = f" | rollout {r['rollout_share']:.0%} of the step" + held
    parts = [f"update {r['learner_update_seconds']:.1f}s"] if r.get("learner_update_seconds") is not None else []
    if r.get("learner_mfu") is not None:
        parts.append(f"MFU {r['learner_mfu']:.0%}")
    parts += [f"{n} {what}" for n, what in ((r.get("learner_compiles"), "compiles"),
                                             (r.get("learner_alloc_retries"), "allocator retries")) if n]  # fmt: skip
    mfu = f" ({', '.join(parts)})" if parts else ""
    return (
        f"reward {r['reward_mean']:.3f} acc {r['accuracy']:.2f} len p50/max "
        f"{r['response_len_p50']:.0f}/{r['response_len_max']} | rollout {r['rollout_seconds']:.1f}s tail "
        f"{r['tail_share']:.0%} SD {r['sd_share']:.0%} accept {_fmt(r['accept_length'], '.2f')}{ceiling} "
        f"{r['tokens_per_second']:.0f} tok/s | drafter {r['spot_steps']} steps loss {_fmt(r['drafter_loss'], '.3f')} "
        f"harvested {r['harvested_worker_seconds']:.1f}s | learner {r['learner_seconds']:.1f}s{mfu} "
        f"loss {_fmt(r['loss'], '.4f')}{held}"
    )
