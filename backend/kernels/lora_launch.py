"""Launchers of the LoRA shrink/expand kernels (lora.cu); same signatures as the reference."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels.instances import BGMV_TILES, lora_name
from loraplex.kernels.launch_args import ceil_div, float32_on, int32_on, same_dtype, vector_width
from loraplex.kernels.runners import runner_for

# Must match the constants in lora.cu (checked by tests).
SHRINK_WARPS = 4
EXPAND_THREADS = 128
BGMV_TILE = 4
SGMV_TILE = 16


def lora_shrink_bgmv(x, a_stack, token_slots, ranks, *, runner=None, tile=BGMV_TILE):
    """Per-row gather shrink: out[t, :rank] = x[t] @ A[slot[t], :rank].T; zeros elsewhere. tile: tokens per
    block, one of instances.BGMV_TILES."""
    return _shrink("shrink_bgmv", tile, x, a_stack, ranks, [int32_on(token_slots, x.device)], runner)


def lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks, *, runner=None):
    """Segmented shrink: like lora_shrink_bgmv with one adapter per contiguous segment."""
    segs = _segment_args(seg_starts, seg_slots, x.device)
    return _shrink("shrink_sgmv", SGMV_TILE, x, a_stack, ranks, segs, runner)


def lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales, *, runner=None, tile=BGMV_TILE):
    """Per-row gather expand, in place: y[t] += scale[slot] * v[t, :rank] @ B[slot, :, :rank].T. tile: tokens per
    block, one of instances.BGMV_TILES."""
    return _expand("expand_bgmv", tile, y, v, b_stack, ranks, scales, [int32_on(token_slots, y.device)], runner)


def lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales, *, runner=None):
    """Segmented expand, in place: y[seg] += scale * v[seg, :rank] @ B[slot, :, :rank].T."""
    segs = _segment_args(seg_starts, seg_slots, y.device)
    return _expand("expand_sgmv", SGMV_TILE, y, v, b_stack, ranks, scales, segs, runner)


def _bgmv_tile(kernel: str, tile: int) -> int | None:
    """The tile a BGMV kernel's name carries (None for SGMV); ValueError for one not instantiated."""
    if not kernel.endswith("bgmv"):
        return None
    if tile not in BGMV_TILES:
        raise ValueError(f"BGMV tile {tile} not instantiated (one of {BGMV_TILES})")
    return tile


def _segment_args(seg_starts, seg_slots, device):
    slots = int32_on(seg_slots, device)
    return [int32_on(seg_starts, device), slots, np.int32(slots.numel())]


def _shrink(kernel, tile, x, a_stack, ranks, slot_args, runner):
    dtype = same_dtype(x, a_stack)
    num_tokens, h_in = x.shape
    max_rank = a_stack.shape[1]
    out = torch.empty(num_tokens, max_rank, dtype=dtype, device=x.device)
    if num_tokens == 0 or max_rank == 0:
        return out
    x, a_stack = x.contiguous(), a_stack.contiguous()
    vec = vector_width(dtype, h_in, x, a_stack)
    grid = (ceil_div(num_tokens, tile), ceil_div(max_rank, SHRINK_WARPS), 1)
    args = [out, x, a_stack, int32_on(ranks, x.device), *slot_args]
    args += [np.int32(num_tokens), np.int32(h_in), np.int32(max_rank)]
    name = lora_name(kernel, dtype, vec, _bgmv_tile(kernel, tile))
    (runner or runner_for(x)).launch("lora", name, grid, (32 * SHRINK_WARPS, 1, 1), args)
    return out


def _expand(kernel, tile, y, v, b_stack, ranks, scales, slot_args, runner):
    dtype = same_dtype(y, b_stack)
    num_tokens, h_out = y.shape
    max_rank = b_stack.shape[2]
    if num_tokens == 0 or h_out == 0 or max_rank == 0:
        return y
    target = y if y.is_contiguous() else y.contiguous()
    v = v.to(dtype).contiguous()
    b_stack = b_stack.contiguous()
    vec = vector_width(dtype, max_rank, b_stack)
    grid = (ceil_div(num_tokens, tile), ceil_div(h_out, EXPAND_THREADS), 1)
    args = [target, v, b_stack, int32_on(ranks, y.device), float32_on(scales, y.device), *slot_args]
    args += [np.int32(num_tokens), np.int32(h_out), np.int32(max_rank), np.int32(v.shape[1])]
    name = lora_name(kernel, dtype, vec, _bgmv_tile(kernel, tile))
    (runner or runner_for(y)).launch("lora", name, grid, (EXPAND_THREADS, 1, 1), args)
    if target is not y:
        y.copy_(target)
    return y
