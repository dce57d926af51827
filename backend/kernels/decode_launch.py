"""Launcher of paged-attention decode (paged_attention_decode.cu), split-context included."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels.instances import decode_name, decode_reduce_name
from loraplex.kernels.launch_args import aligned, attention_variant, ceil_div, check_paged, int32_on, same_dtype
from loraplex.kernels.runners import runner_for

THREADS = 128  # decode::kThreads in the .cu
MIN_SPLIT_TOKENS = 256  # a split shorter than this is not worth its merge
WAVES = 4  # aim for this many blocks per multiprocessor before splitting stops


def queries_per_block(group: int) -> int:
    """Query heads a block serves: the group size rounded up to a power of two, at most 8."""
    qpb = 1
    while qpb < min(group, 8):
        qpb *= 2
    return qpb


def choose_splits(blocks: int, max_context: int, sm_count: int) -> int:
    """Context splits so that blocks * splits fills the device, each split >= MIN_SPLIT_TOKENS."""
    useful = ceil_div(max_context, MIN_SPLIT_TOKENS)
    if useful <= 1:
        return 1
    return max(1, min(useful, ceil_div(WAVES * sm_count, max(blocks, 1))))


def split_plan(max_context: int, block_size: int, splits: int) -> tuple[int, int]:
    """(tokens per split, number of splits): whole cache blocks per split, no empty split."""
    if splits <= 1 or max_context <= 0:
        return max(max_context, 1), 1
    per = ceil_div(ceil_div(max_context, splits), block_size) * block_size
    return per, ceil_div(max_context, per)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None, *,
                           num_splits=None, runner=None):
    """One query per sequence [B, Hq, D] over its cached context (with a window, its last window positions)
    -> [B, Hq, D]."""
    window, softcap = attention_variant(window, softcap)
    dtype = same_dtype(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q = q.contiguous()  # before empty_like: out must be dense like the kernel writes it
    out = torch.empty_like(q)
    if batch == 0:
        return out
    check_paged("decode", q, k_cache, v_cache)
    if not aligned(q, k_cache, v_cache):
        raise ValueError("q, k_cache and v_cache must be 16-byte aligned")
    runner = runner or runner_for(q)
    group = num_q_heads // num_kv_heads
    qpb = queries_per_block(group)
    blocks = num_kv_heads * ceil_div(group, qpb)
    max_blocks = block_tables.shape[1]
    max_context = max_blocks * block_size
    if num_splits is None:
        num_splits = choose_splits(blocks * batch, max_context, runner.sm_count(q.device))
    split_tokens, num_splits = split_plan(max_context, block_size, num_splits)
    if num_splits > 1:
        partial_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_ml = torch.empty(batch, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        partial_acc = partial_ml = out  # not touched with one split
    tables = int32_on(block_tables, q.device)
    args = [out, partial_acc, partial_ml, q, k_cache, v_cache, tables, int32_on(context_lens, q.device)]
    args += [np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(block_size), np.int32(max(max_blocks, 1))]
    args += [np.int32(split_tokens), np.int32(num_splits), np.float32(scale), np.int32(window), np.float32(softcap)]
    grid = (blocks, batch, num_splits)
    runner.launch("decode", decode_name(dtype, head_dim, qpb), grid, (THREADS, 1, 1), args)
    if num_splits > 1:
        args = [out, partial_acc, partial_ml, np.int32(num_q_heads), np.int32(num_splits)]
        runner.launch("decode", decode_reduce_name(dtype, head_dim), (num_q_heads, batch, 1), (head_dim, 1, 1), args)
    return out

