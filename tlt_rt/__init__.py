"""tlt_rt: a Triton-first runtime for RL rollouts with lossless, adaptive speculative decoding."""

__version__ = "0.1.0"
__all__ = ["__version__", "compile"]


def __getattr__(name: str):
    # `tlt_rt.compile(config)`: the submodule is callable, imported on first use so that
    # `python -m tlt_rt.compile` and a plain `import tlt_rt` stay light
    if name == "compile":
        import importlib

        return importlib.import_module("tlt_rt.compile")
    raise AttributeError(f"module 'tlt_rt' has no attribute {name!r}")
