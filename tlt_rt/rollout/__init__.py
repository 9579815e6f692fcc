"""The rollout engine: continuous batching, paged KV cache, adaptive speculative decoding."""

from tlt_rt.rollout.engine import Engine
from tlt_rt.rollout.params import Completion, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
