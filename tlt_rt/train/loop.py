"""The RL loop. Each step: sample prompts, roll them out over the workers (idle workers train the drafter),
score the responses, compute GRPO advantages, run the data-parallel learner update, merge the drafter,
then write metrics and a checkpoint. Tensor-parallel engines and the FSDP learner run on sharded workers
(train/cluster/sharded.py); the loop talks to each engine's rank 0 alone. How a step is cut up lives in
batching.py, what it records in records.py.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from tlt_rt.models.default import load_tokenizer
from tlt_rt.options import ConfigError
from tlt_rt.train import heldout
from tlt_rt.train.batching import build_minibatches, share_seed, work_shares
from tlt_rt.train.cluster import placement
from tlt_rt.train.cluster.coordinator import Coordinator
from tlt_rt.train.cluster.pool import WorkerPool, make_pool
from tlt_rt.train.config import TLTConfig
from tlt_rt.train.records import step_record, summary_line, timelines
from tlt_rt.train.rl import checkpoint as ckpt
from tlt_rt.train.rl.data import (
    ArithmeticTask,
    Problem,
    PromptSource,
    ReasoningGymTask,
    format_prompt,
    load_dataset_file,
)
from tlt_rt.train.rl.grpo import equal_reward_groups, group_advantages
from tlt_rt.train.rl.learner import LearnResult, LearnSample
from tlt_rt.train.rl.loggers import open_loggers
from tlt_rt.train.rl.metrics import MetricsWriter
from tlt_rt.train.rl.progress import Progress, run_summary
from tlt_rt.train.rl.reward import resolve_reward
from tlt_rt.train.rl.sd_explain import sd_reason
from tlt_rt.yaml12 import dump_yaml


class RunExistsError(ValueError):
    """The run folder already holds a run and resume is off."""


def init_ray(cfg: TLTConfig) -> bool:
    """Join `cluster.ray_address` / $RAY_ADDRESS, else start a local Ray; True when this call connected."""
    if ray.is_initialized():
        return False
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster needs no token
    c = cfg.cluster
    cpus = max(os.cpu_count() or 1, c.num_workers * c.tensor_parallel * c.cpus_per_worker)
    gpus = torch.cuda.device_count() if c.gpus_per_worker else 0
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False)
    return True


def make_source(cfg: TLTConfig) -> PromptSource:
    t = cfg.task
    if t.kind == "arithmetic":
        task = ArithmeticTask.from_config(t)
        return PromptSource(task, cfg.rl.prompts_per_step, seed=t.seed)
    if t.kind == "reasoning_gym":
        return PromptSource(ReasoningGymTask.from_config(t), cfg.rl.prompts_per_step, seed=t.seed)
    problems = load_dataset_file(t.path, t.question_field, t.answer_field)
    return PromptSource(problems, cfg.rl.prompts_per_step, seed=t.seed)


class Trainer:
    def __init__(self, cfg: TLTConfig) -> None:
        c = cfg.cluster
        if c.gpus_per_worker > c.tensor_parallel:
            raise ConfigError(
                "cluster.gpus_per_worker",
                f"is {c.gpus_per_worker} with tensor_parallel={c.tensor_parallel}: a worker runs one engine, so "
                "its GPUs are its TP group; set gpus_per_worker = tensor_parallel (more workers for more engines)",
            )
        want = "cuda" if c.gpus_per_worker else "cpu"
        if cfg.model.device not in ("auto", want):
            raise ConfigError(
                "model.device",
                f"is {cfg.model.device} but cluster.gpus_per_worker={c.gpus_per_worker} puts workers on {want}; "
                f"set model.device=auto or {want}",
            )
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir) / cfg.name
        last = ckpt.latest_checkpoint(self.run_dir) if cfg.resume else None
        if not cfg.resume and ((self.run_dir / "metrics.jsonl").exists() or ckpt.list_checkpoints(self.run_dir)):
            raise RunExistsError(f"{self.run_dir} already holds a run: pass resume=true to continue it, or name=NEW")
        if cfg.resume and not self.run_dir.is_dir():
            raise ConfigError("resume", f"is true but there is no run {self.run_dir} to resume")
        if last is not None:
            ckpt.verify_pt_files(last)  # before any worker unpickles them
        elif cfg.resume:
            tqdm.write(f"resume=true: {self.run_dir} has no complete checkpoint yet; starting from step 1")
        self.pool: WorkerPool | None = None
        self.metrics: MetricsWriter | None = None
        self.placement_groups: list = []
        self._owns_ray = False
        self._made_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(cfg, last, load_tokenizer)
        except BaseException:
            self.close()
            if self._made_dir:  # nothing of value is in it yet: leave no half-made run folder behind
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _start(self, cfg: TLTConfig, last: Path | None, load_tokenizer) -> None:
        c = cfg.cluster
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.source = make_source(cfg)
        self.reward_fn = resolve_reward(cfg.task.reward)
        # a reasoning-gym task scores with its dataset's verifier, which reads the whole entry, not an answer string
        self.task_score = self.source.source.score if cfg.task.kind == "reasoning_gym" else None
        self.held_out = heldout.held_out_problems(cfg)
        (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        self.start_step, state = 0, None
        if last is not None:
            state = ckpt.load_state(last)
            self.start_step = int(state["step"])
            self.source.load_state_dict(state["prompts"])
            ckpt.set_python_rng_state(state["python_rng"])
        self._owns_ray = init_ray(cfg)
        # one placement group per TP group, planned over the live nodes; each worker takes one bundle
        layout = placement.plan_layout(c, placement.ray_nodes())
        self.placement_groups = placement.create_placement_groups(layout, c.placement_timeout_s, cfg.name)
        policy = str(last / "policy") if last is not None else None
        self.pool = make_pool(cfg, self.run_dir, policy, layout, self.placement_groups)
        if last is not None:
            self.pool.load_checkpoint(last)
            self.pool.version = int(state["version"])
            tqdm.write(f"resumed {self.run_dir} at step {self.start_step} from {last}")
        self.coordinator = Coordinator(self.pool, spot=cfg.drafter.train_online)
        lg = cfg.logging
        loggers = open_loggers([*lg.loggers, *(["tensorboard"] if cfg.tensorboard else [])], self.run_dir, cfg.name,
                               lg.wandb_project, lg.wandb_mode)  # fmt: skip
        self.metrics = MetricsWriter(self.run_dir, self.start_step, loggers=loggers)
        self.history: list[dict] = []
        self.progress = Progress(self.start_step, cfg.rl.steps, lg.progress_every_s)
        self.checkpoint: Path | None = last
        self.t0, self.stopping = time.time(), False  # run()'s start (rl.time_limit_s); whether this step ends it

    def out_of_time(self, step: int) -> bool:
        """Whether `rl.time_limit_s` ends the run after `step` (never after the run's own last step)."""
        limit = self.cfg.rl.time_limit_s
        return limit > 0 and time.time() - self.t0 >= limit and step + 1 < self.cfg.rl.steps

    def run(self) -> list[dict]:
        self.t0 = t0 = time.time()
        limit = self.cfg.rl.time_limit_s
        for step in range(self.start_step, self.cfg.rl.steps):
            record = self.step(step)
            self.history.append(record)
            out_of_time = self.stopping
            every = self.cfg.rl.checkpoint_every
            if every and ((step + 1) % every == 0 or step + 1 == self.cfg.rl.steps or out_of_time):
                self.checkpoint = self.save_checkpoint(step + 1)
            self.progress.step_done()
            tqdm.write(f"{self.progress.prefix(step)} {summary_line(record)}")
            tqdm.write(f"    {sd_reason(record, self.cfg.rollout.speculative)}")
            if out_of_time:
                tqdm.write(f"rl.time_limit_s={limit:g} reached after {step + 1} of {self.cfg.rl.steps} steps; "
                           "resume=true continues from the checkpoint")  # fmt: skip
                break
        tqdm.write(run_summary(self.history, self.run_dir, self.checkpoint, self.cfg.rollout.speculative,
                               time.time() - t0))  # fmt: skip
        return self.history

    # --------------------------------------------------------------------------------------- a step
    def step(self, step: int) -> dict:
        cfg, pool = self.cfg, self.pool
        before = self._evaluate(step) if heldout.due(cfg, step) else {}
        t0 = time.time()
        problems = self.source.next_batch()
        prompts = [format_prompt(p, self.tokenizer, instruction=cfg.task.instruction or None) for p in problems]
        n = cfg.rl.group_size
        shares, origins, answers = work_shares(len(prompts), n, pool.size, cfg.cluster.split)
        r = cfg.rollout
        params = [dict(n=k, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                       seed=share_seed(cfg.rl.seed, step, key))
                  for (key, _), k in zip(origins, answers, strict=True)]  # fmt: skip
        self.progress.begin(step, "rollout", len(prompts) * n)
        with tqdm(total=len(prompts) * n, desc=f"step {step} rollout", unit="seq", leave=False, disable=None) as bar:
            outcome = self.coordinator.rollout(step, [prompts[lo:hi] for lo, hi in shares], params,
                                               _Both(bar, self.progress))  # fmt: skip
        self.coordinator.merge(outcome)
        t_rollout = time.time()

        responses: list[list[tuple]] = [[()] * n for _ in prompts]
        for (lo, _), (_, first), res in zip(shares, origins, outcome.results, strict=True):
            for c in res.samples:
                responses[lo + c.prompt_index][first + c.sample_index] = (c.token_ids, c.logprobs, c.finish_reason)
        texts = [[self.tokenizer.decode(c[0], skip_special_tokens=True) for c in row] for row in responses]
        self.progress.begin(step, "scoring")
        pairs = zip(texts, problems, strict=True)
        rewards = torch.tensor([[self._reward(t, p) for t in row] for row, p in pairs])
        adv = group_advantages(rewards, cfg.rl.normalize_adv_std, cfg.rl.adv_eps)
        drop = (
            equal_reward_groups(rewards) if cfg.rl.drop_equal_reward_groups else torch.zeros(len(prompts), dtype=bool)
        )
        samples = [
            LearnSample(prompts[i], list(responses[i][j][0]), list(responses[i][j][1]), float(adv[i, j]))
            for i in range(len(prompts)) if not drop[i] for j in range(n)
        ]  # fmt: skip
        learn: list[LearnResult] = []
        if samples:
            self.progress.begin(step, "learner update")
            per_worker = build_minibatches(samples, cfg.rl.mini_batches, pool.size)
            with tqdm(total=1, desc=f"step {step} update", leave=False, disable=None) as bar:
                learn = self.coordinator.learn(step, per_worker, pool.version)
                bar.update(1)
            pool.version += len(per_worker[0])
        t_end = time.time()
        record = step_record(step, outcome, rewards, responses, drop, samples, learn, t0, t_rollout, t_end,
                             kl=bool(cfg.rl.kl_coef), version=pool.version, restarts=pool.restarts)  # fmt: skip
        if cfg.logging.accept_ceiling and cfg.rollout.speculative != "off":
            record.update(heldout.accept_ceiling(pool, record["strategy_use"]))
        if cfg.logging.drafter_curve and cfg.rollout.speculative != "off":
            self.progress.begin(step, "drafter curve")
            record.update(heldout.drafter_curve(pool, cfg.logging.drafter_curve_answers, record["strategy_use"]))
        record.update(before)
        # the run's last step: its own last one, or the one after which rl.time_limit_s ends it (decided before
        # the evaluation, which is outside the step's time)
        self.stopping = self.out_of_time(step)
        if self.held_out and (step + 1 == cfg.rl.steps or self.stopping):  # the trained policy, after its last update
            record.update({f"{k}_end": v for k, v in self._evaluate(step).items()})
        self.metrics.write(record, timelines(outcome))
        return record

    def _evaluate(self, step: int) -> dict:
        self.progress.begin(step, "held-out evaluation")
        return heldout.evaluate(self.pool, self.tokenizer, self.held_out, self.cfg, self._reward)

    def _reward(self, text: str, problem: Problem) -> float:
        t = self.cfg.task
        name = f"the verifier of reasoning-gym {t.rg_dataset}" if self.task_score else f"task.reward {t.reward}"
        try:
            value = float(self.task_score(text, problem) if self.task_score else self.reward_fn(text, problem.answer))
        except Exception as e:  # a user's reward function: say which one failed, on what
            raise RuntimeError(f"{name} raised {type(e).__name__}: {e}") from e
        if not math.isfinite(value):
            raise RuntimeError(f"{name} returned {value} (rewards must be finite)")
        return value

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, steps_done: int) -> Path:
        tmp = ckpt.staging_dir(self.run_dir, steps_done)
        try:
            self.pool.call_all("save_checkpoint", [(str(tmp),)] * self.pool.size)
        except ray.exceptions.RayActorError:  # a worker died while saving: replace it and save again
            for rank in range(self.pool.size):
                if not self.pool._alive(rank):
                    self.pool.replace(rank)
            self.pool.call_all("save_checkpoint", [(str(tmp),)] * self.pool.size)
        state = {"step": steps_done, "prompts": self.source.state_dict(), "python_rng": ckpt.python_rng_state(),
                 "version": self.pool.version, "name": self.cfg.name}  # fmt: skip
        return ckpt.commit(tmp, self.run_dir, steps_done, state, self.cfg.rl.keep_checkpoints)

    def close(self) -> None:
        if getattr(self, "progress", None) is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        for w in self.pool.actors if self.pool is not None else []:
            ray.kill(w, no_restart=True)
        placement.remove_placement_groups(self.placement_groups)
        self.placement_groups = []
        if self._owns_ray:
            ray.shutdown()


class _Both:
    """Progress hook that feeds the tqdm bar (terminals) and the plain progress lines (logs)."""

    def __init__(self, *hooks) -> None:
        self.hooks = hooks

    def update(self, n: int) -> None:
        for h in self.hooks:
            h.update(n)


def train(cfg: TLTConfig) -> list[dict]:
    """Run (or resume) training as configured; returns the metrics records of the steps run."""
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()
