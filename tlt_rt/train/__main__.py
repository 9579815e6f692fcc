"""`python -m tlt_rt.train CONFIG [key.sub=value ...] [--dry-run] [--help-config]`

Trains with GRPO: rollouts on Ray workers with adaptive speculative decoding, the drafter trained on
workers the rollout tail leaves idle. `--dry-run` validates the config and prints the placement plan
(nodes, tensor-parallel groups with their node, data-parallel replicas, placement-group bundles,
parallelism, memory per GPU) without loading any weights: shapes come from the model
folder's config.json, a .gguf file's header, or from the known-shapes table (`model.arch=qwen2.5-7b`,
...) for a checkpoint that is not on this machine or a registered model not fetched yet.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tlt_rt.config_loader import describe, load_config, parse_cli
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.default import converted_dir, fetched_gguf
from tlt_rt.models.gguf_shape import gguf_arch
from tlt_rt.models.registry import MODELS, fetch_command
from tlt_rt.models.shapes import KNOWN_SHAPES
from tlt_rt.options import ConfigError
from tlt_rt.train.cluster.placement import PlacementError, plan_layout
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.memory import describe as describe_memory
from tlt_rt.train.memory import forecast, param_count
from tlt_rt.train.preflight import preflight
from tlt_rt.train.rl.checkpoint import CheckpointError


def resolve_arch(cfg: TLTConfig) -> tuple[ArchConfig, str]:
    """The model's shape without loading weights, and where it came from."""
    m = cfg.model
    if m.arch is not None and m.arch not in KNOWN_SHAPES:
        raise ConfigError("model.arch", f"unknown shape {m.arch!r}; known: {', '.join(KNOWN_SHAPES)}")
    if m.path == "smollm2":
        return ArchConfig(**KNOWN_SHAPES["smollm2-135m"]), "embedded default (known shape smollm2-135m)"
    if m.path in MODELS:  # fetched: what the loader will read; else the registry's known shape
        gguf = fetched_gguf(m.path)
        converted = converted_dir(gguf) / "config.json" if gguf.is_file() else None
        if converted is not None and converted.is_file():
            return ArchConfig.from_file(converted), str(converted)
        if gguf.is_file():
            return _header_arch(gguf), f"{gguf} header"
        shape = MODELS[m.path].shape
        return ArchConfig(**KNOWN_SHAPES[shape]), f"known shape {shape}; not fetched yet: {fetch_command(m.path)}"
    p = Path(m.path).expanduser()
    if p.suffix == ".gguf" and p.is_file():  # the header holds the shape; the weights stay unread
        return _header_arch(p), "its GGUF header"
    cfg_json = p if p.name == "config.json" else p / "config.json"
    if cfg_json.is_file():  # the checkpoint itself wins over a declared shape
        return ArchConfig.from_file(cfg_json), str(cfg_json)
    if m.arch is not None:
        return ArchConfig(**KNOWN_SHAPES[m.arch]), f"known shape {m.arch}; {m.path} is not on this machine"
    raise ConfigError(
        "model.path",
        f"{m.path}: no config.json to read the shape from; for a dry run of a checkpoint that is not on this "
        f"machine set model.arch to one of {', '.join(KNOWN_SHAPES)}",
    )


def _header_arch(gguf: Path) -> ArchConfig:
    try:
        return gguf_arch(gguf)
    except ValueError as e:  # a damaged or foreign file is the config's fault, named by its key
        raise ConfigError("model.path", str(e)) from e


def plan(cfg: TLTConfig) -> str:
    """The placement plan and per-GPU (or per-worker on CPU) memory estimate, as text."""
    arch, source = resolve_arch(cfg)
    c, r = cfg.cluster, cfg.rollout
    gpu = c.gpus_per_worker > 0
    tp = c.tensor_parallel
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if gpu else "float32")
    params, _ = param_count(arch)
    total_gpus = c.num_workers * c.gpus_per_worker
    engines = c.num_workers * max(1, c.gpus_per_worker // tp)
    procs = c.num_workers * tp
    fsdp = cfg.rl.learner_shard == "fsdp"
    phases = forecast(cfg, arch)
    unit = "GPU" if gpu else "worker (CPU RAM)"
    lines = [
        f"model      {cfg.model.path}  [{source}]",
        f"           {arch.model_type}, {params / 1e9:.3f}B params, {arch.num_hidden_layers} layers, hidden "
        f"{arch.hidden_size}, vocab {arch.vocab_size}, {dtype}",
        f"workers    {c.num_workers} x {c.gpus_per_worker or 'CPU'} {'GPU' if gpu else ''}".rstrip()
        + (f" ({c.cpus_per_worker} cores each)" if not gpu else ""),
    ]
    lines += plan_layout(c).describe()
    if gpu:
        lines.append(f"           {total_gpus} GPUs in use")
    lines += [
        f"parallel   TP {tp} x DP {engines}: {engines} rollout engine(s); learner data parallel over "
        f"{procs} process(es), {'FSDP2-sharded' if fsdp else 'gradients all-reduced'} ({'NCCL' if gpu else 'gloo'})",
        f"rollout    {cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} samples per step, max_new_tokens "
        f"{r.max_new_tokens}, speculative={r.speculative}",
        f"drafter    online training={'on' if cfg.drafter.train_online else 'off'} (idle workers"
        f"{', and own tail' if _tail_on(cfg) else ''})",
        f"memory per {unit} (estimate):",
    ]
    text, error = describe_memory(phases, c.gpu_memory_gb if gpu else None)
    lines += text
    if error is not None:
        raise DoesNotFit("cluster.gpu_memory_gb", error, "\n".join(lines))
    return "\n".join(lines)


class DoesNotFit(ConfigError):
    """The forecast of a phase exceeds the GPU; `plan` holds the whole plan, printed before the error."""

    def __init__(self, key: str, msg: str, plan: str = "") -> None:
        super().__init__(key, msg)
        self.plan = plan


def _tail_on(cfg: TLTConfig) -> bool:
    t = cfg.drafter.tail_training
    return t == "on" or (t == "auto" and cfg.cluster.num_workers == 1)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        path, overrides, flags = parse_cli(sys.argv[1:] if argv is None else argv)
        unknown = [f for f in flags if f not in ("--dry-run", "--help-config", "-h", "--help")]
        if unknown:
            raise ConfigError("", f"unknown flag(s) {', '.join(unknown)}; known: --dry-run, --help-config")
        if "-h" in flags or "--help" in flags:
            print(__doc__)
            return 0
        if "--help-config" in flags:
            print(describe(TLTConfig), end="")
            return 0
        cfg = load_config(TLTConfig, path, overrides)
        dry_run = "--dry-run" in flags
        notes = preflight(cfg, dry_run)  # files, imports and a resumed run's checkpoint, before anything is made
        if dry_run:
            try:
                text = plan(cfg)  # a layout that cannot be placed, or a phase that does not fit, is a config error
            except DoesNotFit as e:
                print(e.plan)
                raise
            print(f"config {path or '(defaults)'}: valid")
            print("\n".join([text, *notes]))
            return 0
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # local: the loop pulls in the engine, the models and the Ray workers, which --dry-run and config errors never need
    from tlt_rt.train.loop import RunExistsError, train

    try:
        train(cfg)
    except (RunExistsError, NotImplementedError, ConfigError, PlacementError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last complete checkpoint is kept; resume=true continues from it", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
