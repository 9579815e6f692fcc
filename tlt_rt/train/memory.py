"""The dry run's GPU memory forecast, phase by phase: what one GPU holds at the peak of its rollout and at the
peak of its learner update.

A GPU runs two phases a step. The rollout holds the engine (weights, KV cache, captured steps' pool, drafter)
and everything the learner keeps between updates (fp32 master weights, AdamW moments). The update adds the
gradients, and at two different moments either the backward's working set (the activations of one
micro-batch and one chunk of LM-head logits) or the optimizer step's (the gradients' fp32 copies for the
master step): the phase's peak counts the larger of the two, not both. The engine's KV cache and pool stay
unless `rl.release_engine` gives them back for the update.

Activation bytes per token and layer are what our decoder layer saves for its backward in eager bf16 (norm
inputs and outputs, the fused q/k/v and gate/up outputs, attention in and out, the MLP product).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt_rt.ir.strategy import Strategy
from tlt_rt.models.arch import ArchConfig

GIB = 1024**3
PROMPT_ALLOWANCE = 512  # prompt tokens assumed on top of max_new_tokens for per-sequence estimates
SCRATCH_ALLOWANCE = 64  # cache positions a speculative step writes past a sequence's length


def param_count(a: ArchConfig) -> tuple[int, int]:
    """(target parameters, one-layer drafter parameters without the shared embedding / head)."""
    h, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if a.qkv_bias else 0) + (h if a.o_bias else 0)
    layer = attn + 3 * h * a.intermediate_size + 2 * h
    embed = a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
    return embed + a.num_hidden_layers * layer + h, layer + 2 * h * h + h


def activation_bytes_per_token(a: ArchConfig, nbytes: int, compiled: bool = False) -> int:
    """Bytes one token's activations hold for the backward, over all layers (no recomputation); `compiled`:
    the layers run as torch.compile graphs (`rl.compile_layers`), whose backward recomputes the cheap parts."""
    h, q, kv = a.hidden_size, a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    if compiled:
        # what inductor's partition keeps (read off the saved tensors, tests/test_memory.py): the layer's input,
        # both norms' outputs and the attention's output at the hidden width, the rotated q / k / v and the
        # attention's output in its head layout, gate, up and their product; the norms' fp32 upcasts and the
        # un-rotated q / k / v are recomputed
        return a.num_hidden_layers * (4 * h + 2 * q + 2 * kv + 3 * a.intermediate_size) * nbytes
    # 2 norm inputs + 2 norm outputs, attention output and its o-proj input; q/k/v out of the fused
    # projection and rotated for attention; gate and up, and their product for the down projection
    elems = 6 * h + 2 * (q + 2 * kv) + 3 * a.intermediate_size
    fp32 = 2 * h * 4  # the norms' fp32 upcasts
    return a.num_hidden_layers * (elems * nbytes + fp32)


@dataclass
class PhaseForecast:
    """Named parts (bytes) of each phase's peak on one GPU (or one worker's RAM on CPU). `learner` is what the
    whole update holds; `learner_moments` are working sets that never live at once (the backward's, the
    optimizer step's), of which the peak counts the largest."""

    rollout: dict[str, float] = field(default_factory=dict)
    learner: dict[str, float] = field(default_factory=dict)
    learner_moments: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout.values())

    @property
    def learner_peak_moment(self) -> str | None:
        """The moment of the update whose working set is the largest (None: no moments)."""
        sizes = {k: sum(v.values()) for k, v in self.learner_moments.items()}
        return max(sizes, key=sizes.get) if sizes else None

    @property
    def learner_total(self) -> float:
        top = self.learner_peak_moment
        return sum(self.learner.values()) + (sum(self.learner_moments[top].values()) if top else 0.0)


def forecast(cfg, arch: ArchConfig) -> PhaseForecast:
    """Both phases' peaks for `cfg` (a TLTConfig) on the shape `arch`."""
    c, r, rl = cfg.cluster, cfg.rollout, cfg.rl
    gpu = c.gpus_per_worker > 0
    tp = c.tensor_parallel
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if gpu else "float32")
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    params, draft_params = param_count(arch)
    procs = c.num_workers * tp
    fsdp = rl.learner_shard == "fsdp"
    shard = tp if gpu else 1  # engine memory per GPU; on CPU a worker's TP processes share its RAM
    seq = min(cfg.model.max_context, r.max_new_tokens + PROMPT_ALLOWANCE)
    kv_per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * nbytes
    speculative = r.speculative != "off"
    draft_kv_per_token = kv_per_token / arch.num_hidden_layers if speculative else 0.0

    # ---- held in both phases
    resident: dict[str, float] = {
        "engine weights" + (f" (TP shard of {tp})" if tp > 1 else ""): params * nbytes / shard
    }
    if tp > 1 or fsdp:  # the learner holds its own copy beside the engine's shard
        resident["learner weights" + (" (FSDP shard, fp32)" if fsdp else " (full replica)")] = (
            params * 4 / procs if fsdp else params * nbytes
        )
    if not fsdp and nbytes != 4:
        resident["fp32 master weights"] = params * 4
    resident["AdamW moments (fp32)" + (" (FSDP shard)" if fsdp else "")] = params * 8 / (procs if fsdp else 1)
    if speculative or cfg.drafter.train_online:
        resident["drafter + its AdamW"] = draft_params * (nbytes + 4 + 8 + (4 if nbytes != 4 else 0))
        if tp > 1:  # the replicated drafter reads the full embedding and head
            resident["drafter's full embedding + LM head"] = (
                (1 if arch.tie_word_embeddings else 2) * arch.vocab_size * arch.hidden_size * nbytes
            )

    # ---- the engine's KV cache (engine.py: what max_batch sequences of the full context need, at most half the
    # GPU's free memory at start) and its captured steps' pool (the largest verify's logits dominate)
    # local: importing tlt_rt.rollout loads the engine, which `--help` and config errors never need
    from tlt_rt.rollout.block_manager import blocks_per_sequence, cpu_num_blocks

    per_seq = blocks_per_sequence(cfg.model.max_context, SCRATCH_ALLOWANCE, r.block_size)
    need_tokens = r.max_batch * per_seq * r.block_size
    if r.num_blocks:
        kv_tokens, kv_note = r.num_blocks * r.block_size, "rollout.num_blocks"
    elif gpu:
        free = c.gpu_memory_gb * GIB - sum(resident.values())
        half = int(free / 2 / ((kv_per_token + draft_kv_per_token) / shard))
        kv_tokens = min(half, need_tokens)
        kv_note = "max_batch x full context" if kv_tokens == need_tokens else "half the free GPU memory"
    else:
        kv_tokens, kv_note = cpu_num_blocks(kv_per_token * r.block_size) * r.block_size, "engine's CPU default"
    engine = {f"KV cache ({kv_tokens} tokens: {kv_note})": kv_tokens * (kv_per_token + draft_kv_per_token) / shard}
    if gpu and not r.enforce_eager:
        rows = r.max_batch * (max(Strategy.parse(s).verify_tokens for s in r.strategies) if speculative else 1)
        engine["captured steps' pool (largest step's logits)"] = rows * arch.vocab_size * (nbytes + 4)

    # ---- rollout phase: the prefill chunk's activations (no backward: a few live tensors of the chunk)
    prefill = r.max_prefill_tokens * (3 * arch.hidden_size + 2 * arch.intermediate_size) * nbytes
    rollout = {**resident, **engine, f"prefill chunk ({r.max_prefill_tokens} tokens)": prefill}

    # ---- learner phase
    rows = max(rl.micro_batch_tokens, seq) if rl.micro_batch_tokens else rl.micro_batch * seq
    what = f"micro_batch_tokens {rl.micro_batch_tokens}" if rl.micro_batch_tokens else f"micro_batch {rl.micro_batch}"
    learner = dict(resident)
    if not rl.release_engine:
        learner.update({f"{k} (kept)": v for k, v in engine.items()})
    share = procs if fsdp else 1
    learner["gradients" + (" (FSDP shard)" if fsdp else "")] = params * (4 if fsdp else nbytes) / share
    backward: dict[str, float] = {}
    step: dict[str, float] = {}
    if nbytes != 4 and not fsdp:
        step["fp32 gradient copies (master step)"] = params * 4
    compiled = rl.compile_layers and gpu and not fsdp  # as the learner decides (rl/learner.py)
    if compiled:
        what += ", compiled layers"
    if rl.activation_checkpointing:  # each layer's input, and one layer's insides during its recompute
        layer = activation_bytes_per_token(arch, nbytes, compiled) // arch.num_hidden_layers
        per_token = arch.num_hidden_layers * arch.hidden_size * nbytes + layer
        what += ", checkpointed layers"
    else:
        per_token = activation_bytes_per_token(arch, nbytes, compiled)
    backward[f"activations ({what}: {rows} rows)"] = rows * per_token
    chunk = rl.logprob_chunk_tokens
    if chunk:
        backward[f"log-prob chunk ({chunk} rows x vocab, fp32 x3) + fp32 head gradient"] = (
            3 * min(chunk, rows) * arch.vocab_size * 4 + arch.vocab_size * arch.hidden_size * 4
        )
    else:
        backward[f"learner logits ({rows} rows x vocab, fp32 x3)"] = 3 * rows * arch.vocab_size * 4
    moments = {"forward + backward of a micro-batch": backward}
    if step:
        moments["optimizer step"] = step
    return PhaseForecast(rollout, learner, moments)


def describe(f: PhaseForecast, budget_gib: float | None) -> tuple[list[str], str | None]:
    """The forecast as aligned lines, and the error when a phase does not fit `budget_gib` (None: no GPU)."""
    lines: list[str] = []
    parts = (f.rollout, f.learner, *f.learner_moments.values())
    width = max(len(k) + 2 for part in parts for k in part) + 2
    lines.append("  rollout phase:")
    lines += [f"    {k:<{width}} {v / GIB:9.2f} GiB" for k, v in f.rollout.items()]
    lines.append(f"    {'peak':<{width}} {f.rollout_total / GIB:9.2f} GiB")
    lines.append("  learner phase:")
    lines += [f"    {k:<{width}} {v / GIB:9.2f} GiB" for k, v in f.learner.items()]
    top = f.learner_peak_moment
    for moment, part in f.learner_moments.items():
        lines.append(
            f"    during the {moment}" + (" (the larger, counted)" if moment == top else " (not counted)") + ":"
        )
        lines += [f"      {k:<{width - 2}} {v / GIB:9.2f} GiB" for k, v in part.items()]
    lines.append(f"    {'peak':<{width}} {f.learner_total / GIB:9.2f} GiB")
    if budget_gib is None:
        return lines, None
    over = {name: total / GIB - budget_gib for name, total in (("rollout", f.rollout_total),
                                                               ("learner", f.learner_total))}  # fmt: skip
    verdict = [f"{n} phase over by {o:.1f} GiB" for n, o in over.items() if o > 0]
    lines.append(f"  of {budget_gib:.0f} GiB per GPU: " + ("; ".join(verdict) if verdict else "both phases fit"))
    if not verdict:
        return lines, None
    if over["learner"] > 0 and over["rollout"] <= 0:
        fix = (
            "set rl.activation_checkpointing=true or lower rl.micro_batch_tokens (activations), set "
            "rl.release_engine=true (the KV cache), or shard the learner (rl.learner_shard=fsdp)"
        )
    else:
        fix = "set rollout.num_blocks lower, shard the learner (rl.learner_shard=fsdp) or use more GPUs"
    return lines, f"the forecast does not fit one GPU ({'; '.join(verdict)}): {fix}"
