"""benchmarks/gpu_verl.sh's recipe through verl itself, on CPU (`make verl-test`): its Hydra overrides compose
and pass verl's checks, verl's dataset reads our parquet, verl loads our reward function, and (slow) verl's own
GRPO trainer runs two steps with `rollout.name=tlt_rt` on a tiny model (verl on the CPU through
tests/verl/cpu_platform.py). Skipped where verl is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")
pytest.importorskip("ray")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl.trainer.ppo.reward import get_custom_reward_fn  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn  # noqa: E402

from tests.verl.test_verl_backend import tiny_model  # noqa: E402
from tlt_rt.integrations import verl_data  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")


def recipe_overrides(model: Path, data: Path, out: Path, **env) -> list[str]:
    """gpu_verl.sh's overrides, as it passes them to main_ppo."""
    run = subprocess.run(["bash", str(REPO / "benchmarks/gpu_verl.sh"), "--overrides", str(model), str(data), str(out)],
                         capture_output=True, text=True, check=True, env={**os.environ, **env})  # fmt: skip
    return [line for line in run.stdout.splitlines() if line]


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")])


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    model = tiny_model(root / "model", seed=0, max_positions=512)
    data = root / "data"
    verl_data.build(data, train=32, test=8)
    return model, data, root / "out"


def test_recipe_config_composes_and_passes_verl_checks(recipe):
    model, data, out = recipe
    cfg = composed(recipe_overrides(model, data, out))
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert not need_reference_policy(cfg) and not need_critic(cfg)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert (rollout.name, rollout.mode, rollout.n, rollout.tensor_model_parallel_size) == ("tlt_rt", "async", 4, 1)
    assert rollout.engine_kwargs["tlt_rt"] == {
        "speculative": "auto",
        "max_context": 1024,
        "num_blocks": 3072,
        "release_on_sleep": False,
    }
    assert (rollout.prompt_length, rollout.response_length) == (256, 512)
    hf = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    assert hf.hf_config._attn_implementation == "sdpa" and hf.tokenizer.chat_template
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert cfg.trainer.logger == ["console"] and cfg.trainer.total_training_steps == 3
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.data.train_batch_size == 8


def test_recipe_parquet_reads_in_verl_dataset(recipe):
    model, data, out = recipe
    cfg = composed(recipe_overrides(model, data, out))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ds = RLHFDataset(str(data / "train.parquet"), tokenizer, cfg.data)
    assert len(ds) == 32  # none filtered as longer than max_prompt_length
    rows = verl_data.rows("train", 32)
    item = ds[3]
    assert item["raw_prompt"] == rows[3]["prompt"] and item["index"] == 3
    assert item["reward_model"]["ground_truth"] == rows[3]["reward_model"]["ground_truth"]
    batch = collate_fn([ds[i] for i in range(4)])
    assert list(batch["data_source"]) == [verl_data.DATA_SOURCE] * 4
    ids = tokenizer.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)  # fmt: skip
    assert 20 < len(ids) <= cfg.data.max_prompt_length


def test_recipe_reward_function_through_verl(recipe):
    cfg = composed(recipe_overrides(*recipe))
    score = get_custom_reward_fn(cfg)
    row = verl_data.rows("test", 1)[0]
    gt = row["reward_model"]["ground_truth"]
    kw = {"data_source": row["data_source"], "ground_truth": gt, "extra_info": row["extra_info"]}
    assert score(solution_str=f"Step by step... The answer is {gt}.", **kw)["score"] == 1.0
    assert score(solution_str=f"The answer is {int(gt) + 1}.", **kw)["score"] == 0.0


def _metric(text: str, step: int, name: str) -> float:
    line = next(ln for ln in text.splitlines() if re.search(rf"\bstep:{step} - ", ln))
    return float(re.search(rf"{re.escape(name)}:(?:np\.\w+\()?([-0-9.e+]+)", line).group(1))


@pytest.mark.slow
def test_verl_grpo_trainer_runs_on_tlt_rt(recipe):
    """verl's main_ppo, two GRPO steps of 8 prompts x 4 samples, rollouts from our engine, on CPU."""
    for name in ("transfer_queue", "cachetools", "fastapi", "uvicorn"):  # Makefile's VERL_EXTRA
        pytest.importorskip(name, reason="verl's trainer imports it: make verl-env installs it")
    model, data, out = recipe
    args = recipe_overrides(model, data, out, SPEC="off", STEPS="2")
    cpu = [
        "trainer.device=cpu",
        "+ray_kwargs.ray_init.num_gpus=1",  # logical GPUs: verl's resource pools ask for them
        "ray_kwargs.ray_init.num_cpus=12",  # logical too: TransferQueue's storage units take one CPU each
        "actor_rollout_ref.actor.strategy=fsdp2",  # FSDP1 wants an accelerator
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "data.max_response_length=32",
        "actor_rollout_ref.rollout.engine_kwargs.tlt_rt.max_context=512",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VERL_USE_EXTERNAL_MODULES": "tests.verl.cpu_platform",
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",
        "VERL_ENGINE_VENDOR": "nvidia",
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
    }
    run = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *args, *cpu], capture_output=True, text=True,
                         env=env, timeout=540, cwd=str(out.parent))  # fmt: skip
    text = run.stdout + run.stderr
    (out / "verl.log").write_text(text)
    assert run.returncode == 0, text[-4000:]
    assert "Initial validation metrics" in text and "Final validation metrics" in text
    for step in (1, 2):
        assert _metric(text, step, "training/global_step") == step
        assert _metric(text, step, "response_length/mean") > 0
        # our log-probs are the ones the actor computes for the same tokens, to its bf16 rounding (fp32 engine)
        assert _metric(text, step, "training/rollout_probs_diff_mean") < 0.01
        assert _metric(text, step, "rollout_corr/log_ppl_abs_diff") < 0.1
        # every sample comes from the weights of the step before it (our server reports their global step)
        assert _metric(text, step, "training/off_policy/trajectory_staleness/max") == 0
    assert OmegaConf.load(out / "hydra" / ".hydra" / "overrides.yaml")
