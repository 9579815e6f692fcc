"""tlt_rt: a Triton-first runtime for RL rollouts with lossless, adaptive speculative decoding."""

__version__ = "0.1.0"

from tlt_rt.compile import compile  # noqa: E402,A004  (tlt_rt.compile(config), also python -m tlt_rt.compile)

__all__ = ["__version__", "compile"]
