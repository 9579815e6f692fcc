"""Tensor parallelism for the target CausalLM (Megatron-style), over any torch.distributed group.

`shard_for_tp(model, group)` cuts a loaded model in place so that each rank keeps
    q/k/v_proj        column-parallel by heads: n_heads/world query heads and n_kv/world KV heads
    gate/up_proj      column-parallel: intermediate/world rows
    o_proj, down_proj row-parallel: partial sums, one all-reduce per attention and per MLP block, the bias
                      added once after it
    embed_tokens      vocab-parallel: a slice of ceil(V/world) rows (zero-padded at the end); ids outside it
                      embed to zeros and an all-reduce sums the slices
    lm_head           vocab-parallel: logits of that slice, all-gathered to [..., V] (tied weights stay tied)
Norms, rotary and the residual stream stay replicated, so both forwards run unchanged and `hidden` is the
full hidden state on every rank. `shard_drafter_for_tp` cuts an EAGLE drafter's decoder layer the same way
(its fc and head stay whole): each rank reads half its layer's weights a draft level for two sums.
Query head i of a rank reads local KV head i // (n_heads/n_kv), which is
the GQA mapping of the full model restricted to the rank's heads. `model.arch` carries the per-rank head
counts, so `make_cache` holds [L, blocks, bs, n_kv/world, D] and the engine sizes blocks per rank;
`model.tp.full_arch` keeps the original.

Collectives are autograd-aware (identity/all-reduce pairs), so the dense forward also trains; under
no_grad the all-reduce works in place, through NCCL or (`use_allreduce(model, "oneshot")`, CUDA only) a one-shot
all-reduce over symmetric memory for the small sums of decode steps. A fast sum that also has `row_parallel(x,
weight, slot)` takes a row-parallel layer's matmul and sum as one call first (`codegen.kernels.tp_sum.use_fused_sums`:
one Triton kernel summing over the ranks inside, for the o and down projections of decode steps).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.llama import CausalLM


@dataclass(frozen=True)
class TPInfo:
    group: Any  # a torch.distributed ProcessGroup (None: the default group)
    rank: int
    world: int
    full_arch: ArchConfig
    fast: Any = None  # a OneShotAllReduce for no-grad sums that fit it, else None (NCCL for every sum)


ALLREDUCE_KINDS = ("nccl", "oneshot")
ONESHOT_MAX_BYTES = 8 << 20  # a verify step of 32 x 32 tokens on a 3,584-wide model in bf16 is 7.3 MB


def symmetric_empty(group, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, Any]:
    """(buffer, handle): `numel` elements of symmetric memory on this rank, every rank's mapped for the others
    (`handle.buffer_ptrs`); collective over `group` (None: the default group). CUDA only."""
    # local: symmetric memory is CUDA-only and its module may be missing from CPU builds
    import torch.distributed._symmetric_memory as symm_mem

    name = (group if group is not None else dist.group.WORLD).group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed by older releases, a no-op later
    if enable is not None:
        enable(name)
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    return buffer, symm_mem.rendezvous(buffer, name)


class OneShotAllReduce:
    """Sum over the ranks of `group` through symmetric memory: each rank copies its tensor into a buffer every
    other rank of the node can read over NVLink, then one kernel on each rank reads all copies and adds them
    (no ring, no protocol: the latency of a decode step's few-KB sums is a copy and one kernel, where NCCL
    pays its launch and synchronisation each time). A step captured as a CUDA graph replays it as is.

    Only for tensors of the buffer's dtype that fit it (`max_bytes`); `__call__` returns False for others and
    the caller uses NCCL. Needs peer-to-peer access between the GPUs; multicast is not used.
    """

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = ONESHOT_MAX_BYTES):
        self.group_name = (group if group is not None else dist.group.WORLD).group_name
        self.dtype = dtype
        self.buffer, _ = symmetric_empty(group, max_bytes // dtype.itemsize, dtype, device)

    def __call__(self, x: torch.Tensor) -> bool:
        n = x.numel()
        if x.dtype != self.dtype or n > self.buffer.numel() or not x.is_contiguous():
            return False
        staged = self.buffer[:n]
        staged.copy_(x.view(-1))
        x.view(-1).copy_(torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name))
        return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The sum over the ranks of x [M, K] @ weight^T with the matmul writing straight into the symmetric buffer
        and the sum into a fresh tensor: no copy in or out (a row-parallel layer's partial sums; two copies a
        sum fewer than `__call__`); None where it does not fit (the caller goes the ordinary way)."""
        out_op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_out", None)
        m, n = x.shape[0], weight.shape[0]
        if (
            out_op is None
            or x.dim() != 2
            or x.dtype != self.dtype
            or weight.dtype != self.dtype
            or m * n > self.buffer.numel()
        ):
            return None
        staged = self.buffer[: m * n].view(m, n)
        torch.mm(x, weight.t(), out=staged)
        out = torch.empty_like(staged)
        out_op(staged, "sum", self.group_name, out)
        return out


# ------------------------------------------------------------------------------------------ collectives
class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum over ranks. Backward: identity (the incoming gradient is already replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """Forward: identity on a replicated input. Backward: sum the ranks' partial input gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's [..., s] slice into [..., world * s]. Backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        ctx.rank, ctx.size = rank, x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.size, ctx.size).contiguous(), None, None, None


def reduce_from_tp(x: torch.Tensor, group, fast: OneShotAllReduce | None = None) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromTP.apply(x, group)
    if fast is None or not fast(x):
        dist.all_reduce(x, group=group)
    return x


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _CopyToTP.apply(x, group)
    return x


# ------------------------------------------------------------------------------------------- layers
def _param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=requires_grad)


def _take_slice(state_dict: dict, key: str, full_shape: tuple[int, ...], cut) -> None:
    """Replace `state_dict[key]` by this rank's slice of it (`cut`) where it has the unsharded layer's
    `full_shape`, so that loading that layer's state (a trained drafter pushed to a sharded serving copy) fills
    the shard; a shard-shaped entry stays as it is, and any other shape is left for the load to reject."""
    t = state_dict.get(key)
    if t is not None and tuple(t.shape) == full_shape:
        state_dict[key] = cut(t)


class ColumnParallelLinear(nn.Module):
    """Rows [start, end) of a Linear: replicated input -> this rank's slice of the output features. In inference its
    forward is F.linear of the input, so the engine fuses the q/k/v and the gate/up slices of a rank into one
    matmul each (`glue.FusedLinears`; fusable), as it does on one GPU."""

    fusable = True

    def __init__(self, full: nn.Linear, start: int, end: int, tp: TPInfo):
        super().__init__()
        rg = full.weight.requires_grad
        self.weight = _param(full.weight[start:end], rg)
        self.bias = None if full.bias is None else _param(full.bias[start:end], rg)
        self.tp = tp
        self.start, self.end = start, end
        self.full_shape = tuple(full.weight.shape)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        rows = lambda t: t[self.start : self.end]  # noqa: E731
        _take_slice(state_dict, prefix + "weight", self.full_shape, rows)
        if self.bias is not None:
            _take_slice(state_dict, prefix + "bias", self.full_shape[:1], rows)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input columns [start, end) of a Linear: sharded input -> full output after one all-reduce; the bias
    (replicated) is added after the sum so it counts once. `slot`: which of the fused sum's two slots this layer's
    sums use (0 attention's, 1 the MLP's: consecutive sums alternate, as `kernels.tp_sum` needs)."""

    def __init__(self, full: nn.Linear, start: int, end: int, tp: TPInfo, slot: int = 0):
        super().__init__()
        rg = full.weight.requires_grad
        self.weight = _param(full.weight[:, start:end], rg)
        self.bias = None if full.bias is None else _param(full.bias, rg)
        self.tp = tp
        self.slot = slot
        self.start, self.end = start, end
        self.full_shape = tuple(full.weight.shape)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _take_slice(state_dict, prefix + "weight", self.full_shape, lambda t: t[:, self.start : self.end])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = None
        if self.tp.fast is not None and not torch.is_grad_enabled() and x.dim() == 2:
            fused = getattr(self.tp.fast, "row_parallel", None)  # matmul and sum in one kernel
            y = fused(x, self.weight, self.slot) if fused is not None else None
            direct = getattr(self.tp.fast, "linear", None)  # the one-shot sum: the matmul writes into its buffer
            if y is None and direct is not None:
                y = direct(x, self.weight)
        if y is None:
            y = reduce_from_tp(F.linear(x, self.weight), self.tp.group, self.tp.fast)
        return y if self.bias is None else y + self.bias


def vocab_shard(weight: torch.Tensor, tp: TPInfo) -> tuple[nn.Parameter, int]:
    """This rank's rows of a [V, H] vocab matrix, zero-padded to ceil(V/world) rows; returns (param, start)."""
    v = weight.shape[0]
    size = -(-v // tp.world)
    start = tp.rank * size
    rows = weight.detach()[start : min(start + size, v)]
    shard = weight.new_zeros(size, weight.shape[1])
    shard[: rows.shape[0]] = rows
    return nn.Parameter(shard, requires_grad=weight.requires_grad), start


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, tp: TPInfo):
        super().__init__()
        self.weight, self.start = vocab_shard(full.weight, tp)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(x, self.tp.group, self.tp.fast)


class VocabParallelLMHead(nn.Module):
    """x [..., H] -> full logits [..., V]: this rank's slice of the vocabulary, all-gathered."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: TPInfo):
        super().__init__()
        self.weight = weight  # [ceil(V/world), H]; the embedding's own parameter when tied
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(copy_to_tp(x, self.tp.group), self.weight)
        full = _GatherLastDim.apply(local, self.tp.group, self.tp.rank, self.tp.world)
        return full[..., : self.vocab_size]


# ------------------------------------------------------------------------------------------ sharding
def check_tp_divisible(arch: ArchConfig, world: int) -> None:
    """Raise ValueError naming the field that `world` ranks cannot split evenly."""
    if world < 1:
        raise ValueError(f"tensor-parallel world size must be >= 1, got {world}")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(arch, name)
        if n % world:
            raise ValueError(f"tensor parallelism over {world} ranks needs arch.{name} divisible by {world}, got {n}")


def shard_for_tp(model: CausalLM, group=None, rank: int | None = None, world: int | None = None) -> CausalLM:
    """Cut `model` in place into this rank's tensor-parallel shard and return it.

    Every rank must call this on an identical model (same weights), with the same group. rank/world default
    to this process's place in `group`. world == 1 returns the model unchanged.
    """
    tp = _tp_info(model, "model", group, rank, world)
    if tp is None:
        return model
    a = tp.full_arch
    for layer in model.model.layers:
        _shard_layer(layer, tp)
    hq, hkv = a.num_attention_heads // tp.world, a.num_key_value_heads // tp.world
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    emb = VocabParallelEmbedding(model.model.embed_tokens, tp)
    head = emb.weight if tied else vocab_shard(model.lm_head.weight, tp)[0]
    model.model.embed_tokens = emb
    model.lm_head = VocabParallelLMHead(head, a.vocab_size, tp)
    model.arch = replace(a, num_attention_heads=hq, num_key_value_heads=hkv)
    model.tp = tp
    return model


def _tp_info(module: nn.Module, what: str, group, rank: int | None, world: int | None, fast=None) -> TPInfo | None:
    """The TPInfo `module` (with its `arch`) is cut by, this process's place in `group` where rank / world are None;
    None for a world of one. Raises ValueError for a module already cut, a rank outside the world, or heads and
    MLP rows the world does not divide."""
    world = dist.get_world_size(group) if world is None else world
    rank = dist.get_rank(group) if rank is None else rank
    if getattr(module, "tp", None) is not None:
        raise ValueError(f"{what} is already sharded for tensor parallelism")
    check_tp_divisible(module.arch, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return None if world == 1 else TPInfo(group, rank, world, module.arch, fast)


def _shard_layer(layer: nn.Module, tp: TPInfo) -> None:
    """Cut one decoder layer in place into rank `tp.rank`'s shard (heads, MLP rows and o / down columns)."""
    a, rank, world = tp.full_arch, tp.rank, tp.world
    hq, hkv, inter = a.num_attention_heads // world, a.num_key_value_heads // world, a.intermediate_size // world
    d = a.head_dim
    at = layer.self_attn
    at.q_proj = ColumnParallelLinear(at.q_proj, rank * hq * d, (rank + 1) * hq * d, tp)
    at.k_proj = ColumnParallelLinear(at.k_proj, rank * hkv * d, (rank + 1) * hkv * d, tp)
    at.v_proj = ColumnParallelLinear(at.v_proj, rank * hkv * d, (rank + 1) * hkv * d, tp)
    at.o_proj = RowParallelLinear(at.o_proj, rank * hq * d, (rank + 1) * hq * d, tp, slot=0)
    at.n_heads, at.n_kv = hq, hkv
    mlp = layer.mlp
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, rank * inter, (rank + 1) * inter, tp)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, rank * inter, (rank + 1) * inter, tp)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, rank * inter, (rank + 1) * inter, tp, slot=1)


DRAFTER_TP_KINDS = ("auto", "shard", "replicate")
# "auto" shards a drafter whose decoder layer holds at least this many bytes: each draft level then reads half of
# them on a rank of TP=2 and pays two small sums. Measured on 2x H200 (`tp_throughput.py --drafter-tp shard
# replicate`, 8_4_32, batch 1): Qwen2.5-7B's layer (466 MB in bf16) sharded made the SD step 5.65 ms against 5.88
# whole; Qwen2.5-Coder-1.5B's (94 MB) 3.91 against 3.69 (one-shot sums; NCCL 4.06 against 3.94).
SHARD_DRAFTER_MIN_BYTES = 128 << 20


def drafter_layer_bytes(drafter: nn.Module) -> int:
    """Bytes of the drafter's decoder layer(s): what each draft level reads besides fc and the head."""
    return sum(p.numel() * p.element_size() for p in drafter.layers.parameters())


def shard_drafter_for_tp(drafter: nn.Module, group=None, rank: int | None = None, world: int | None = None,
                         fast=None) -> nn.Module:  # fmt: skip
    """Cut an EAGLE drafter's decoder layer in place into this rank's tensor-parallel shard, as `shard_for_tp`
    cuts the target's layers; fc (its input is the replicated token embedding and feature), the fused-feature
    Linear and the head stay whole, and the residual stream stays replicated, so every rank drafts the same tree.
    Its KV cache then holds this rank's KV heads (`drafter.arch`). `fast`: the sums' fast all-reduce (the target
    shard's `tp.fast`). A full drafter state loads into the shard (each parallel Linear takes its slice), so a
    trained replica is pushed to it as to an unsharded copy. Collective in effect: every rank shards alike."""
    tp = _tp_info(drafter, "drafter", group, rank, world, fast)
    if tp is None:
        return drafter
    a = tp.full_arch
    for layer in drafter.layers:
        _shard_layer(layer, tp)
    drafter.arch = replace(a, num_attention_heads=a.num_attention_heads // tp.world,
                           num_key_value_heads=a.num_key_value_heads // tp.world)  # fmt: skip
    drafter.tp = tp
    return drafter


def replicated_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` without the column- and row-parallel Linears' entries: what every rank of a TP group
    holds alike (for a drafter sharded by `shard_drafter_for_tp`, fc, norms and the head's buffers)."""
    kinds = (ColumnParallelLinear, RowParallelLinear)
    parallel = [name + "." for name, m in module.named_modules() if isinstance(m, kinds)]
    return {k: v for k, v in module.state_dict().items() if not any(k.startswith(p) for p in parallel)}


def use_allreduce(model: CausalLM, kind: str) -> CausalLM:
    """Make every sum of the tensor-parallel shard `model` go through `kind` ("nccl" or "oneshot": the one-shot
    sum over symmetric memory for what fits it, NCCL for the rest); capture steps after this call.
    Collective for "oneshot" (every rank of the group calls it, once per model)."""
    if kind not in ALLREDUCE_KINDS:
        raise ValueError(f"all-reduce must be one of {ALLREDUCE_KINDS}, got {kind!r}")
    tp = getattr(model, "tp", None)
    if tp is None:
        raise ValueError("use_allreduce needs a tensor-parallel shard (shard_for_tp)")
    w = model.lm_head.weight
    if kind == "oneshot" and w.device.type != "cuda":
        raise ValueError(f"the one-shot all-reduce needs CUDA devices; this shard is on {w.device.type}")
    fast = None
    if kind == "oneshot":
        fast = getattr(model, "_oneshot", None) or OneShotAllReduce(tp.group, w.device, w.dtype)
        model._oneshot = fast  # one buffer per model, kept across switches
    return set_fast_allreduce(model, fast)


def set_fast_allreduce(model: CausalLM, fast) -> CausalLM:
    """Route the shard's no-grad sums through `fast` (a callable taking the tensor to sum in place and returning
    whether it did; None: NCCL alone), in every module that holds the shard's `TPInfo`."""
    new = replace(model.tp, fast=fast)
    for m in model.modules():
        if isinstance(getattr(m, "tp", None), TPInfo):
            m.tp = new
    return model
