"""verl 0.9.1 on the CPU, for its trainer's end-to-end test (test_verl_grpo.py): a verl platform named "cpu".

verl knows CUDA, NPU and ROCm only, and without an accelerator falls back to CUDA (NCCL, `cuda:0`). Loaded
through VERL_USE_EXTERNAL_MODULES with VERL_PLATFORM=cpu, this module registers a platform whose device is
"cpu" and whose collectives are gloo, routes the training engine lookup to verl's FSDP engine
(VERL_ENGINE_DEVICE=cuda: verl registers it for cuda/npu only; it runs on the CPU with strategy=fsdp2), and
starts verl's process group on gloo alone. Ray still schedules "GPU" bundles: the test starts Ray with
logical GPUs (`+ray_kwargs.ray_init.num_gpus=1`). Imports our backend too, as the plugin list's one entry.
"""

from __future__ import annotations

import contextlib
import types

import torch
import verl.utils.distributed as verl_distributed
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry

import tlt_rt.integrations.verl  # noqa: F401  (registers rollout.name=tlt_rt)


def _none(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


class _Properties:
    name = "cpu"
    total_memory = 16 << 30


# what verl calls on its "device module" (torch.cuda on CUDA), answered for the CPU
device_module = types.ModuleType("tlt_rt_verl_cpu_device")
for _name in ("current_device", "device_count", "synchronize", "is_available", "Stream", "Event", "stream",
              "current_stream"):  # fmt: skip
    setattr(device_module, _name, getattr(torch.cpu, _name))
for _name in ("set_device", "empty_cache", "manual_seed", "manual_seed_all", "reset_peak_memory_stats"):
    setattr(device_module, _name, _none)
for _name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
    setattr(device_module, _name, _zero)
device_module.is_initialized = lambda: True
device_module.mem_get_info = lambda *a, **k: (8 << 30, 16 << 30)
device_module.get_device_properties = lambda *a, **k: _Properties()
device_module.get_device_name = lambda *a, **k: "cpu"
device_module.memory = types.SimpleNamespace(_set_allocator_settings=_none)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # chosen by VERL_PLATFORM=cpu only

    def current_device(self):
        return "cpu"  # verl passes it where torch takes a device: .to(), device_id=

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def is_ipc_supported(self) -> bool:
        return False

    def get_collective_module(self):
        return None


_init_process_group = verl_distributed.initialize_global_process_group_ray


def _init_gloo(timeout_second=None, backend=None):
    # verl asks for "cpu:gloo,<device>:<backend>", which is "cpu:gloo,cpu:gloo" here: torch refuses the repeat
    return _init_process_group(timeout_second, backend or "gloo")


verl_distributed.initialize_global_process_group_ray = _init_gloo
