"""The RL step's sections of the config: the task (`task.`), the GRPO learner (`rl.`) and metrics (`logging.`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from tlt_rt.options import check, check_min, option, register

DEFAULT_INSTRUCTION = (
    'Solve the problem step by step. End your reply with "The answer is N." where N is the final number.'
)
# reasoning-gym answers are lists, words and expressions as often as numbers
REASONING_GYM_INSTRUCTION = (
    'Solve the problem step by step. End your reply with "The answer is X." where X is the final answer, '
    "written as the question asks."
)


@register
@dataclasses.dataclass
class TaskConfig:
    kind: Literal["arithmetic", "jsonl", "parquet", "reasoning_gym"] = option(
        "arithmetic",
        help="Prompt source: 'arithmetic' generates verifiable arithmetic problems (no files needed); "
        "'jsonl' / 'parquet' read question/answer records from `path`; 'reasoning_gym' generates the problems of "
        "one reasoning-gym dataset (`rg_dataset`), scored by its own verifier (pip install 'tlt_rt[reasoning]').",
    )
    path: str | None = option(None, help="Dataset file; required when kind is jsonl or parquet.")
    eval_path: str | None = option(
        None,
        help="jsonl/parquet: held-out records for `logging.eval_every` (same fields as `path`). Arithmetic and "
        "reasoning_gym tasks hold out problems of another seed and need no file.",
    )
    digits: int = option(2, help="Arithmetic: digits per operand; more digits = harder problems.")
    num_ops: int = option(2, help="Arithmetic: operators per problem (2 means three operands).")
    max_digits: int | None = option(
        None,
        help="Arithmetic: with a value above `digits`, each problem draws its digits per operand from "
        "digits..max_digits (mixed difficulty); null = always `digits`.",
    )
    max_ops: int | None = option(
        None,
        help="Arithmetic: with a value above `num_ops`, each problem draws its operators from num_ops..max_ops "
        "(mixed difficulty: longer chains of reasoning); null = always `num_ops`.",
    )
    word_problems: bool = option(
        True, help="Arithmetic: phrase problems in words rather than bare expressions (longer reasoning)."
    )
    ops: list[str] = option(
        ["+", "-", "*", "/"],
        help="Arithmetic: the operators problems draw from (division appears only where it divides exactly).",
    )
    rg_dataset: str | None = option(
        None,
        help="reasoning_gym: the dataset's name in reasoning-gym's registry, e.g. 'basic_arithmetic', 'chain_sum', "
        "'gcd', 'word_sorting'; required for that kind.",
    )
    rg_config: dict[str, Any] = option(
        {},
        help="reasoning_gym: options of the dataset's config, e.g. {min_terms: 2, max_terms: 3} for chain_sum "
        "(the fields of its config dataclass; seed and size come from `seed` and `rg_size`).",
    )
    rg_size: int = option(
        100_000,
        help="reasoning_gym: distinct training problems; the prompt stream cycles through them. Held-out problems "
        "take the seed `rg_size` above `seed`, past every training problem. A few datasets build all of them up "
        "front (acre) or cap the size (word_ladder, 20,000): lower it for those.",
    )
    seed: int = option(0, help="Seed for generating and shuffling prompts, so runs see the same data.")
    question_field: str = option(
        "question",
        help="jsonl/parquet: record field holding the prompt: text, or a chat message list (verl's and TRL's "
        "conversational `prompt`). Dotted names reach into nested records. With the default, a record without "
        "'question' falls back to 'prompt' (verl, TRL).",
    )
    answer_field: str = option(
        "answer",
        help="jsonl/parquet: record field holding the reference answer the reward checks against; dotted names "
        "reach into nested records. With the default, a record without 'answer' falls back to "
        "'reward_model.ground_truth' (verl), then 'solution' and 'ground_truth' (TRL / open-r1).",
    )
    instruction: str | None = option(
        DEFAULT_INSTRUCTION,
        help="Appended (on its own line) to every text question; null or '' = none. Chat-message prompts "
        "(verl/TRL datasets) carry their own instructions and are used as they are. With kind reasoning_gym the "
        "default asks for any final answer, not only a number.",
    )
    reward: str = option(
        "numeric",
        help="How a response is scored against the reference answer: 'numeric' (the final number or \\boxed{} "
        "answer, compared by value); 'math_verify' (the math-verify library that TRL, verl and open-r1 use; "
        "pip install 'tlt_rt[math]'); or 'module:function', your own function(response: str, answer: str) -> "
        "float, imported by that path. reasoning_gym tasks are scored by their dataset's own verifier and keep "
        "'numeric'.",
    )

    def __post_init__(self) -> None:
        if self.kind in ("jsonl", "parquet"):
            check(bool(self.path), "path", f"is required when kind is {self.kind!r}")
        if self.kind == "reasoning_gym":
            check(bool(self.rg_dataset), "rg_dataset", "is required when kind is 'reasoning_gym'")
            check(
                self.reward == "numeric",
                "reward",
                f"is {self.reward!r}, but reasoning_gym tasks are scored by their dataset's own verifier",
            )
            if self.instruction == DEFAULT_INSTRUCTION:
                self.instruction = REASONING_GYM_INSTRUCTION
        reserved = [k for k in ("seed", "size") if k in self.rg_config]
        check(not reserved, "rg_config", f"must not set {reserved}: they come from task.seed and task.rg_size")
        check_min(self, "rg_size", 1)
        check_min(self, "digits", 1)
        check_min(self, "num_ops", 1)
        if self.max_digits is not None:
            check_min(self, "max_digits", self.digits)
        if self.max_ops is not None:
            check_min(self, "max_ops", self.num_ops)
        bad = [op for op in self.ops if op not in ("+", "-", "*", "/")]
        check(bool(self.ops) and not bad, "ops", f"must be a non-empty subset of + - * /, got {self.ops}")
        check(bool(self.question_field), "question_field", "must not be empty")
        check(bool(self.answer_field), "answer_field", "must not be empty")
        check(
            self.reward in ("numeric", "math_verify") or re.fullmatch(r"[\w.]+:\w+", self.reward) is not None,
            "reward",
            f"must be 'numeric', 'math_verify' or 'module:function', got {self.reward!r}",
        )


@register
@dataclasses.dataclass
class RLConfig:
    algorithm: Literal["grpo"] = option("grpo", help="Policy-optimisation algorithm.")
    group_size: int = option(
        8, help="Responses sampled per prompt; GRPO's advantage is each reward minus its group's mean."
    )
    prompts_per_step: int = option(8, help="Prompts per RL step (a step rolls out prompts x group_size).")
    lr: float = option(
        1e-6,
        help="Policy learning rate. 0 holds the policy still (every step still computes its loss and gradients): "
        "two runs that differ only in how they sample then answer with one policy throughout, so their rewards "
        "compare the samplers alone (benchmarks/e2e_rl.py --hold-policy).",
    )
    clip_low: float = option(0.2, help="PPO ratio clip below: ratio >= 1 - clip_low.")
    clip_high: float = option(
        0.28, help="PPO ratio clip above: ratio <= 1 + clip_high (DAPO clip-higher; >= clip_low)."
    )
    loss_agg: Literal["token", "sequence"] = option(
        "token",
        help="Loss averaging: 'token' = mean over all tokens of the step (long answers weigh more); "
        "'sequence' = mean per response, then over responses.",
    )
    kl_coef: float = option(0.0, help="Weight of the KL penalty to the reference policy; 0 = none.")
    drop_equal_reward_groups: bool = option(
        True, help="Skip groups whose rewards are all equal: their advantages are zero, no signal."
    )
    steps: int = option(100, help="RL steps to train.")
    time_limit_s: float = option(
        0.0,
        help="Stop after the first step that ends this many seconds after the run started (a checkpoint is "
        "written; resume=true continues): for time-boxed jobs. 0 = no limit.",
    )
    seed: int = option(0, help="Seed of rollout sampling and the learner.")
    normalize_adv_std: bool = option(
        True, help="Divide each advantage by its group's reward std (GRPO); false = reward minus group mean only."
    )
    adv_eps: float = option(1e-6, help="Added to the group std before dividing, so near-equal groups stay finite.")
    max_grad_norm: float = option(1.0, help="Clip the policy gradient's global L2 norm to this; 0 = no clipping.")
    weight_decay: float = option(0.0, help="AdamW weight decay of the policy.")
    micro_batch: int = option(
        4, help="Responses per learner forward/backward; gradients accumulate over micro-batches (bounds memory)."
    )
    micro_batch_tokens: int = option(
        0,
        help="When > 0, micro-batches are cut by padded tokens instead of responses: samples sorted by length, "
        "each micro-batch at most this many (prompt + response) x its longest, so short answers share one pass "
        "instead of being padded to a long one (verl's use_dynamic_bsz). 0 = micro_batch responses each.",
    )
    logprob_chunk_tokens: int = option(
        2048,
        help="The learner takes the log-probs of sampled tokens through the LM head this many response tokens at "
        "a time, so no [tokens x vocab] fp32 logits exist beyond one chunk (152k ids x 2,048 rows x 4 B = "
        "1.2 GiB for Qwen2.5); only response positions are projected. 0 = the full dense logits.",
    )
    activation_checkpointing: bool = option(
        False,
        help="Keep only each decoder layer's input during the learner's forward and recompute the layer in the "
        "backward (~1/3 more compute): activation memory drops from all of a layer's tensors to one hidden row "
        "per token and layer, so larger micro-batches fit.",
    )
    compile_layers: bool = option(
        True,
        help="GPU, one learner per worker (not FSDP): run each decoder layer's forward and backward in the "
        "learner as torch.compile'd graphs (the layers share them; a few serve every micro-batch shape, compiled "
        "at start-up) instead of eager ops: the update is otherwise bound by the host's launches and autograd work.",
    )
    release_engine: bool = option(
        False,
        help="GPU: the engine gives its KV cache and captured steps back while the learner runs and takes them "
        "again (capturing its steps anew) before the next rollout. Off by default: the engine's automatic KV "
        "cache holds only what max_batch sequences of the full context need, and the learner fits beside it; "
        "turn it on where the dry run's learner phase does not fit.",
    )
    mini_batches: int = option(
        1, help="Optimizer steps per RL step: the step's responses are split into this many mini-batches."
    )
    recompute_logprobs: bool = option(
        False,
        help="Recompute the old log-probs with the learner's dense forward before the update instead of using "
        "the engine's (equal up to float rounding, since the engine samples exactly from the policy).",
    )
    learner_shard: Literal["none", "fsdp"] = option(
        "none",
        help="How the learner's weights and optimizer state are held: 'none' = a full replica per worker "
        "process, gradients all-reduced; 'fsdp' = sharded over every worker process with FSDP2 (fp32 master "
        "shards; bf16 compute on GPU), the engines given the gathered weights after each update.",
    )
    checkpoint_every: int = option(
        1,
        help="RL steps between checkpoints; 1 means killing the driver loses at most the current step. 0 = none "
        "at all, not even at the end (benchmarks: a 1.5B policy's checkpoint with its fp32 master weights and "
        "AdamW moments is ~25 GB and takes seconds to write); such a run cannot be resumed.",
    )
    keep_checkpoints: int = option(2, help="Most recent checkpoints kept in output_dir/name/checkpoints.")

    def __post_init__(self) -> None:
        check_min(self, "group_size", 2)
        check_min(self, "adv_eps", 0.0)
        check_min(self, "max_grad_norm", 0.0)
        check_min(self, "weight_decay", 0.0)
        check_min(self, "micro_batch", 1)
        check_min(self, "micro_batch_tokens", 0)
        check_min(self, "logprob_chunk_tokens", 0)
        check_min(self, "mini_batches", 1)
        check_min(self, "checkpoint_every", 0)
        check_min(self, "keep_checkpoints", 1)
        check_min(self, "prompts_per_step", 1)
        check(self.lr >= 0, "lr", f"must be >= 0 (0 holds the policy still), got {self.lr}")
        check(0 < self.clip_low < 1, "clip_low", f"must be in (0, 1), got {self.clip_low}")
        check(
            self.clip_high >= self.clip_low,
            "clip_high",
            f"must be >= clip_low ({self.clip_low}), got {self.clip_high}",
        )
        check_min(self, "kl_coef", 0.0)
        check_min(self, "steps", 1)
        check_min(self, "time_limit_s", 0.0)
        check(
            self.learner_shard in ("none", "fsdp"), "learner_shard", f"must be none or fsdp, got {self.learner_shard!r}"
        )


@register
@dataclasses.dataclass
class LoggingConfig:
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = option(
        ["jsonl"],
        help="Where step metrics go: 'jsonl' (RUN/metrics.jsonl, always written: resume and the report read it), "
        "'tensorboard' (RUN/tb; pip install tensorboard) and 'wandb' (pip install wandb; offline by default).",
    )
    wandb_project: str = option("tlt_rt", help="wandb project name.")
    wandb_mode: Literal["offline", "online"] = option(
        "offline", help="wandb mode: 'offline' writes under RUN/wandb (wandb sync uploads later); 'online' uploads."
    )
    eval_every: int = option(
        0,
        help="RL steps between held-out evaluations (at step 0 and every N steps after, and after the last); "
        "0 = none. Their time is logged apart (eval_seconds) and is not part of step_seconds.",
    )
    eval_prompts: int = option(64, help="Held-out prompts per evaluation, one answer each.")
    eval_temperature: float = option(
        0.0, help="Sampling temperature of held-out answers; 0 = greedy (the usual held-out accuracy)."
    )
    eval_max_new_tokens: int | None = option(
        None, help="Token limit of held-out answers; null = rollout.max_new_tokens."
    )
    accept_ceiling: bool = option(
        True,
        help="With speculation on, log each step's perfect-drafter ceiling of accept length per strategy "
        "(accept_ceiling): the tokens per step a drafter that always proposed the target's top-k would get on "
        "the step's own answers. Accept length is judged against it.",
    )
    drafter_curve: bool = option(
        False,
        help="With speculation and drafter.train_online on, log after each step the accept length of the online "
        "drafter (its weights after the step's training, the ones the next rollout drafts with) and of a frozen "
        "copy of the drafter the run started from (drafter.path, or the seeded initial drafter; a resumed run "
        "rebuilds the same one, not the drafter of its checkpoint), both on the same answers of the step "
        "(drafter_accept_online, drafter_accept_frozen; per strategy in *_by_strategy, the measure of "
        "accept_ceiling with the drafter's top-k in place of the target's). Its time is logged apart "
        "(drafter_curve_seconds), not in step_seconds. Online training may have used some of these answers "
        "(a worker that finished its rollout early trains on its buffer), so the online figure can lean in-sample.",
    )
    drafter_curve_answers: int = option(
        32,
        help="Answers of the step the drafter curve measures, spread over the workers and picked evenly from "
        "each worker's answers (the drafter runs teacher-forced over each answer once per depth); 0 = all.",
    )
    profile_learner_step: int = option(
        -1,
        help="Profile this RL step's learner update on every worker (torch profiler, kernels and host operators) "
        "and write RUN/profile/learner-step{N}-rank{r}.txt: its wall time against the kernels' busy time, by kind "
        "and by kernel; -1 = never. The profiled update runs slower than the others.",
    )
    progress_every_s: float = option(
        30.0,
        help="Seconds between plain progress lines (step k of N, time left) while a step runs; they also reach "
        "redirected logs, where progress bars are off. 0 = only the line after each step.",
    )

    def __post_init__(self) -> None:
        check("jsonl" in self.loggers, "loggers", "must include jsonl: resume and the report read metrics.jsonl")
        check(len(set(self.loggers)) == len(self.loggers), "loggers", "has duplicates")
        check_min(self, "progress_every_s", 0.0)
        check_min(self, "eval_every", 0)
        check_min(self, "eval_prompts", 1)
        check_min(self, "drafter_curve_answers", 0)
        check_min(self, "profile_learner_step", -1)
        check_min(self, "eval_temperature", 0.0)
        if self.eval_max_new_tokens is not None:
            check_min(self, "eval_max_new_tokens", 1)
