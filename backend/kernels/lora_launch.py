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
SPLIT_MIN_FEATURES = 1024  # input features per slice of the split-K shrink, at least
MAX_SPLITS = 16


def lora_shrink_bgmv(x, a_stack, token_slots, ranks, *, runner=None, tile=BGMV_TILE, splits=None):
    """Per-row gather shrink: out[t, :rank] = x[t] @ A[slot[t], :rank].T; zeros elsewhere. tile: tokens per
    block, one of instances.BGMV_TILES; splits: slices of h_in for the split-K kernel (None: choose_splits,
    1: never split)."""
    runner = runner or runner_for(x)
    if splits is None:
        splits = choose_splits(x.shape[0], a_stack.shape[1], x.shape[1], runner.sm_count(x.device))
    if splits > 1:
        return _shrink_split(x, a_stack, token_slots, ranks, splits, runner)
    return _shrink("shrink_bgmv", tile, x, a_stack, ranks, [int32_on(token_slots, x.device)], runner)


def choose_splits(num_tokens: int, max_rank: int, h_in: int, sm_count: int) -> int:
    """Slices of h_in for the split-K shrink: 1 (the tiled kernel) unless its grid would fill under half the
    SMs and h_in has at least two slices of SPLIT_MIN_FEATURES; then enough for about two blocks per SM."""
    blocks = ceil_div(num_tokens, BGMV_TILE) * ceil_div(max_rank, SHRINK_WARPS)
    most = h_in // SPLIT_MIN_FEATURES
    if num_tokens == 0 or 2 * blocks >= sm_count or most < 2:
        return 1
    return max(1, min(most, MAX_SPLITS, ceil_div(2 * sm_count, num_tokens * ceil_div(max_rank, SHRINK_WARPS))))


def lora_shrink_bgmv_group(x, a_stacks, token_slots, ranks, *, runner=None, tile=BGMV_TILE):
    """The shrinks of up to three modules that read x (q/k/v, gate/up) in one launch: out [T, G * R], module
    g's lora_shrink_bgmv in columns [g * R, (g + 1) * R). a_stacks, ranks: one per module, one max rank R."""
    dtype = same_dtype(x, *a_stacks)
    groups, max_rank = _group_size(a_stacks, 1), a_stacks[0].shape[1]
    num_tokens, h_in = x.shape
    out = torch.empty(num_tokens, groups * max_rank, dtype=dtype, device=x.device)
    if num_tokens == 0 or max_rank == 0:
        return out
    x, a_stacks = x.contiguous(), [a.contiguous() for a in a_stacks]
    vec = vector_width(dtype, h_in, x, *a_stacks)
    grid = (ceil_div(num_tokens, tile), groups * ceil_div(max_rank, SHRINK_WARPS), 1)
    args = [out, x, *_three(a_stacks), *_three([int32_on(r, x.device) for r in ranks]),
            int32_on(token_slots, x.device), np.int32(groups), np.int32(num_tokens), np.int32(h_in),
            np.int32(max_rank)]
    name = lora_name("shrink_bgmv_group", dtype, vec, _bgmv_tile("shrink_bgmv", tile))
    (runner or runner_for(x)).launch("lora", name, grid, (32 * SHRINK_WARPS, 1, 1), args)
    return out


def lora_expand_bgmv_group(v, ys, b_stacks, token_slots, ranks, scales, *, runner=None, tile=BGMV_TILE):
    """The expands of up to three modules in one launch, in place: ys[g] += scale_g * v[:, g*R : g*R + rank] @
    B_g[slot, :, :rank].T. ys may be column views of one fused output (any row stride, unit column stride)."""
    dtype = same_dtype(ys[0], *b_stacks)
    groups, max_rank = _group_size(b_stacks, 2), b_stacks[0].shape[2]
    num_tokens = v.shape[0]
    if num_tokens == 0 or max_rank == 0:
        return ys
    targets = [y if y.stride(1) == 1 and y.dtype == dtype else y.contiguous() for y in ys]
    v = v.to(dtype).contiguous()
    b_stacks = [b.contiguous() for b in b_stacks]
    vec = vector_width(dtype, max_rank, *b_stacks)
    h_outs = [y.shape[1] for y in targets]
    grid = (ceil_div(num_tokens, tile), sum(ceil_div(h, EXPAND_THREADS) for h in h_outs), 1)
    device = v.device
    args = [*_three(targets), v, *_three(b_stacks), *_three([int32_on(r, device) for r in ranks]),
            *_three([float32_on(s, device) for s in scales]), int32_on(token_slots, device), np.int32(groups),
            np.int32(num_tokens), *[np.int32(h) for h in h_outs + [0] * (3 - groups)],
            *[np.int64(y.stride(0)) for y in _three(targets)], np.int32(max_rank)]
    name = lora_name("expand_bgmv_group", dtype, vec, _bgmv_tile("expand_bgmv", tile))
    (runner or runner_for(v)).launch("lora", name, grid, (EXPAND_THREADS, 1, 1), args)
    for y, target in zip(ys, targets):
        if target is not y:
            y.copy_(target)
    return ys


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


def _group_size(stacks, rank_dim: int) -> int:
    """The number of modules of a fused group (1-3), all of one max rank; ValueError otherwise."""
    if not 1 <= len(stacks) <= 3:
        raise ValueError(f"a fused LoRA group has 1 to 3 modules, not {len(stacks)}")
    if len({s.shape[rank_dim] for s in stacks}) != 1:
        raise ValueError("a fused LoRA group's stacks must share one max rank")
    return len(stacks)


def _three(items: list) -> list:
    """items padded to three by repeating the last (the kernels read only the first `groups`)."""
    return list(items) + [items[-1]] * (3 - len(items))


def _shrink_split(x, a_stack, token_slots, ranks, splits, runner):
    dtype = same_dtype(x, a_stack)
    num_tokens, h_in = x.shape
    max_rank = a_stack.shape[1]
    if num_tokens == 0 or max_rank == 0:
        return torch.empty(num_tokens, max_rank, dtype=dtype, device=x.device)
    x, a_stack = x.contiguous(), a_stack.contiguous()
    vec = vector_width(dtype, h_in, x, a_stack)
    chunk = ceil_div(ceil_div(h_in, splits), 32 * vec) * 32 * vec  # whole passes of a warp's loads
    splits = ceil_div(h_in, chunk)
    partial = torch.empty(splits, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    grid = (num_tokens, ceil_div(max_rank, SHRINK_WARPS), splits)
    args = [partial, x, a_stack, int32_on(ranks, x.device), int32_on(token_slots, x.device),
            np.int32(num_tokens), np.int32(h_in), np.int32(max_rank), np.int32(chunk)]
    runner.launch("lora", lora_name("shrink_bgmv_split", dtype, vec), grid, (32 * SHRINK_WARPS, 1, 1), args)
    return partial.sum(0).to(dtype)


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
