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

from tlt_rt.config import ConfigError, TLTConfig, describe, load_config, parse_cli
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.default import converted_dir, fetched_gguf
from tlt_rt.models.gguf_shape import gguf_arch
from tlt_rt.models.registry import MODELS, fetch_command
from tlt_rt.train.cluster.placement import PlacementError, plan_layout
from tlt_rt.train.preflight import preflight
from tlt_rt.train.rl.checkpoint import CheckpointError

# Published shapes (each model's config.json), so a plan needs no download.
KNOWN_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       qkv_bias=True, max_position_embeddings=32768),
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                        qkv_bias=True, max_position_embeddings=32768),
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=131072),
    # the GGUFs that `python -m tlt_rt.models.fetch` brings (registry.py), as their headers give them: both
    # models are published with tied embeddings, but each GGUF carries its own output.weight, so they load untied
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                               qkv_bias=True, tie_word_embeddings=False, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643, eos_token_ids=(151645,)),
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                               qkv_bias=True, tie_word_embeddings=False, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643, eos_token_ids=(151645,)),
}  # fmt: skip
GIB = 1024**3
PROMPT_ALLOWANCE = 512  # prompt tokens assumed on top of max_new_tokens for per-sequence estimates


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


def param_count(a: ArchConfig) -> tuple[int, int]:
    """(target parameters, one-layer drafter parameters without the shared embedding / head)."""
    h, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if a.qkv_bias else 0) + (h if a.o_bias else 0)
    layer = attn + 3 * h * a.intermediate_size + 2 * h
    embed = a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
    return embed + a.num_hidden_layers * layer + h, layer + 2 * h * h + h


def plan(cfg: TLTConfig) -> str:
    """The placement plan and per-GPU (or per-worker on CPU) memory estimate, as text."""
    arch, source = resolve_arch(cfg)
    c, r = cfg.cluster, cfg.rollout
    gpu = c.gpus_per_worker > 0
    tp = c.tensor_parallel
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if gpu else "float32")
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    params, draft_params = param_count(arch)
    total_gpus = c.num_workers * c.gpus_per_worker
    engines = c.num_workers * max(1, c.gpus_per_worker // tp)
    ctx = cfg.model.max_context
    seq = min(ctx, r.max_new_tokens + PROMPT_ALLOWANCE)
    kv_per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * nbytes
    if r.num_blocks:
        kv_tokens, kv_note = r.num_blocks * r.block_size, "rollout.num_blocks"
    elif gpu:
        # the engine takes half the GPU memory free when it starts (block_manager.auto_num_blocks): what is
        # loaded by then is the model and the drafter; the learner's state and activations come later
        before = params * nbytes / tp + draft_params * nbytes
        kv_tokens = max(r.max_batch * seq, int((c.gpu_memory_gb * GIB - before) / 2 / (kv_per_token / tp)))
        kv_note = "half the GPU's free memory at start; rollout.num_blocks bounds it"
    else:  # the engine's CPU rule: at most 1024 blocks or 512 MiB
        per_block = kv_per_token * r.block_size
        kv_tokens, kv_note = max(64, min(1024, (512 << 20) // per_block)) * r.block_size, "engine's CPU default"
    shard = tp if gpu else 1  # engine memory per GPU; on CPU a worker's TP processes share its RAM
    procs = c.num_workers * tp
    fsdp = cfg.rl.learner_shard == "fsdp"
    separate = tp > 1 or fsdp  # the learner holds its own copy beside the engine's shard
    learner_share = procs if fsdp else 1
    mem = {"engine weights" + (f" (TP shard of {tp})" if tp > 1 else ""): params * nbytes / shard}
    if fsdp:
        mem[f"learner fp32 weights + gradients (FSDP shard of {procs})"] = params * 8 / learner_share
    else:
        if separate:
            mem["learner weights (full replica)"] = params * nbytes
        mem["gradients"] = params * nbytes
        mem["fp32 master weights"] = params * 4 if nbytes != 4 else 0.0
    mem["AdamW moments (fp32)" + (" (FSDP shard)" if fsdp else "")] = params * 8 / learner_share
    mem[f"KV cache ({kv_tokens} tokens: {kv_note})"] = kv_tokens * kv_per_token / shard
    mem["drafter + its AdamW"] = draft_params * (nbytes + 4 + 8 + (4 if nbytes != 4 else 0))
    if tp > 1:  # the replicated drafter reads the full embedding and head
        mem["drafter's full embedding + LM head"] = (
            (1 if arch.tie_word_embeddings else 2) * arch.vocab_size * (arch.hidden_size * nbytes)
        )
    if cfg.rl.micro_batch_tokens:
        rows, what = max(cfg.rl.micro_batch_tokens, seq), f"micro_batch_tokens {cfg.rl.micro_batch_tokens}"
    else:
        rows, what = cfg.rl.micro_batch * seq, f"micro_batch {cfg.rl.micro_batch} x {seq}"
    mem[f"learner logits ({what} rows x vocab, fp32 x2)"] = 2 * rows * arch.vocab_size * 4
    total = sum(mem.values())
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
    width = max(len(k) for k in mem) + 2
    lines += [f"  {k:<{width}} {v / GIB:9.2f} GiB" for k, v in mem.items()]
    lines.append(f"  {'total':<{width}} {total / GIB:9.2f} GiB")
    if gpu:
        budget = c.gpu_memory_gb
        verdict = "fits" if total / GIB <= budget else f"DOES NOT FIT (over by {total / GIB - budget:.1f} GiB)"
        lines.append(f"  of {budget:.0f} GiB per GPU: {verdict}")
        if total / GIB > budget and not fsdp:
            lines.append("  note: the learner is replicated per process; rl.learner_shard=fsdp shards it")
    return "\n".join(lines)


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
            text = plan(cfg)  # a layout that cannot be placed is a config error too
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
