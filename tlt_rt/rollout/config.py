"""What the rollout owns of the config: the SD policy (`PolicyConfig`), the engine (`EngineConfig`) and
a run's rollouts (`RolloutConfig`: the engine plus sampling). Each setting is declared here once, with its
default; `Engine` and `SDPolicy` are built from these, and YAML reaches every field under `rollout.`
(`rollout.max_batch`, `rollout.policy.epsilon`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from tlt_rt.ir.strategy import Strategy
from tlt_rt.options import ConfigError, check, check_min, option, register

DEFAULT_STRATEGIES = ("8_4_48", "8_4_32", "8_4_16", "8_4_8", "6_2_12")
PREFILL_GRAPH_TOKENS = 256  # prefill_graph_tokens=-1 where the engine captures its steps


@register
@dataclasses.dataclass
class PolicyConfig:
    """The SD policy's bandit (rollout/policy/sd_policy.py explains each knob in context)."""

    epsilon: float = option(0.05, help="Share of decode steps that explore a uniformly drawn other option.")
    hysteresis: float = option(
        0.05, help="Keep the current choice unless the best option's expected tokens/s beats it by more (relative)."
    )
    explore_budget: float | None = option(
        0.02,
        help="Most share of a bucket's decode time that exploring and losing speculative steps may cost "
        "(null = no cap); a drafter that does not help costs about this much.",
    )
    horizon: int = option(4096, help="Steps over which the summed regret fades (older steps weigh less).")
    plain_refresh: int = option(
        64,
        help="'auto': while a strategy is chosen in a batch bucket, every this many decisions there is a timed "
        "plain step, so the yardstick every choice is weighed against stays current (0 = only the first "
        "readings).",
    )
    plain_settle: int = option(
        2,
        help="'auto': once a batch bucket has a plain cost, a plain step prices plain decoding only when at least "
        "this many plain steps came before it since the last prefill or speculative step (those carry that step's "
        "leftovers); a timed plain step between speculative ones is thus a run of this many plus one.",
    )
    seed: int = option(0, help="Seed of the policy's exploration draws, so decisions replay exactly.")

    def __post_init__(self) -> None:
        check(0 <= self.epsilon <= 1, "epsilon", f"must be in [0, 1], got {self.epsilon}")
        check_min(self, "hysteresis", 0.0)
        check_min(self, "plain_settle", 0)
        budget = self.explore_budget
        check(budget is None or budget > 0, "explore_budget", f"must be > 0 or null, got {budget}")
        check_min(self, "horizon", 1)
        check_min(self, "plain_refresh", 0)


@register
@dataclasses.dataclass
class EngineConfig:
    """How an `Engine` runs: speculation, strategies, KV cache, batching, kernels."""

    speculative: Literal["off", "on", "auto"] = option(
        "auto",
        help="Speculative decoding: 'off' = plain decoding only; 'on' = always, with the best strategy; "
        "'auto' = per step, whichever the cost model predicts is fastest (plain decoding while the batch "
        "is large, speculation in the long tail). Output is lossless in every mode.",
    )
    strategies: list[str] = option(
        list(DEFAULT_STRATEGIES),
        help="Speculative strategies to compile and choose between, each DEPTH_TOPK_VERIFYTOKENS: draft "
        "depth, top-k branching per draft step, tree tokens verified by the target per step.",
    )
    block_size: int = option(16, help="Tokens per paged KV-cache block (a power of two).")
    num_blocks: int = option(
        0, help="KV-cache blocks per engine; 0 = size from free memory (GPU) or batch x context (CPU)."
    )
    max_batch: int = option(
        64, help="Most sequences one engine decodes at once (continuous batching); largest graph bucket."
    )
    graph_batches: list[int] = option(
        [],
        help="Batch sizes whose steps are captured as CUDA graphs (a live batch runs in the smallest that holds "
        "it; max_batch is always one); [] = 1, 2, 4, 8, then steps of a third of the size up to max_batch. Each "
        "size is a capture and a compile of its own on first use: an engine that only generates data at a full "
        "batch needs a few.",
    )
    max_prefill_tokens: int = option(
        16384,
        help="Most prompt tokens one prefill step processes (chunked prefill). A prefill step runs eagerly and "
        "costs the host about the same whatever its size, so larger chunks prefill a large batch faster.",
    )
    prefill_graph_tokens: int = option(
        -1,
        help="CUDA graphs for the prefill of one sequence's chunk of up to this many tokens (padded to a power of "
        "two from 64; captured on first use): a short prompt alone (batch 1) then prefills in one replay instead "
        "of launching every layer's kernels from the host (Qwen2.5-Coder-1.5B, H200: 3.9 ms against 36 ms "
        "eager). -1 = 256 where the engine captures its steps (CUDA, not enforce_eager), else 0; 0 = every "
        "prefill runs eagerly.",
    )
    prefill_min_samples: int = option(
        0,
        help="While samples run, admit waiting prompts only once this many samples' places in the batch are free "
        "(or all the waiting work fits): a stream of prompts refilling a full batch then prefills several at a "
        "time instead of one prompt a step. 0 = admit a prompt as soon as its samples fit.",
    )
    attn_backend: Literal["auto", "triton", "torch"] = option(
        "auto",
        help="Attention kernels: 'auto' = Triton on CUDA, torch elsewhere; 'triton' (CUDA, or CPU under "
        "TRITON_INTERPRET=1); 'torch'.",
    )
    enforce_eager: bool = option(
        False, help="Run every step eagerly, without CUDA graphs: slower, for debugging and profiling."
    )
    overlap: bool = option(
        True,
        help="Queue each plain decode step before the host postprocesses the one before (its roots copied on the "
        "device), so the host's work between steps overlaps the device's; under 'auto' the SD policy decides the "
        "next step while a plain one runs. Exact: a step that could differ from the one run without overlap (a "
        "sample stopped outside a captured bucket, a prefill due) is dropped and run again. H200, Qwen2.5-Coder-"
        "0.5B, T=1: 1.14x tokens/s at batch 1, 1.30x at 128. false = one step at a time.",
    )
    overlap_speculative: bool = option(
        True,
        help="With overlap: queue a speculative step after one of the same strategy too, its inputs moved on by "
        "the step before's accept lengths and tokens on the device and the drafter's windows as that step left "
        "them; none is queued while a sample is within a step's tokens of its limit, and one after which the "
        "batch changed is dropped and run again. 2x H200, Qwen2.5-7B shape TP=2, 8_4_32 at batch 1: the step "
        "as dear as its bare replay (5.26 against 5.30 ms). false = speculative steps one at a time.",
    )
    fuse_norm: bool = option(
        False,
        help="CUDA: a decode step of one row runs each layer's residual add and RMSNorm inside its q/k/v and "
        "gate/up projections (one Triton kernel each, SwiGLU included) instead of cuBLAS after a norm kernel; pays "
        "on small models (Qwen2.5-Coder-0.5B: 1.13x a step at batch 1, 1.5B: even).",
    )
    fuse_rope: bool = option(
        True,
        help="CUDA, Triton attention: a decode step rotates q and k and writes the new K/V inside its attention "
        "kernel instead of a rotary kernel before it (1.03-1.05x a step on Qwen2.5-Coder-0.5B / 1.5B); false: "
        "the rotary kernel, then attention.",
    )
    decode_chain: bool = option(
        False,
        help="CUDA: a decode step of one row runs as a chain of Triton kernels: each layer's add + norm inside its "
        "q/k/v and gate/up projections (fuse_norm), the rotary attention (fuse_rope), the matrix-vector kernel for "
        "o, down and the head instead of cuBLAS. H200, graphs, batch 1: Qwen2.5-Coder-0.5B 1.22x a step, 1.5B "
        "1.03x (benchmarks/step_costs.py --compare base fused+skinny, 86a0504); with pdl 1.55x and 1.18x "
        "(e55c895), then 1.12x / 1.19x more with one row's products in the weight's own layout (ee5c282: 44% / 61% "
        "of the HBM floor). In the engine it leaves speculative steps as they were (their rows take cuBLAS), so "
        "each costs more plain steps (1.5B: 8_4_32 2.30x against 1.76x). Steps of more rows are as without it.",
    )
    decode_chain_rows: int = option(
        1,
        help="With decode_chain: the most rows of a step its kernels take. Above one, steps of 9 rows and more (a "
        "batch, a speculative step's verify rows) also run as the chain, their products on tensor cores (16-bit "
        "weights; 2-8 rows stay with cuBLAS). Slower than cuBLAS so far (H200, random Qwen2.5-Coder shapes, "
        "3ace447: 1.5B batch 32 0.42x a step, its verify rows 0.44-0.52x; 0.5B 0.56-0.80x; with kernels.rows_gemm, "
        "skinny_gemm.DOT_KERNEL 'split', 3f02f57: 0.87x, 0.81-0.87x; 0.76-0.82x): one by default.",
    )
    decode_chain_max_weight: int = option(
        0,
        help="With decode_chain: the largest weight (elements) its Triton products take; larger ones stay with "
        "cuBLAS and their add + norm with the compiled glue (on a 7B-sized layer cuBLAS streams gate/up and down "
        "faster: the whole chain made the Qwen2.5-7B shape's step 0.91x at TP=1, 2x H200, 1f85a26), while the "
        "smaller ones (q/k/v with the norm inside, o) keep the chain's kernels. 0: no limit.",
    )
    pdl: bool = option(
        False,
        help="CUDA, compute capability 9.0+, with decode_chain: its kernels launched with programmatic dependent "
        "launch, each placed while the one before runs and holding its weight in registers when that one ends "
        "(tlt_rt/codegen/kernels/pdl.py). Bit-identical results; H200 batch 1: 0.5B 1.07x over the chain alone, "
        "1.5B even (86a0504); the chain with it 1.55x / 1.18x over the default step (e55c895).",
    )
    policy: PolicyConfig = option(factory=PolicyConfig, help="The SD policy: exploration and switching.")

    def __post_init__(self) -> None:
        check(
            self.speculative in ("off", "on", "auto"),
            "speculative",
            f"must be 'off', 'on' or 'auto', got {self.speculative!r}",
        )
        self.strategies = [str(s) if isinstance(s, Strategy) else s for s in self.strategies]
        for i, text in enumerate(self.strategies):
            try:
                Strategy.parse(text)
            except ValueError as e:
                raise ConfigError(f"strategies[{i}]", str(e)) from e
        check(len(set(self.strategies)) == len(self.strategies), "strategies", "has duplicates")
        check(
            self.speculative == "off" or bool(self.strategies),
            "strategies",
            f"is empty but speculative is {self.speculative!r}; set speculative=off to decode without speculation",
        )
        bs = self.block_size
        check(bs >= 1 and bs & (bs - 1) == 0, "block_size", f"must be a power of two, got {bs}")
        check(not self.pdl or self.decode_chain, "pdl", "launches the decode chain's kernels: set decode_chain too")
        check(
            1 <= self.decode_chain_rows <= 64,
            "decode_chain_rows",
            f"must be 1-64 (the chain's kernels take at most 64 rows), got {self.decode_chain_rows}",
        )
        check_min(self, "decode_chain_max_weight", 0)
        check_min(self, "num_blocks", 0)
        check_min(self, "max_batch", 1)
        check_min(self, "max_prefill_tokens", 1)
        check_min(self, "prefill_graph_tokens", -1)
        bad = [
            b
            for b in self.graph_batches
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= self.max_batch
        ]
        check(not bad, "graph_batches", f"each must be an int in [1, max_batch={self.max_batch}], got {bad}")
        check_min(self, "prefill_min_samples", 0)
        check(self.attn_backend in ("auto", "triton", "torch"), "attn_backend", f"unknown: {self.attn_backend!r}")


_POLICY_KEYS = frozenset(f.name for f in dataclasses.fields(PolicyConfig))


def engine_config(config: EngineConfig | None = None, **options: Any) -> EngineConfig:
    """`config` (default: all defaults) with `options` replaced: EngineConfig fields, or PolicyConfig fields
    (`epsilon=...`) for the policy. The keyword form `Engine(target, max_batch=8)` goes through here."""
    cfg = config if config is not None else EngineConfig()
    policy = {k: options.pop(k) for k in list(options) if k in _POLICY_KEYS}
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; EngineConfig and PolicyConfig list the settings")
    if "strategies" in options:
        options["strategies"] = [str(s) for s in options["strategies"]]
    if policy:
        options["policy"] = dataclasses.replace(cfg.policy, **policy)
    return dataclasses.replace(cfg, **options) if options else cfg


@register
@dataclasses.dataclass
class RolloutConfig(EngineConfig):
    """A run's rollouts: the engine's settings plus how each response is sampled."""

    temperature: float = option(
        0.9, help="Sampling temperature of rollouts; 0 = greedy. GRPO needs > 0 for diverse groups."
    )
    top_p: float = option(1.0, help="Nucleus sampling: keep the smallest token set with this mass (0, 1].")
    top_k: int = option(-1, help="Sample among the k most likely tokens; -1 = no top-k filter.")
    max_new_tokens: int = option(256, help="Longest response per prompt, in tokens; the tail is this long.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_min(self, "temperature", 0.0)
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        check_min(self, "max_new_tokens", 1)

    def engine(self) -> EngineConfig:
        """The engine's part of this config."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})
