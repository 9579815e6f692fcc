"""benchmarks/step_phases.py's instrumentation on the CPU: every function it wraps still exists under the
name it wraps, and an instrumented engine decodes as before, each phase's range opened."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from tests.helpers.engine import PROMPTS, make_engine
from tlt_rt.rollout import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_phases  # noqa: E402

import tlt_rt.codegen.draft as draft  # noqa: E402


def test_instrumented_engine_decodes_the_same_in_its_phases(monkeypatch):
    for name in ("level_meta", "top_children"):
        monkeypatch.setattr(draft, name, getattr(draft, name))  # restored after the test
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    want = [o.token_ids for o in make_engine(enforce_eager=True).generate(PROMPTS, params)]
    eng = make_engine(enforce_eager=True)
    step_phases.instrument(eng)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert got == want
    seen = {e.name for e in prof.events() if e.name.startswith("phase:")}
    # speculation "on": every step drafts, so no ROOT
    nodes = {"catchup", "level", "level-meta", "topk", "rerank", "verify", "accept", "commit", "output"}
    assert {f"phase:{n}" for n in nodes} <= seen, seen
    assert eng.stats()["sd_steps"] > 0
