"""The rollout by batch size: where its time goes per power-of-two bucket of running sequences, the speedup at
equal work (each run's tokens/s per bucket applied to the baseline's tokens), plain steps by their place after
another kind of step."""

from __future__ import annotations

import statistics

from tlt_rt.compare.records import measured, values


def buckets(records: list[dict]) -> dict[int, dict[str, float]]:
    """Per batch bucket, the run's decode and SD seconds and tokens summed over `records`."""
    out: dict[int, dict[str, float]] = {}
    for r in records:
        for b, row in (r.get("batch_buckets") or {}).items():
            acc = out.setdefault(int(b), {})
            for k, v in row.items():
                acc[k] = acc.get(k, 0.0) + v
    return dict(sorted(out.items()))


def _totals(row: dict[str, float]) -> tuple[float, float]:
    """A bucket row's (seconds, tokens), plain and speculative steps together."""
    return row["decode_s"] + row["sd_s"], row["decode_tokens"] + row["sd_tokens"]


def bucket_table(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    """Where the rollout's time goes per batch size: each run's seconds and tokens per second per bucket, SD
    share and accept length where it speculated, and the bucket's speedup over the first run (tok/s ratio)."""
    per = {n: buckets(measured(r, warmup)) for n, r in runs.items()}
    all_b = sorted({b for p in per.values() for b in p})
    if not all_b:
        return []
    names = list(runs)
    head = "| batch | " + " | ".join(f"{n} s | {n} tok/s | {n} SD | {n} accept" for n in names) + " |"
    md = [head, "|---:|" + "---:|---:|---:|---:|" * len(names)]
    for b in all_b:
        cells = []
        for n in names:
            row = per[n].get(b)
            if not row:
                cells += ["-"] * 4
                continue
            secs, toks = _totals(row)
            rate, share = (f"{toks / secs:.0f}", f"{row['sd_s'] / secs:.0%}") if secs else ("-", "-")
            accept = f"{row['sd_tokens'] / row['sd_rows']:.2f}" if row["sd_rows"] else "-"
            cells += [f"{secs:.1f}", rate, share, accept]
        md.append(f"| {b} | " + " | ".join(cells) + " |")
    return md


def _rate_time(rows: dict[str, dict] | dict[int, dict], rates: dict[int, float]) -> tuple[float, float]:
    """(decode seconds spent, seconds at `rates`) over the buckets of `rows` (a bucket without a rate keeps
    its own time)."""
    spent = at = 0.0
    for b, row in rows.items():
        secs, toks = _totals(row)
        spent += secs
        rate = rates.get(int(b))
        at += toks / rate if rate else secs
    return spent, at


def _saved(rows: dict, rates: dict[int, float]) -> float:
    spent, at = _rate_time(rows, rates)
    return spent - at


def equal_work(base: list[dict], run: list[dict], warmup: int = 1) -> dict | None:
    """The run's speed on the baseline's work: sampled answers differ between runs, and a run whose tail
    happened to be long waits more at batch 1, so the two step times also differ by luck. Here the baseline's
    decode tokens of each batch bucket are timed at the run's own tokens/s in that bucket (the baseline's where
    the run has no such bucket), and the decode time saved comes off each baseline step: per worker where the
    records have each worker's buckets (the step then waits for the worker that is last after the saving),
    else spread evenly over the workers. Prefill and the rest of the step stay the baseline's. Returns the
    rollout decode speed ratio, the estimated step seconds and the speedup; None without bucket records."""
    b_rows, r_rows = measured(base, warmup), measured(run, warmup)
    pb = buckets(b_rows)
    steps = values(b_rows, "step_seconds")
    if not pb or not steps or len(steps) != len(b_rows):
        return None
    rates = {}
    for b, row in buckets(r_rows).items():
        secs, toks = _totals(row)
        if secs > 0 and toks > 0:
            rates[b] = toks / secs
    spent, at_run = _rate_time(pb, rates)
    if spent <= 0 or at_run <= 0:
        return None
    estimated = []
    for r in b_rows:
        ends, per = r.get("worker_rollout_seconds") or [], r.get("batch_buckets_by_worker")
        if per and len(per) == len(ends):
            after = [end - _saved(rows, rates) for end, rows in zip(ends, per, strict=True)]
            estimated.append(r["step_seconds"] - (max(ends) - max(after)))
        else:
            estimated.append(r["step_seconds"] - _saved(r.get("batch_buckets") or {}, rates) / max(len(ends), 1))
    step = statistics.fmean(estimated)
    return {"decode_ratio": spent / at_run, "step_seconds": step, "speedup": statistics.fmean(steps) / step}


def equal_work_lines(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    names = list(runs)
    out = []
    for n in names[1:]:
        est = equal_work(runs[names[0]], runs[n], warmup)
        if est is not None:
            out.append(f"- {n}: decodes {names[0]}'s tokens {est['decode_ratio']:.2f}x as fast (per batch size, "
                       f"at its own tokens/s); with {names[0]}'s prefill and other step time, a step of "
                       f"{est['step_seconds']:.2f} s: **{est['speedup']:.2f}x** at equal work")  # fmt: skip
    return out


def plain_step_table(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    """Plain decoding steps' time per batch bucket, by place after a prefill or SD step (1, 2, 3+): each
    step's median, averaged over the measured steps weighted by their counts (`plain_step_ms` records)."""
    per: dict[str, dict[int, dict[str, list[float]]]] = {}
    for n, records in runs.items():
        acc = per.setdefault(n, {})
        for r in measured(records, warmup):
            for b, places in (r.get("plain_step_ms") or {}).items():
                for place, (count, ms) in places.items():
                    cell = acc.setdefault(int(b), {}).setdefault(place, [0.0, 0.0])
                    cell[0] += count
                    cell[1] += count * ms
    all_b = sorted({b for acc in per.values() for b in acc})
    if not all_b:
        return []
    names = list(runs)
    md = ["| batch | " + " | ".join(f"{n} ms (1 / 2 / 3+)" for n in names) + " |", "|---:|" + "---:|" * len(names)]
    for b in all_b:
        cells = []
        for n in names:
            row = per[n].get(b, {})
            cells.append(" / ".join(f"{row[k][1] / row[k][0]:.2f}" if k in row and row[k][0] else "-"
                                    for k in ("1", "2", "3+")))  # fmt: skip
        md.append(f"| {b} | " + " | ".join(cells) + " |")
    return md
