"""Drafter training's section of the config (`drafter.`): where the drafter starts, how it trains online."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tlt_rt.options import check, check_min, option, register


@register
@dataclasses.dataclass
class DrafterConfig:
    path: str | None = option(
        None,
        help="Drafter to start from: an EAGLE folder (warm-up or export_drafter output), a run checkpoint "
        "(runs/X/checkpoints/step_N or its drafter/), or a run folder (its latest checkpoint); null = a fresh "
        "one-layer drafter built from the target.",
    )
    train_online: bool = option(
        True, help="Train the drafter on idle rollout workers so it keeps up with the changing policy."
    )
    lr: float = option(1e-4, help="Drafter learning rate (the peak, under a schedule).")
    lr_schedule: Literal["constant", "cosine"] = option(
        "constant",
        help="'constant' (online training, whose length is open) or 'cosine': a linear rise over lr_warmup_steps, "
        "then a cosine fall to lr_min_ratio * lr at lr_total_steps (a warm-up of known length).",
    )
    lr_warmup_steps: int = option(0, help="Optimizer steps of the cosine schedule's linear rise.")
    lr_total_steps: int = option(0, help="Optimizer steps the cosine schedule spans (required by 'cosine').")
    lr_min_ratio: float = option(0.1, help="The cosine schedule's last learning rate, as a share of lr.")
    batch_tokens: int = option(4096, help="Tokens per drafter training batch.")
    buffer_steps: int = option(
        4, help="RL steps of (token, target hidden state) data kept for drafter training; older is dropped."
    )
    hidden_loss_weight: float = option(
        1.0, help="Weight of the loss matching the target's next hidden state (EAGLE feature regression)."
    )
    token_loss_weight: float = option(
        0.1, help="Weight of the cross-entropy on the target's next token through the shared LM head."
    )
    noise_std: float = option(0.0, help="Std of Gaussian noise on input hidden states, for robustness.")
    unroll: int = option(
        1, help="Training-time test: passes that feed the drafter its own predictions (1 = teacher forcing only)."
    )
    unroll_context: Literal["chain", "shifted"] = option(
        "chain",
        help="Attention context of unrolled passes: 'chain' = exactly the engine's draft (true rows up to the root, "
        "then the row's own chain); 'shifted' = the older approximation (every row sees the same pass's rows).",
    )
    loss_temperature: float = option(
        1.0,
        help="Temperature of the target distribution the token loss matches; set it to rollout.temperature "
        "(0 = one-hot targets on the target's argmax, for greedy rollouts).",
    )
    sampled_token_weight: float = option(
        0.0, help="Weight of an extra cross-entropy on the token the rollout actually sampled next."
    )
    feature_layers: list[int] = option(
        [],
        help="Target decoder layers (0-based, below the last) whose outputs the drafter fuses with the last "
        "layer's, as EAGLE-3 does with low, middle and high features (e.g. [2, 14] of Qwen2.5-1.5B's 28); "
        "[] = the last layer's feature alone. A drafter loaded from drafter.path keeps its own.",
    )
    draft_vocab: int = option(
        0,
        help="Reduced draft vocabulary: the drafter's head covers this many of the rollouts' most frequent "
        "tokens, rebuilt from the training buffer as the policy moves; 0 = the full vocabulary.",
    )
    grad_accum: int = option(1, help="Micro-batches whose gradients are summed per drafter optimizer step.")
    packed: bool = option(
        True, help="Pack several sequences into one training row (block-diagonal attention) instead of padding."
    )
    weight_decay: float = option(0.0, help="AdamW weight decay of the drafter.")
    betas: list[float] = option([0.9, 0.95], help="AdamW betas (beta1, beta2) of the drafter.")
    max_grad_norm: float | None = option(0.5, help="Clip the drafter's gradient L2 norm to this; null = no clipping.")
    checkpoint_every: int = option(
        50, help="Drafter optimizer steps between checkpoints, so preempted training loses little."
    )
    warmup_prompts: int = option(
        256,
        help="The drafter warm-up before a comparison (benchmarks/e2e_rl.py): training prompts, each answered 4 "
        "times at the RL temperature plus once greedily. Fresh answers pay more than passes over the same ones "
        "(Qwen2.5-1.5B: 448 / 768 / 1,024 prompts gave 63% / 66% / 69% of the ceiling at ~5.7M training tokens).",
    )
    warmup_epochs: float = option(10.0, help="The drafter warm-up's passes over its answers.")
    warmup_lr: float = option(
        0.0,
        help="The drafter warm-up's peak learning rate (0 = the warm-up's width rule: 9e-4 up to width 576, then "
        "as 1/width). Qwen2.5-0.5B (width 896) reached 82% of its ceiling at 9e-4, 1.55x the rule's 5.8e-4.",
    )
    warmup_max_new_tokens: int = option(
        512,
        help="The drafter warm-up's answer length cap (0 = rollout.max_new_tokens). On Qwen2.5-1.5B 512 beat the "
        "RL runs' 2,048: 63% of the ceiling against 59% on held-out answers.",
    )
    tail_training: Literal["auto", "on", "off"] = option(
        "auto",
        help="Also train the drafter on a worker during its own rollout tail (a background thread once fewer "
        "than tail_fraction of its sequences still run); 'auto' = only with a single worker, which has no "
        "idle peers to train on.",
    )
    tail_fraction: float = option(
        0.25, help="A worker's rollout is in its tail when fewer than this fraction of its sequences still run."
    )
    tail_sms: int = option(
        0,
        help="GPU SMs the tail trainer's kernels may use (a CUDA green context, rounded up to the device's "
        "granularity of 8); the rollout keeps every SM. 0 = all SMs. Where green contexts are missing it warns "
        "and uses all.",
    )
    tail_duty: float = option(
        1.0,
        help="Largest share of the tail's time the tail trainer keeps the device busy: after a step of t "
        "seconds it idles t * (1 - duty) / duty. 1 = back to back.",
    )
    tail_micro_tokens: int = option(
        2048,
        help="The tail trainer draws each step's batch_tokens as micro-batches of this many tokens, and the "
        "rollout's end applies the step on those done instead of waiting for the whole step: the rollout waits "
        "at most one micro-batch for it. 0 = whole steps (the rollout waits for the step in flight).",
    )
    max_spot_steps: int = option(
        0, help="Most drafter steps one worker trains per rollout (idle or tail); 0 = until the rollout ends."
    )

    def __post_init__(self) -> None:
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check_min(self, "lr_warmup_steps", 0)
        check_min(self, "lr_total_steps", 0)
        check(0 <= self.lr_min_ratio <= 1, "lr_min_ratio", f"must be in [0, 1], got {self.lr_min_ratio}")
        check(
            self.lr_schedule != "cosine" or self.lr_total_steps > self.lr_warmup_steps,
            "lr_total_steps",
            f"the cosine schedule needs lr_total_steps > lr_warmup_steps, got {self.lr_total_steps} and "
            f"{self.lr_warmup_steps}",
        )
        check(
            self.lr_schedule in ("constant", "cosine"),
            "lr_schedule",
            f"must be 'constant' or 'cosine', got {self.lr_schedule!r}",
        )
        check(0 < self.tail_fraction <= 1, "tail_fraction", f"must be in (0, 1], got {self.tail_fraction}")
        check_min(self, "max_spot_steps", 0)
        check_min(self, "tail_sms", 0)
        check_min(self, "tail_micro_tokens", 0)
        check_min(self, "warmup_prompts", 1)
        check_min(self, "warmup_max_new_tokens", 0)
        check(self.warmup_epochs > 0, "warmup_epochs", f"must be > 0, got {self.warmup_epochs}")
        check(self.warmup_lr >= 0, "warmup_lr", f"must be >= 0 (0 = the width rule), got {self.warmup_lr}")
        check(0 < self.tail_duty <= 1, "tail_duty", f"must be in (0, 1], got {self.tail_duty}")
        check_min(self, "batch_tokens", 1)
        check_min(self, "buffer_steps", 1)
        check_min(self, "hidden_loss_weight", 0.0)
        check_min(self, "token_loss_weight", 0.0)
        check(
            self.hidden_loss_weight + self.token_loss_weight > 0,
            "token_loss_weight",
            "hidden_loss_weight and token_loss_weight are both 0: the drafter would learn nothing",
        )
        check_min(self, "noise_std", 0.0)
        check_min(self, "checkpoint_every", 1)
        check_min(self, "unroll", 1)
        check_min(self, "loss_temperature", 0.0)
        check_min(self, "sampled_token_weight", 0.0)
        check_min(self, "draft_vocab", 0)
        check_min(self, "grad_accum", 1)
        check_min(self, "weight_decay", 0.0)
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"must be two numbers in [0, 1), got {self.betas}",
        )
        check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            f"must be > 0 or null, got {self.max_grad_norm}",
        )
        check(
            self.unroll_context in ("chain", "shifted"),
            "unroll_context",
            f"must be 'chain' or 'shifted', got {self.unroll_context!r}",
        )
