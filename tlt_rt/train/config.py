"""A training run's config: one section per component, each declared next to its component.

    model    models/config.py          ModelConfig
    task     train/rl/config.py        TaskConfig
    rollout  rollout/config.py         RolloutConfig (EngineConfig + sampling; policy: PolicyConfig)
    drafter  train/drafter/config.py   DrafterConfig
    rl       train/rl/config.py        RLConfig
    cluster  train/cluster/config.py   ClusterConfig
    logging  train/rl/config.py        LoggingConfig

tlt_rt/config.py reads YAML and `key.sub=value` overrides into it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tlt_rt.models.config import ModelConfig
from tlt_rt.options import check, option, register
from tlt_rt.rollout.config import RolloutConfig
from tlt_rt.train.cluster.config import ClusterConfig
from tlt_rt.train.drafter.config import DrafterConfig
from tlt_rt.train.rl.config import LoggingConfig, RLConfig, TaskConfig

# Other trainers' names for our knobs (verl, TRL, vLLM), matched on the unknown key's dotted tails, so an
# unknown `actor_rollout_ref.rollout.n` or `num_generations` is answered with ours.
FOREIGN_KEYS: dict[str, tuple[str, ...]] = {
    "rollout.n": ("rl.group_size", "verl's"),
    "num_generations": ("rl.group_size", "TRL's"),
    "clip_ratio_high": ("rl.clip_high", "verl's"),
    "epsilon_high": ("rl.clip_high", "TRL's"),
    "clip_ratio_low": ("rl.clip_low", "verl's"),
    "clip_ratio": ("rl.clip_low", "verl's"),
    "epsilon": ("rl.clip_low", "TRL's"),
    "kl_loss_coef": ("rl.kl_coef", "verl's"),
    "beta": ("rl.kl_coef", "TRL's"),
    "loss_agg_mode": ("rl.loss_agg", "verl's"),
    "loss_type": ("rl.loss_agg", "TRL's"),
    "max_tokens": ("rollout.max_new_tokens", "vLLM's"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL's"),
    "response_length": ("rollout.max_new_tokens", "verl's"),
    "max_response_length": ("rollout.max_new_tokens", "verl's"),
    "max_prompt_length": ("model.max_context", "verl's and TRL's", "ours bounds prompt + response"),
    "learning_rate": ("rl.lr", "TRL's"),
    "optim.lr": ("rl.lr", "verl's"),
    "train_batch_size": ("rl.prompts_per_step", "verl's"),
    "ppo_mini_batch_size": ("rl.mini_batches", "verl's", "ours counts them: train_batch_size / ppo_mini_batch_size"),
    "ppo_micro_batch_size_per_gpu": ("rl.micro_batch", "verl's"),
    "ppo_max_token_len_per_gpu": ("rl.micro_batch_tokens", "verl's", "with use_dynamic_bsz"),
    "total_training_steps": ("rl.steps", "verl's"),
    "max_steps": ("rl.steps", "TRL's"),
    "grad_clip": ("rl.max_grad_norm", "verl's"),
    "norm_adv_by_std_in_grpo": ("rl.normalize_adv_std", "verl's"),
    "scale_rewards": ("rl.normalize_adv_std", "TRL's"),
    "tensor_model_parallel_size": ("cluster.tensor_parallel", "verl's"),
    "n_gpus_per_node": ("cluster.gpus_per_node", "verl's"),
    "nnodes": ("cluster.nodes", "verl's"),
    "model_name_or_path": ("model.path", "TRL's"),
    "train_files": ("task.path", "verl's"),
    "dataset_name": ("task.path", "TRL's"),
    "prompt_key": ("task.question_field", "verl's"),
    "reward_funcs": ("task.reward", "TRL's"),
    "report_to": ("logging.loggers", "TRL's"),
    "logger": ("logging.loggers", "verl's"),
    "torch_dtype": ("model.dtype", "transformers' deprecated"),
}


@register
@dataclasses.dataclass
class TLTConfig:
    name: str = option("tlt", help="Run name; outputs go to output_dir/name.")
    output_dir: str = option("runs", help="Folder for checkpoints, logs and cost tables.")
    resume: bool = option(False, help="Continue from the latest checkpoint in output_dir/name.")
    model: ModelConfig = option(factory=ModelConfig, help="The target (policy) model.")
    task: TaskConfig = option(factory=TaskConfig, help="Where prompts and reference answers come from.")
    rollout: RolloutConfig = option(factory=RolloutConfig, help="Generation: sampling, batching, speculation.")
    drafter: DrafterConfig = option(factory=DrafterConfig, help="The draft model and its online training.")
    rl: RLConfig = option(factory=RLConfig, help="The GRPO learner.")
    cluster: ClusterConfig = option(factory=ClusterConfig, help="Workers and devices.")
    logging: LoggingConfig = option(factory=LoggingConfig, help="Metrics loggers and progress lines.")
    tensorboard: bool = option(False, help="Same as listing tensorboard in logging.loggers (kept for old configs).")
    # the loader answers an unknown key spelt as another trainer spells it with ours
    FOREIGN_KEYS: ClassVar[dict[str, tuple[str, ...]]] = FOREIGN_KEYS

    def __post_init__(self) -> None:
        check(
            bool(self.name.strip()) and "/" not in self.name,
            "name",
            f"must be a non-empty folder name without '/', got {self.name!r}",
        )
        c, n = self.cluster, self.rl.group_size
        check(
            c.split == "prompts" or n % c.num_workers == 0,
            "cluster.split",
            f"'samples' spreads each prompt's {n} answers (rl.group_size) over {c.num_workers} workers: "
            "they must divide evenly",
        )
        ctx, r = self.model.max_context, self.rollout
        check(
            r.max_new_tokens < ctx,
            "rollout.max_new_tokens",
            f"must be < model.max_context ({ctx}) to leave room for a prompt, got {r.max_new_tokens}",
        )
        cap = r.num_blocks * r.block_size
        check(
            r.num_blocks == 0 or cap >= ctx,
            "rollout.num_blocks",
            f"{r.num_blocks} blocks x {r.block_size} tokens = {cap} cannot hold one sequence of "
            f"model.max_context ({ctx}) tokens",
        )
