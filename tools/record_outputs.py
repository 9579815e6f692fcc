"""Record what Engine.generate and AsyncEngine return for fixed seeds, to check a host-side change changes none
of it (tokens, log-probs bit for bit, finish reasons, hidden rows).

    python tools/record_outputs.py --save before.json     # on the old code
    python tools/record_outputs.py --check before.json    # on the new code: exits 1 on any difference

Configs cover greedy and sampled (plain, top-k / top-p), SD off / fixed strategies / auto, stop tokens,
max_new_tokens and context limits, preemption, return_hidden and AsyncEngine per-request settings. "auto"
and "on" with several strategies run under a scripted policy (a fixed mix of plain and speculative steps):
the real policy decides from wall-clock timings, and a sampled token depends on the tree it was drawn
through (a greedy run of the real "auto" policy is recorded too, tokens only).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_async_engine import SETTINGS  # noqa: E402  (mixed per-request settings, both spellings)
from tests.test_engine import PROMPTS, make_engine  # noqa: E402
from tlt_rt.rollout import AsyncEngine, SamplingParams  # noqa: E402

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.9)
FILTERED = dict(temperature=0.7, top_k=4, top_p=0.9)


def _outs(outs) -> list:
    rows = []
    for o in outs:
        h = None if o.hidden is None else hashlib.sha256(o.hidden.float().numpy().tobytes()).hexdigest()[:16]
        rows.append([o.prompt_index, o.sample_index, o.token_ids, [repr(x) for x in o.logprobs], o.finish_reason, h])
    return rows


def _scripted(eng, plain: bool = True) -> None:
    """A deterministic mix of plain (unless not `plain`) and speculative steps (bursts, every strategy)."""
    options = [None, None, None, *eng.strategies, None, eng.strategies[0], eng.strategies[0]]
    options = options if plain else [o for o in options if o is not None]
    calls = [0]

    def decide(batch_size: int, behind: int = 0):
        calls[0] += 1
        return options[(calls[0] * 7 + batch_size) % len(options)]

    eng.policy.decide = decide


def generate_cases() -> dict:
    cases = {}
    specs = [
        ("off", ("3_3_8",), {}),
        ("on", ("3_3_8", "4_2_6"), {}),
        ("on", ("2_4_10",), {}),
        ("on", ("4_2_6",), {"num_blocks": 40}),  # preemption
        ("on", ("3_3_8",), {"max_context": 24}),  # the context limit
        ("off", ("3_3_8",), {"max_context": 24}),
        ("auto", ("3_3_8", "4_2_6"), {}),
        ("scripted", ("3_3_8", "4_2_6"), {}),
        ("scripted", ("3_3_8", "4_2_6"), {"num_blocks": 48}),
    ]
    kinds = [
        ("greedy", dict(GREEDY, n=2, max_new_tokens=24, stop_token_ids=[])),
        ("sampled", dict(SAMPLED, n=3, max_new_tokens=30, seed=7, stop_token_ids=[])),
        ("filtered", dict(FILTERED, n=2, max_new_tokens=20, seed=3)),
        ("stops", dict(SAMPLED, n=2, max_new_tokens=40, stop_token_ids=[5, 7], seed=1)),
        ("hidden", dict(SAMPLED, n=2, max_new_tokens=13, seed=5, return_hidden=True)),
    ]
    for spec, strategies, kw in specs:
        for kind, p in kinds:
            if spec == "auto" and kind != "greedy":
                continue  # the real policy decides from timings: only greedy output is fixed
            eng = make_engine("auto" if spec == "scripted" else spec, strategies, **kw)
            if spec == "scripted":
                _scripted(eng)
            elif spec == "on" and len(strategies) > 1:
                _scripted(eng, plain=False)  # which strategy runs depends on timings: script it
            name = f"{spec}-{'+'.join(strategies)}-{kw}-{kind}"
            rows = _outs(eng.generate(PROMPTS, SamplingParams(**p)))
            # under the real auto policy the tree shapes vary with timings: log-probs may differ in the last ulp
            cases[name] = [r[:3] + r[4:5] for r in rows] if spec == "auto" else rows
            if spec != "auto":
                st = eng.stats()
                keys = ("generated_tokens", "steps", "accept_length_hist", "preemptions")
                cases[name + "-stats"] = [st[k] for k in keys]
    return cases


def async_cases() -> dict:
    import random

    rng = random.Random(0)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(11) for _ in range(rng.randrange(1, 14))]
        reqs.append((f"r{i}", prompt, dict(SETTINGS[i % len(SETTINGS)], ignore_eos=i % 4 == 0)))
    cases = {}
    for speculative in ("off", "on"):
        aeng = AsyncEngine(make_engine(speculative, ("3_3_8",)))

        async def drive(aeng=aeng):
            return await asyncio.gather(*[aeng.generate(p, d, rid) for rid, p, d in reqs])

        try:
            res = asyncio.run(drive())
        finally:
            aeng.shutdown()
        cases[f"async-{speculative}"] = [[r.request_id, _outs(r.outputs)] for r in res]
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--check", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = {**generate_cases(), **async_cases()}
    cases = json.loads(json.dumps(cases))
    if args.save:
        args.save.write_text(json.dumps(cases, indent=0))
        print(f"{len(cases)} cases saved to {args.save}")
        return
    want = json.loads(args.check.read_text())
    bad = [k for k in sorted(set(want) | set(cases)) if want.get(k) != cases.get(k)]
    for k in bad:
        print(f"DIFFERS: {k}")
    print(f"{len(cases) - len(bad)}/{len(cases)} cases identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
