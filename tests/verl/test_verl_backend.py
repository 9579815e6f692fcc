"""Our backend driven through verl's own rollout classes on a tiny model, on CPU (`make verl-test`).

verl's registry resolves `rollout.name=tlt_rt` to our replica; verl's `RolloutReplica` methods (sleep,
wake_up, abort) fan out to our server actor; verl's `get_rollout_class` builds our server adapter, whose
`update_weights` takes the (HF name, tensor) stream a verl training worker sends. Skipped where verl is not
installed (the project's own environment: verl pins an older transformers).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

verl = pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import RolloutReplicaRegistry, TokenOutput  # noqa: E402

import tlt_rt.integrations.verl as backend  # noqa: E402,F401  (registers "tlt_rt")
from tlt_rt.models.arch import ArchConfig  # noqa: E402
from tlt_rt.models.default import default_model_dir  # noqa: E402
from tlt_rt.models.llama import CausalLM  # noqa: E402
from tlt_rt.models.loader import save_target  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402


def tiny_model(folder: Path, seed: int, max_positions: int = 256) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (verl's model config loads one)."""
    src = default_model_dir()
    vocab = 49152
    arch = ArchConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_positions,
                      eos_token_ids=(2,), bos_token_id=1)  # fmt: skip
    torch.manual_seed(seed)
    model = CausalLM(arch).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked: greedy continuations differ between seeds
    save_target(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if not (Path(src) / name).is_file():
            continue
        shutil.copy(Path(src) / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    repo = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": repo, "VERL_USE_EXTERNAL_MODULES": "tlt_rt.integrations.verl", "RAY_AUTH_MODE": "disabled"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_verl_drives_tlt_rt_backend(ray_cluster, tmp_path):
    path = tiny_model(tmp_path / "policy", seed=0)
    new_path = tiny_model(tmp_path / "updated", seed=1)
    config = RolloutConfig(
        name="tlt_rt",
        mode="async",
        tensor_model_parallel_size=1,
        prompt_length=16,
        response_length=8,
        max_model_len=64,
        engine_kwargs={"tlt_rt": {"num_blocks": 64, "block_size": 16, "max_batch": 8}},
    )
    model_config = HFModelConfig(path=str(path))

    replica_cls = RolloutReplicaRegistry.get("tlt_rt")  # what rollout.name=tlt_rt resolves to
    assert replica_cls is backend.TltReplica
    replica = replica_cls(replica_rank=0, config=config, model_config=model_config, gpus_per_node=1)
    prompts = [[1, 5, 9, 200], [1, 42], [1, 7, 7, 7, 7, 3000]]
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}

    def reference(p: Path):
        eng = Engine.from_pretrained(str(p), speculative="off", dtype="float32", device="cpu", num_blocks=64)
        return [o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8,
                                                                          stop_token_ids=[]))]  # fmt: skip

    async def main():
        await replica.init_hybrid(SimpleNamespace(workers=[]))  # verl's hybrid entry; our servers need no workers
        server = replica.server_handle
        outs = await asyncio.gather(*[server.generate.remote(p, dict(greedy), f"a{i}") for i, p in enumerate(prompts)])
        sampled = await server.generate.remote(prompts[0], {"temperature": 0.9, "top_k": 20, "max_tokens": 5}, "s")

        # verl's training-worker side: the rollout class for ("tlt_rt", "async"), its weight stream, sleep/wake
        adapter = get_rollout_class("tlt_rt", "async")(config=config, model_config=model_config, device_mesh=None)
        await replica.sleep()
        await adapter.release()
        await adapter.resume(tags=["weights"])
        stream = ((k, v) for k, v in load_file(str(new_path / "model.safetensors")).items())
        n = await adapter.update_weights(stream, global_steps=7)  # verl passes its global step
        await adapter.resume(tags=["kv_cache"])
        await replica.wake_up()
        after = await asyncio.gather(*[server.generate.remote(p, dict(greedy), f"b{i}") for i, p in enumerate(prompts)])

        long = server.generate.remote(prompts[1], {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}, "c")
        await asyncio.sleep(0.5)
        await replica.abort_all_requests()
        aborted = await long
        return outs, sampled, n, after, aborted

    outs, sampled, n, after, aborted = asyncio.run(main())
    assert all(isinstance(o, TokenOutput) for o in outs)
    assert [o.token_ids for o in outs] == reference(path)
    assert all(o.stop_reason == "completed" and len(o.log_probs) == 8 for o in outs)
    assert len(sampled.token_ids) <= 5 and len(sampled.log_probs) == len(sampled.token_ids)
    assert n > 0
    assert [o.token_ids for o in after] == reference(new_path)  # exactly as a reload of the new weights
    assert [o.token_ids for o in after] != [o.token_ids for o in outs]
    # the weights' version, which verl's v1 trainer reads as each trajectory's min/max_global_steps
    assert [o.extra_fields["global_steps"] for o in outs] == [None] * 3
    assert [o.extra_fields["global_steps"] for o in after] == [7] * 3
    assert aborted.stop_reason in ("aborted", "completed")


@pytest.mark.parametrize("release", [True, False])
def test_a_server_keeps_its_cache_over_sleep_when_told(tmp_path, release):
    """verl sleeps every replica after each generation; release_on_sleep=false keeps the cache and the steps."""
    model = tiny_model(tmp_path / "policy", seed=0)
    kw = {"num_blocks": 32, "block_size": 16, "max_batch": 4, "release_on_sleep": release}
    server = backend.TltServer({"engine_kwargs": {"tlt_rt": kw}}, {"path": str(model)})
    cache = server.engine.runner.target.cache.k
    before = cache.untyped_storage().size()
    asyncio.run(server.sleep())
    assert (cache.untyped_storage().size() == 0) == release
    asyncio.run(server.wake_up())
    assert cache.untyped_storage().size() == before
    server.aengine.shutdown()
