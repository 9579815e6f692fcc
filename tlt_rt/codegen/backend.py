"""Attention backends behind `tlt_rt.models.attention.AttentionBackend`, and the choice between them.

TritonAttention runs the paged Triton kernels:
    "decode" -> kernels.decode_attention.paged_decode_attention (split-K, GQA-shared K/V reads)
    "verify" -> kernels.tree_attention.paged_tree_attention (T tree tokens x group heads per tile; a drafter
                level's wider tree window W > T too)
    "prefill" -> kernels.prefill_attention.paged_prefill_attention (packed chunks, causal, flash-style);
                 prefill and the drafter's catch-up run it eagerly, outside CUDA graphs. With
                 `prefill_kernel=False` the plain-torch reference instead (sequences padded into groups,
                 upcast to fp32, one SDPA per group), which a switch into speculation at batch ~120 paid
                 tens of milliseconds for.
The attention kernel modules are imported on first use. Whether "auto" takes the Triton kernels is the codegen
table's rule (`codegen.table.runs_triton`: on CUDA), the same one every other kernel of a step follows.
"""

from __future__ import annotations

import os

import torch

from tlt_rt.codegen.table import runs_triton
from tlt_rt.models.attention import AttentionBackend, AttnMetadata, TorchAttention, paged_attention_reference

__all__ = ["TritonAttention", "select_backend", "triton_usable"]


def triton_usable(device: torch.device | str) -> bool:
    """True where the Triton kernels can run: a CUDA device, or any device under TRITON_INTERPRET=1."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.device(device).type == "cuda" or interpreting


class TritonAttention:
    """Paged attention through Triton kernels for decode, verify and prefill.

    num_splits: split-K partitions of the context (None: chosen per call from the shapes, see
    `kernels.paged.choose_num_splits`; depends on host ints only, so CUDA-graph safe).
    prefill_kernel: False runs prefill through the torch reference (`benchmarks/eager_profile.py` times both).
    fuse_rope: decode steps rotate q and k and write the new K/V inside the attention kernel
    (`kernels.decode_rope_attention`, through `rope_decode`) instead of the glue's rotary kernel before it; off by
    default until measured beside the two kernels (`benchmarks/step_costs.py --compare`).
    pdl: that fused decode kernel launched with programmatic dependent launch where the GPU has it (`kernels.pdl`).
    """

    name = "triton"

    def __init__(
        self, num_splits: int | None = None, prefill_kernel: bool = True, fuse_rope: bool = False, pdl: bool = False
    ) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        self.num_splits = num_splits
        self.prefill_kernel = prefill_kernel
        self.fuse_rope = fuse_rope
        self.pdl = pdl

    def rope_decode(self, q, k, v, positions, inv_freq, k_cache, v_cache, meta: AttnMetadata, scale: float):
        """A decode step's rotary, K/V write and attention in one kernel: q [B, Hq, D], k / v [B, Hkv, D] before
        rotary -> [B, Hq, D]; None where this backend leaves rotary to the glue (fuse_rope off, strided positions
        or slots, a head size under 32, caches not contiguous)."""
        if not (self.fuse_rope and meta.mode == "decode" and meta.slots_resolved and q.dim() == 3):
            return None
        slots = meta.slot_mapping
        if q.shape[-1] < 32 or not (positions.is_contiguous() and slots.is_contiguous()):
            return None
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        # local: Triton, as in __call__
        from tlt_rt.codegen.kernels.decode_rope_attention import decode_rope_attention

        return decode_rope_attention(q, k, v, positions, inv_freq, k_cache, v_cache, slots, meta.block_tables,
                                     meta.seq_lens, scale, num_splits=self.num_splits, pdl=self.pdl)  # fmt: skip

    def eager(self) -> TritonAttention:
        """This backend for eager calls, whose shapes change from call to call (the drafter's catch-up): one
        split-K partition unless one is set, so no call meets a kernel variant its warm-up did not compile. A
        split count chosen per call (from the batch and the block tables' width) specialises the decode kernel
        anew: its first use mid-rollout compiled for ~1.1 s inside one speculative step (H200)."""
        return TritonAttention(
            1 if self.num_splits is None else self.num_splits, self.prefill_kernel, self.fuse_rope, self.pdl
        )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float
    ) -> torch.Tensor:
        if meta.mode == "decode":
            # local: the kernels import Triton, which the torch backend (CPU, no Triton) must not need
            from tlt_rt.codegen.kernels.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=self.num_splits
            )
        if meta.mode == "verify":
            # local: Triton, as above
            from tlt_rt.codegen.kernels.tree_attention import paged_tree_attention

            if meta.tree_mask is None:
                raise ValueError("verify needs meta.tree_mask [B, T, W]")
            return paged_tree_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.tree_mask, scale,
                num_splits=self.num_splits,
            )  # fmt: skip
        if meta.mode == "prefill":
            if not self.prefill_kernel:
                return paged_attention_reference(q, k_cache, v_cache, meta, scale)
            # local: Triton, as above
            from tlt_rt.codegen.kernels.prefill_attention import paged_prefill_attention

            return paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.max_q_len, scale
            )
        raise ValueError(f"unknown attention mode {meta.mode!r}")


def select_backend(
    device: torch.device | str, name: str = "auto", fuse_rope: bool = False, pdl: bool = False
) -> AttentionBackend:
    """The attention backend for `device`.

    name: "auto" (Triton on CUDA, torch elsewhere: the interpreter is for testing kernels, not for running
    models), "triton" (raises ValueError where the kernels cannot run; on CPU under TRITON_INTERPRET=1) or
    "torch". fuse_rope, pdl: a Triton backend's (decode steps' rotary inside their attention kernel; that kernel
    launched with programmatic dependent launch).
    """
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device or TRITON_INTERPRET=1, got device {device}"
            )
        return TritonAttention(fuse_rope=fuse_rope, pdl=pdl)
    if name == "auto":
        return TritonAttention(fuse_rope=fuse_rope, pdl=pdl) if runs_triton(device) else TorchAttention()
    raise ValueError(f"unknown attention backend {name!r}: choose 'auto', 'triton' or 'torch'")
