"""The rollout engine: continuous batching, paged KV cache, adaptive speculative decoding."""

from tlt_rt.rollout.async_engine import AsyncEngine, RequestOutput
from tlt_rt.rollout.engine import Engine
from tlt_rt.rollout.params import Completion, SamplingParams

__all__ = ["AsyncEngine", "Completion", "Engine", "RequestOutput", "SamplingParams"]
