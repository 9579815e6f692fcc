"""What the paged attention kernels share on the host: the split-K heuristics, the in-launch merge's arrival
counters, the input checks, and how a kernel's dot runs (interpreted or compiled). The kernels themselves are
in decode_attention.py (and the Triton pieces the others reuse), tree_attention.py, prefill_attention.py and
decode_rope_attention.py."""

from __future__ import annotations

import functools

import torch
import triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_CHUNK = 256  # fewest context positions per split: below this the combine step costs more than it saves
MAX_SPLITS = 64
MERGE_TILE = 1 << 14  # fp32 partials one merge step holds in registers: rows x splits x head_dim


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(work_items: int, max_ctx: int, sm_count: int, waves: int = 2, min_chunk: int = MIN_CHUNK) -> int:
    """Splits per (sequence, KV head[, query block]) so that about `waves` waves of programs fill the GPU.

    `work_items` is the number of programs without split-K, `max_ctx` the longest context the block table
    can hold; each split keeps at least `min_chunk` positions of it. Host ints only: stable under capture.
    """
    target = waves * sm_count
    if work_items >= target:
        return 1
    want = triton.cdiv(target, work_items)
    return max(1, min(want, max_ctx // min_chunk, MAX_SPLITS))


def clamp_splits(num_splits: int, max_ctx: int, block_n: int) -> int:
    """At most one split per tile of the longest context the block table holds, at least one."""
    return max(1, min(num_splits, triton.cdiv(max(max_ctx, 1), block_n)))


def merge_block_s(rows: int, num_splits: int, head_dim: int, tile: int | None = None) -> int:
    """Splits one merge step reads at a time: rows x splits x head_dim fp32 within `tile` (None: MERGE_TILE),
    at least 2."""
    return max(2, min(triton.next_power_of_2(num_splits), (tile or MERGE_TILE) // (rows * head_dim)))


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least `n` arrival counters on `device` for the in-launch split merge.

    Kernels leave it zeroed, so it is shared by every launch on the device; launches on one device must not
    run concurrently on two streams. None while a CUDA graph is being captured and no large enough buffer
    exists yet (an allocation there would record its zero-fill in the graph without running it): the caller
    then merges in a separate kernel. Earlier, smaller buffers are kept: captured graphs hold their address.
    """
    bufs = _COUNTERS.setdefault(device, [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    bufs.append(torch.zeros(max(n, 1 << 12), dtype=torch.int32, device=device))
    return bufs[-1]


def check_paged_inputs(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:  # fmt: skip
    """Shape/dtype/device checks shared by the paged attention launchers (no device sync)."""
    if q.device.type != "cuda" and compiled_for_gpu(kernel):
        raise RuntimeError(f"Triton attention on {q.device} needs TRITON_INTERPRET=1 set before importing it")
    assert q.dim() == 3, f"q must be [N, Hq, D], got {tuple(q.shape)}"
    assert k_cache.dim() == 4, f"k_cache must be [num_blocks, page, Hkv, D], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    n_heads, head_dim = q.shape[1:]
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"head_dim: q has {head_dim}, cache has {k_cache.shape[3]}"
    assert n_heads % n_kv == 0, f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv}"
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim must be a power of 2 in 16..256, got {head_dim}"
    assert page & (page - 1) == 0, f"block_size must be a power of 2, got {page}"
    assert q.dtype in SUPPORTED_DTYPES, f"dtype {q.dtype} not in {SUPPORTED_DTYPES}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, (
        f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
    )
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, (
        f"block_tables must be [B, max_blocks] int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
    )
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    b = block_tables.shape[0]
    assert seq_lens.shape == (b,) and seq_lens.dtype == torch.int32, (
        f"seq_lens must be [B={b}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
    )
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        assert t.device == q.device, f"{name} is on {t.device}, q on {q.device}"


def compiled_for_gpu(kernel) -> bool:
    """False when `kernel` was decorated under TRITON_INTERPRET=1 (then it runs on CPU tensors)."""
    return isinstance(kernel, triton.runtime.JITFunction)


def dot_in_fp32(kernel, dtype: torch.dtype) -> bool:
    """True only for bf16 under Triton's interpreter, whose tl.dot multiplies bf16 bit patterns as integers
    (numpy has no bf16): there the operands are widened to fp32 (bf16 -> fp32 is exact). Compiled kernels
    always use the bf16 tensor-core dot."""
    return dtype == torch.bfloat16 and not compiled_for_gpu(kernel)


def dot_precision(dtype: torch.dtype, fp32_dot: bool = False) -> str:
    # fp32 operands keep full precision (no tf32) so they match the fp32 reference closely
    return "ieee" if dtype == torch.float32 or fp32_dot else "tf32"
