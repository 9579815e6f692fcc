"""The learner sharded with FSDP2, and the handoff of its weights to rollout engines.

`shard_learner` applies `fully_shard` to each decoder layer and then to the root: every rank keeps 1/world
of each parameter (a DTensor, Shard(0)) and AdamW built on `model.parameters()` keeps its moments sharded
the same way. Gradients are reduce-scattered as a SUM (divide factor 1), which matches `grpo.policy_loss`
with global `num_tokens`/`num_seqs`: each rank's loss is its share of the global sum.

The engine keeps its own dense copy of the model (its CUDA graphs captured those weight pointers), so after
each optimizer step the full weights are gathered (`full_state_for_engine`) and copied into it in place
(`load_into_engine`). `reshard_for_tp` cuts a full state into one tensor-parallel rank's slice.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM


def _as_mesh(mesh_or_group: DeviceMesh | dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    if isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    if mesh_or_group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(mesh_or_group, device_type)


def shard_learner(
    model: CausalLM,
    mesh_or_group: DeviceMesh | dist.ProcessGroup | None = None,
    mixed_precision: bool = False,
) -> CausalLM:
    """Shard `model` in place over a 1-D mesh (None: the default group) and return it.

    The model must be identical on every rank (same seed or checkpoint); its parameters are cast to fp32,
    which are the master weights. With `mixed_precision`, forward/backward run in bf16 (parameters
    all-gathered in bf16) and gradients are reduced in fp32 into the fp32 shards (this also runs on CPU with
    gloo: gradients within ~1e-2 relative of fp32). Without it, everything is fp32.
    Build the optimizer after this call, on `model.parameters()`.
    """
    if not dist.is_initialized():
        raise RuntimeError("shard_learner needs torch.distributed initialised (init_process_group)")
    device = next(model.parameters()).device
    mesh = _as_mesh(mesh_or_group, device.type)
    model.float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)  # embeddings, final norm, lm_head (tied or not) form the root's group
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean, over ranks
            if mesh.device_type == "cpu":
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; plain SUM is exact here
    return model


def iter_full_state(sharded_model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) per state entry, gathered one at a time: peak extra memory is one tensor.

    Every rank must iterate to the end (each DTensor gather is a collective).
    """
    for name, t in sharded_model.state_dict().items():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        t = t.detach()
        yield name, t if dtype is None else t.to(dtype)


def full_state_for_engine(sharded_model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The full (unsharded) weights by HF name, cast to `dtype` (the engine's). Collective over the mesh."""
    return dict(iter_full_state(sharded_model, dtype))


@torch.no_grad()
def load_into_engine(engine_model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy `state` into `engine_model`'s existing tensors in place (their storage, so data_ptr, is kept).

    Keys must match the engine's state dict exactly; dtype/device are converted by the copy.
    """
    targets = engine_model.state_dict(keep_vars=True)
    missing, unexpected = targets.keys() - state.keys(), state.keys() - targets.keys()
    if missing or unexpected:
        raise KeyError(f"state does not match the engine: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, src in state.items():
        dst = targets[name]
        if dst.shape != src.shape:
            raise ValueError(f"{name}: engine shape {tuple(dst.shape)} != state shape {tuple(src.shape)}")
        dst.copy_(src)


@torch.no_grad()
def push_to_engine(sharded_model: nn.Module, engine_model: nn.Module) -> None:
    """Gather the learner's weights one tensor at a time straight into the engine (no full state dict)."""
    targets = engine_model.state_dict(keep_vars=True)
    names = sharded_model.state_dict().keys()
    if names != targets.keys():
        raise KeyError(f"learner and engine state differ: {sorted(names ^ targets.keys())}")
    for name, full in iter_full_state(sharded_model):
        targets[name].copy_(full)


# ------------------------------------------------------------------------------------ tensor parallel
# (name suffix, dim to split or None to replicate). Column-parallel q/k/v/gate/up split their output rows
# (heads, intermediate); row-parallel o/down split their input columns and keep their bias whole (added
# once after the all-reduce); embedding and LM head split the vocab rows.
_TP_RULES: tuple[tuple[str, int | None], ...] = (
    ("self_attn.q_proj.weight", 0),
    ("self_attn.q_proj.bias", 0),
    ("self_attn.k_proj.weight", 0),
    ("self_attn.k_proj.bias", 0),
    ("self_attn.v_proj.weight", 0),
    ("self_attn.v_proj.bias", 0),
    ("self_attn.o_proj.weight", 1),
    ("self_attn.o_proj.bias", None),
    ("mlp.gate_proj.weight", 0),
    ("mlp.gate_proj.bias", 0),
    ("mlp.up_proj.weight", 0),
    ("mlp.up_proj.bias", 0),
    ("mlp.down_proj.weight", 1),
    ("mlp.down_proj.bias", None),
    ("embed_tokens.weight", 0),
    ("lm_head.weight", 0),
    ("layernorm.weight", None),  # input_layernorm, post_attention_layernorm
    ("model.norm.weight", None),
)


def tp_split_dim(name: str) -> int | None:
    """The dim `name` is split along under tensor parallelism, or None when it is replicated."""
    for suffix, dim in _TP_RULES:
        if name.endswith(suffix):
            return dim
    raise KeyError(f"{name}: no tensor-parallel rule for this parameter")


def reshard_for_tp(
    state: dict[str, Tensor], rank: int, world: int, arch: ArchConfig | None = None
) -> dict[str, Tensor]:
    """Rank `rank`'s slice (of `world`) of a full state dict; pure, the input is not modified.

    Split tensors are cut into `world` equal contiguous chunks along their rule's dim, so rank r gets heads
    [r*H/world, (r+1)*H/world) of q, the matching KV heads of k/v, and the matching columns of o. With
    `arch`, head and vocab counts are checked to divide by `world` (without it, only the tensor dims are,
    which can silently split a head). Replicated tensors are returned as is (shared, not copied).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a tensor-parallel world of {world}")
    if arch is not None:
        counts = {
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads,
            "intermediate_size": arch.intermediate_size,
            "vocab_size": arch.vocab_size,
        }
        for field_name, n in counts.items():
            if n % world:
                raise ValueError(f"arch.{field_name}={n} is not divisible by the tensor-parallel world {world}")
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        dim = tp_split_dim(name)
        if dim is None:
            out[name] = t
            continue
        size = t.shape[dim]
        if size % world:
            raise ValueError(f"{name}: dim {dim} of size {size} is not divisible by the tensor-parallel world {world}")
        chunk = size // world
        out[name] = t.narrow(dim, rank * chunk, chunk).contiguous()
    return out
