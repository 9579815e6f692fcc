"""tlt_rt: a Triton-first runtime for RL rollouts with lossless, adaptive speculative decoding."""

__version__ = "0.1.0"
