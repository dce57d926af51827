"""Inputs, tolerances and paged-cache builders shared by the kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ("fp32", "fp16", "bf16")
# About two units in the last place of each type.
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise closeness at dtype's precision, relative to the largest expected magnitude."""
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    scale = max(1.0, expected.float().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


def randn(*shape, dtype, gen) -> torch.Tensor:
    """Standard normal values in dtype."""
    return torch.randn(*shape, generator=gen).to(dtype)


@dataclass(slots=True)
class PagedCache:
    """One layer's paged K/V with block tables; every slot outside the contexts holds NaN."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, gen, spare_blocks=2) -> PagedCache:
    """Random K/V for the given context lengths at shuffled block ids; NaN everywhere else.

    Block-table entries past a sequence's last block point at a NaN block, so reading
    beyond a context shows up as NaN in the output.
    """
    need = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison = order.pop()
    width = max(need + [1]) + 1
    tables = torch.full((len(context_lens), width), poison, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=dtype)
    v = torch.full(shape, float("nan"), dtype=dtype)
    for b, n in enumerate(context_lens):
        for i in range(need[b]):
            blk = order.pop()
            tables[b, i] = blk
            used = min(block_size, n - i * block_size)
            k[blk, :used] = randn(used, num_kv_heads, head_dim, dtype=dtype, gen=gen)
            v[blk, :used] = randn(used, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    return PagedCache(k, v, tables, torch.tensor(context_lens, dtype=torch.int32))
