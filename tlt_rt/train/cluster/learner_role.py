"""A worker's share of the data-parallel learner: the policy model, the frozen reference model, the update,
and the policy's weights in and out (for a replacement worker and for checkpoints).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tlt_rt.models import load_target, save_target
from tlt_rt.models.llama import CausalLM
from tlt_rt.models.loader import resolve_model_path
from tlt_rt.train.cluster.comm import all_reduce_sum
from tlt_rt.train.cluster.rollout_role import RolloutRole
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.profile import profiled
from tlt_rt.train.rl.checkpoint import load_pt
from tlt_rt.train.rl.flops import peak_flops
from tlt_rt.train.rl.learner import Learner, LearnResult, MiniBatch, SamplingFilter

TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template",
                   "generation_config")  # fmt: skip


def copy_tokenizer_files(model_path: str | None, folder: Path) -> None:
    """Tokenizer and chat template files travel as they are (loading a tokenizer costs seconds)."""
    for f in resolve_model_path(model_path).iterdir():
        if f.is_file() and f.name.startswith(TOKENIZER_FILES):
            shutil.copy2(f, folder / f.name)


class LearnerRole:
    """Owns the policy model, the reference model and the `Learner`. The rollout role is shared: its engine's
    memory is given back during an update, and its memory peaks are reported with the update's."""

    def __init__(self, model: CausalLM, cfg: TLTConfig, rank: int, world_size: int, device: torch.device,
                 run_dir: Path, rollout: RolloutRole) -> None:  # fmt: skip
        self.model, self.cfg, self.rank, self.device, self.run_dir = model, cfg, rank, device, run_dir
        self.rollout = rollout
        ref = None
        if cfg.rl.kl_coef > 0:  # the reference policy is the run's starting model, frozen
            ref = load_target(cfg.model.path, dtype=cfg.model.dtype, device=device).requires_grad_(False)
        r = cfg.rollout
        self.sampling = sampling = SamplingFilter(r.temperature, r.top_k, r.top_p)
        sync = all_reduce_sum if world_size > 1 else None
        self.learner = Learner(model, cfg.rl, sampling, sync, ref)
        # the learner's compiled graphs now, not in the first updates; a sharded worker's learner model has no
        # compiled glue (its engine, built later, holds a copy), so nothing to warm up there
        if device.type == "cuda" and rollout.engine is not None:
            with rollout.released():  # the warm-up's largest micro-batch needs what an update needs
                self.learner.warm_up(max_len=cfg.model.max_context)

    @property
    def version(self) -> int:
        return self.learner.version

    def learn(self, step: int, minibatches: list[MiniBatch]) -> LearnResult:
        """One update (profiled at `logging.profile_learner_step`), with the rollout's and its own memory peaks."""
        cuda = self.device.type == "cuda"
        with self.rollout.released():
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            if self.cfg.rl.recompute_logprobs:
                self.learner.recompute_logprobs([s for mb in minibatches for s in mb.samples])
            at = self.run_dir / "profile" / f"learner-step{step}-rank{self.rank}.txt"
            title = f"learner update, step {step}, rank {self.rank}"
            with profiled(at if step == self.cfg.logging.profile_learner_step else None, title, self.device):
                out = self.learner.update(minibatches)
        if cuda:
            out.peak_learn_bytes = float(torch.cuda.max_memory_allocated(self.device))
            out.peak_rollout_bytes = self.rollout.peak_bytes
            out.reserved_learn_bytes = float(torch.cuda.max_memory_reserved(self.device))
            out.reserved_rollout_bytes = self.rollout.reserved_bytes
            torch.cuda.reset_peak_memory_stats(self.device)  # the next rollout's peak starts here
        out.peak_flops = peak_flops(self.device)
        out.rank, out.version = self.rank, self.learner.version
        return out

    # ---------------------------------------------------------------------------- state transfer
    def export_state(self) -> dict:
        return {
            "policy": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "learner": self.learner.state_dict(),
        }

    @torch.no_grad()
    def import_state(self, state: dict) -> None:
        self.model.load_state_dict(state["policy"])
        self.learner.load_state_dict(state["learner"])

    def save_checkpoint(self, folder: Path) -> None:
        """Rank 0 writes the policy (HF layout, with the tokenizer files) and the learner's state."""
        if self.rank == 0:
            save_target(self.model, folder / "policy")
            copy_tokenizer_files(self.cfg.model.path, folder / "policy")
            torch.save(self.learner.state_dict(), folder / "learner.pt")

    def load_checkpoint(self, folder: Path) -> None:
        """The learner's state (the policy weights were loaded at construction)."""
        self.learner.load_state_dict(load_pt(folder / "learner.pt"))
