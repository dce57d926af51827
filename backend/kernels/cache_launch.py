"""Launchers of the KV-cache kernels (cache_ops.cu): write_kv and copy_blocks."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels.instances import COPY_UNITS, cache_name
from loraplex.kernels.launch_args import aligned
from loraplex.kernels.runners import runner_for

UNITS = tuple(sorted(COPY_UNITS, reverse=True))  # bytes moved per element of the copy loops, widest first


def copy_unit(nbytes: int, *tensors: torch.Tensor) -> int:
    """Widest unit dividing nbytes and every tensor's address."""
    for unit in UNITS:
        if nbytes % unit == 0 and aligned(*tensors, bytes_=unit):
            return unit
    raise ValueError(f"rows of {nbytes} bytes cannot be copied in 2-byte units")


def _index(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.dtype not in (torch.int32, torch.int64):
        t = t.long()
    return t.to(device).contiguous()


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, runner=None):
    """Store new keys/values [T, Hkv, D] at flat slots (block * block_size + offset); slot < 0 skips."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    k = k.to(k_cache.dtype).contiguous()
    v = v.to(v_cache.dtype).contiguous()
    row_bytes = k[0].numel() * k.element_size()
    unit = copy_unit(row_bytes, k_cache, v_cache, k, v)
    slots = _index(slot_mapping, k.device)
    args = [k_cache, v_cache, k, v, slots, np.int32(row_bytes // unit)]
    name = cache_name("write_kv", unit, slots.dtype)
    (runner or runner_for(k)).launch("cache", name, (num_tokens, 1, 1), (128, 1, 1), args)


def copy_blocks(kv_cache, src, dst, *, runner=None):
    """Copy-on-write: kv_cache[..., dst[i], ...] = kv_cache[..., src[i], ...] for all layers.

    kv_cache is [num_layers, 2, num_blocks, block_size, Hkv, D]; no dst may also be a src.
    """
    pairs = len(src)
    if pairs == 0:
        return
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    layers, two, num_blocks = kv_cache.shape[:3]
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    unit = copy_unit(block_bytes, kv_cache)
    src = _index(src, kv_cache.device)
    dst = _index(dst, kv_cache.device).to(src.dtype)
    args = [kv_cache, src, dst, np.int64(num_blocks), np.int32(block_bytes // unit)]
    (runner or runner_for(kv_cache)).launch(
        "cache", cache_name("copy_blocks", unit, src.dtype), (pairs, layers * two, 1), (256, 1, 1), args
    )
