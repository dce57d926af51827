"""Launchers of prefill attention over paged KV: the tiled kernel and the gather+SDPA path."""

from __future__ import annotations

import os

import numpy as np
import torch

from loraplex.kernels.instances import prefill_name
from loraplex.kernels.launch_args import attention_variant, ceil_div, check_paged, int32_on, same_dtype
from loraplex.kernels.prefill_sdpa import paged_attention_prefill_sdpa, paged_attention_prefill_varlen
from loraplex.kernels.runners import runner_for

THREADS = 128  # 32 * PrefillTile::WARPS in the .cu
IMPLS = ("sdpa", "kernel", "varlen")
# Default path on CUDA; "sdpa" until benchmarks/gpu_kernels.py measures otherwise (varlen: torch's Flash Attention
# over the paged cache, one call for the whole step, not yet run on a GPU here).
DEFAULT_IMPL = os.environ.get("LORAPLEX_PREFILL_ATTENTION", "sdpa")


def queries_per_block(head_dim: int) -> int:
    """New tokens per block of the tiled kernel (PrefillTile::BQ)."""
    return 16 if head_dim <= 128 else 8


def paged_attention_prefill(
    q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window=None, softcap=None, *, impl=None,
    runner=None
):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix (with a window, each to the
    last window positions up to its own). varlen serves neither window nor softcap yet: such calls take sdpa."""
    impl = impl or DEFAULT_IMPL
    args = (q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale)
    if impl == "varlen" and window is None and softcap is None:
        return paged_attention_prefill_varlen(*args)
    if impl in ("sdpa", "varlen"):
        return paged_attention_prefill_sdpa(*args, window, softcap)
    if impl != "kernel":
        raise ValueError(f"unknown prefill attention impl {impl!r} (one of {IMPLS})")
    return paged_attention_prefill_kernel(*args, window, softcap, runner=runner)


def paged_attention_prefill_kernel(
    q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window=None, softcap=None, *, runner=None
):
    """The tiled CUDA kernel path of paged_attention_prefill."""
    window, softcap = attention_variant(window, softcap)
    dtype = same_dtype(q, k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = cu_query_lens.numel() - 1
    q = q.contiguous()  # before empty_like: out must be dense like the kernel writes it
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    check_paged("prefill", q, k_cache, v_cache)
    bq = queries_per_block(head_dim)
    tiles = ceil_div(num_tokens + num_seqs * (bq - 1), bq)  # >= sum over sequences of their tiles
    args = [out, q, k_cache, v_cache, int32_on(block_tables, q.device), int32_on(cu_query_lens, q.device)]
    args += [int32_on(context_lens, q.device), np.int32(num_seqs), np.int32(num_q_heads), np.int32(num_kv_heads)]
    args += [np.int32(block_size), np.int32(max(block_tables.shape[1], 1)), np.float32(scale), np.int32(window)]
    args += [np.float32(softcap)]
    name = prefill_name(dtype, head_dim)
    (runner or runner_for(q)).launch("prefill", name, (tiles, num_q_heads, 1), (THREADS, 1, 1), args)
    return out
