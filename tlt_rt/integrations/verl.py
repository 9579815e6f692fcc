"""tlt_rt as a verl rollout backend: `actor_rollout_ref.rollout.name=tlt_rt`.

    VERL_USE_EXTERNAL_MODULES=tlt_rt.integrations.verl python -m verl.trainer.main_ppo \\
        actor_rollout_ref.rollout.name=tlt_rt actor_rollout_ref.rollout.mode=async ...

(The `verl.plugins` entry point in pyproject.toml registers it too, with no variable, wherever tlt_rt is
installed.) Importing this module registers three things with verl:

- `TltReplica` in verl's `RolloutReplicaRegistry`: one rollout server per replica, a Ray actor named
  `tlt_rt_server_{replica}` (`TltServer`) holding an `AsyncEngine` over the replica's model;
- `TltServerAdapter` as verl's rollout class for ("tlt_rt", "async"): inside verl's training workers it
  forwards `update_weights` (the (HF name, tensor) stream), `resume` and `release` to that server;
- the drafter-training hook: with `engine_kwargs.tlt_rt.drafter_training` set, the server keeps every
  finished sample's target hidden states and trains its drafter whenever no request is left
  (`tlt_rt.integrations.drafter_hook.SpotDrafter`), so a verl run gets spot drafter training too.

Engine options come from `actor_rollout_ref.rollout.engine_kwargs.tlt_rt` (any `Engine` keyword, plus
`drafter_path`, `speculative`, `device`, `drafter_training` and `release_on_sleep`).
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.plugin.platform import get_platform
from verl.utils.device import get_resource_name
from verl.workers.rollout import base as verl_rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "tlt_rt"
_STOP_REASONS = {"stop": "completed", "length": "completed", "abort": "aborted"}


def server_name(replica_rank: int) -> str:
    return f"{NAME}_server_{replica_rank}"


def _option(cfg, key, default=None):
    try:
        return cfg.get(key, default)
    except AttributeError:
        return getattr(cfg, key, default)


class TltServer:
    """One replica's server (a Ray actor): verl's token-in-token-out calls over an AsyncEngine."""

    def __init__(self, config, model_config, replica_rank: int = 0):
        # local: verl's plugin entry point imports this module in every verl process; only this actor runs an engine
        from tlt_rt.rollout import AsyncEngine, Engine

        kw = dict(_option(_option(config, "engine_kwargs", {}) or {}, NAME, {}) or {})
        path = _option(model_config, "local_path", None) or _option(model_config, "path")
        drafter_training = kw.pop("drafter_training", None)
        # verl puts every replica to sleep after each generation and wakes it before the weight update: a sleep
        # frees the KV cache and the captured steps, and the wake-up captures those steps again (seconds each
        # RL step). release_on_sleep=false keeps both, for a policy and optimizer that fit beside the cache.
        self.release_on_sleep = bool(kw.pop("release_on_sleep", True))
        dtype = "float32" if not torch.cuda.is_available() else _option(config, "dtype", "auto")
        self.engine = Engine.from_pretrained(
            path,
            drafter_path=kw.pop("drafter_path", None),
            speculative=kw.pop("speculative", "auto" if torch.cuda.is_available() else "off"),
            dtype=kw.pop("dtype", dtype),
            device=kw.pop("device", None),
            max_batch=kw.pop("max_batch", min(int(_option(config, "max_num_seqs", 64) or 64), 256)),
            **kw,
        )
        self.max_model_len = int(_option(config, "max_model_len", None) or self.engine.max_context)
        self.response_length = int(_option(config, "response_length", 512))
        self.prompt_length = int(_option(config, "prompt_length", 512))
        e, visible = self.engine, os.environ.get("CUDA_VISIBLE_DEVICES")
        print(f"tlt_rt server {replica_rank}: {path} on {e.device} ({e.target.lm_head.weight.dtype}), speculative "
              f"{e.speculative}, {e.blocks.num_blocks} KV blocks of {e.block_size}, max batch {e.max_batch}, context "
              f"{e.max_context}; CUDA_VISIBLE_DEVICES={visible}", flush=True)  # fmt: skip
        self.spot = None
        hooks = {}
        if drafter_training:
            # local: drafter training is opt-in; its trainer is not loaded into servers that do not train
            from tlt_rt.integrations.drafter_hook import SpotDrafter

            self.spot = SpotDrafter(self.engine, **(drafter_training if isinstance(drafter_training, dict) else {}))
            hooks = {"collect_hidden": True, "on_sample": self.spot.collect, "on_idle": self.spot.train_while_idle}
        self.aengine = AsyncEngine(self.engine, seed=int(_option(config, "seed", 0) or 0) + replica_rank, **hooks)
        self._blocked = False
        # the weights' version (verl's global step of the last update), reported with every answer: verl's v1
        # trainer reads it as the trajectory's min/max_global_steps and fails on None
        self.global_steps: int | None = None

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, **kwargs) -> TokenOutput:
        if any(kwargs.get(k) for k in ("image_data", "video_data", "audio_data")):
            raise ValueError("tlt_rt serves text-only models: image / video / audio inputs are not supported")
        prompt_ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        params = dict(sampling_params)
        if "max_tokens" not in params and "max_new_tokens" not in params:
            params["max_tokens"] = min(
                self.response_length, self.prompt_length + self.response_length - len(prompt_ids)
            )
        room = self.max_model_len - len(prompt_ids)
        key = "max_tokens" if "max_tokens" in params else "max_new_tokens"
        params[key] = max(1, min(int(params[key]), room))
        params["logprobs"] = None  # always returned
        out = await self.aengine.generate(prompt_ids, params, request_id)
        return TokenOutput(
            token_ids=out.token_ids,
            log_probs=out.logprobs,
            stop_reason=_STOP_REASONS.get(out.finish_reason),
            num_preempted=int(out.outputs[0].stats.get("preemptions", 0)),
            extra_fields={"global_steps": self.global_steps},
        )

    async def update_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> int:
        n = await self.aengine.update_weights(named_tensors)
        if global_steps is not None:
            self.global_steps = global_steps
        return n

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self) -> None:
        await self.aengine.wake_up()

    async def sleep(self) -> None:
        if self.release_on_sleep:
            await self.aengine.sleep()

    async def release_kv_cache(self) -> None:
        if self.release_on_sleep:
            await self.aengine.sleep()

    async def resume_kv_cache(self) -> None:
        await self.aengine.wake_up()

    async def clear_kv_cache(self) -> None:
        pass  # no prefix cache: nothing survives a request

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.aengine.abort_all()

    async def resume_generation(self) -> None:
        pass

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass

    async def stats(self) -> dict:
        st = self.engine.stats()
        if self.spot is not None:
            st["drafter_training"] = self.spot.stats()
        return st


def _worker_placement(worker) -> tuple[str, list[str]]:
    """(node id, accelerator ids) of a verl worker, run inside it."""
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(d) for d in ctx.get_accelerator_ids().get(get_resource_name(), [])]


class TltReplica(RolloutReplica):
    """verl's rollout replica for tlt_rt: one `TltServer` actor (one engine per replica)."""

    async def launch_servers(self):
        if self.world_size != 1:
            raise ValueError(f"tlt_rt runs one engine per replica: set tensor/data/pipeline parallel sizes to 1, "
                             f"got world size {self.world_size}")  # fmt: skip
        options = {"name": server_name(self.replica_rank), "max_concurrency": self.max_concurrency}
        if self.workers:
            # the replica's workers (verl's training workers when hybrid, its rollout pool's otherwise) hold its
            # GPU inside their placement group, so a server asking Ray for GPU would wait forever: as verl's own
            # servers do, it goes to their node and sees their devices, Ray told to leave that variable alone
            node_id, devices = await self.workers[0].__ray_call__.remote(_worker_placement)
            platform = get_platform()
            env = {var: "1" for var in platform.ray_noset_envvars()}
            if devices:
                env[platform.visible_devices_envvar()] = ",".join(devices)
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            options["runtime_env"] = {"env_vars": env}
        elif torch.cuda.is_available() and self.rollout_mode is not None:
            options["num_gpus"] = 1  # no workers to follow: a GPU of its own
        cls = ray.remote(num_cpus=0)(TltServer)
        server = cls.options(**options).remote(self.config, self.model_config, self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"ray://{server_name(self.replica_rank)}"  # no HTTP front: token-in, token-out

    def rollout_worker_use_gpu(self) -> bool:
        return torch.cuda.is_available()


class TltServerAdapter(BaseRollout):
    """verl's rollout object inside a training worker: forwards weights and memory calls to the server."""

    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.has_server = rank % world == 0
        self._server = None

    def _handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.has_server and ("kv_cache" in tags or "weights" in tags):
            await self._handle().wake_up.remote()

    async def release(self):
        if self.has_server:
            await self._handle().sleep.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(f"tlt_rt takes full named tensors, not {wire_format!r}")
        # every rank iterates (the generator may gather across ranks); the server's rank sends, on the CPU
        batch = [(name, t.detach().to("cpu", copy=True)) for name, t in weights]
        if self.has_server:
            return await self._handle().update_weights.remote(batch, global_steps=kwargs.get("global_steps"))
        return 0


def register() -> None:
    """Make `rollout.name=tlt_rt` select this backend (idempotent)."""
    RolloutReplicaRegistry.register(NAME, lambda: TltReplica)
    verl_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.TltServerAdapter"


register()

__all__ = ["TltReplica", "TltServer", "TltServerAdapter", "register", "server_name"]
