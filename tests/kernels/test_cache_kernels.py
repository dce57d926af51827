"""write_kv and copy_blocks (cache_ops.cu) on the CPU shim match the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, randn
from loraplex.kernels import cache_launch, reference

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def check_write(cpu, dtype, num_kv_heads, head_dim, slots, index_dtype=torch.int64, block_size=4, num_blocks=6):
    gen = torch.Generator().manual_seed(0)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    k = randn(len(slots), num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn(len(slots), num_kv_heads, head_dim, dtype=dtype, gen=gen)
    mapping = torch.tensor(slots, dtype=index_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, want_v, k, v, mapping)
    cache_launch.write_kv(k_cache, v_cache, k, v, mapping, runner=cpu)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@dtypes
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_write_kv_with_padding_slots(cpu, dtype, index_dtype):
    check_write(cpu, dtype, 2, 32, [5, 0, -1, 23, 4, -1, 9], index_dtype)


@pytest.mark.parametrize(
    "head_dim,dtype,unit",
    [(3, torch.float16, 2), (3, torch.float32, 4), (2, torch.bfloat16, 4), (8, torch.float16, 16)],
)
def test_write_kv_copy_units(cpu, head_dim, dtype, unit):
    k = torch.zeros(2, 1, head_dim, dtype=dtype)
    assert cache_launch.copy_unit(k[0].numel() * k.element_size(), k) == unit
    check_write(cpu, dtype, 1, head_dim, [1, 7])


def test_write_kv_converts_input_dtype(cpu):
    k_cache = torch.zeros(2, 2, 1, 8, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(1, 1, 8)
    cache_launch.write_kv(k_cache, v_cache, k, -k, torch.tensor([3]), runner=cpu)
    assert torch.equal(k_cache[1, 1], k[0].half())
    assert torch.equal(v_cache[1, 1], -k[0].half())


def test_reference_write_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 2, 1, 4)
    v_cache = torch.zeros(2, 2, 1, 4)
    reference.write_kv(k_cache, v_cache, torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([-1, 1]))
    assert k_cache.flatten(0, 1)[:, 0, 0].tolist() == [0, 1, 0, 0]


@dtypes
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_copy_blocks_all_layers(cpu, dtype, index_dtype):
    gen = torch.Generator().manual_seed(1)
    kv = randn(3, 2, 7, 4, 2, 16, dtype=dtype, gen=gen)
    src = torch.tensor([0, 4, 4], dtype=index_dtype)
    dst = torch.tensor([2, 5, 6], dtype=index_dtype)
    want = kv.clone()
    reference.copy_blocks(want, src, dst)
    cache_launch.copy_blocks(kv, src, dst, runner=cpu)
    assert torch.equal(kv, want)


def test_copy_blocks_no_pairs(cpu):
    kv = torch.randn(1, 2, 3, 4, 1, 8)
    before = kv.clone()
    cache_launch.copy_blocks(kv, torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), runner=cpu)
    assert torch.equal(kv, before)
