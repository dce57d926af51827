"""Prefill attention over paged KV: the tiled kernel (on the CPU shim) and gather+SDPA match the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, assert_close, paged_cache, randn
from loraplex.kernels import prefill_launch, reference
from loraplex.kernels.prefill_sdpa import paged_attention_prefill_sdpa

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def inputs(dtype, query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(int(cu[-1]), num_q_heads, head_dim, dtype=dtype, gen=gen)
    return q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, head_dim**-0.5


def check(cpu, dtype, query_lens, context_lens, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4):
    args = inputs(dtype, query_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    want = reference.paged_attention_prefill(*args)
    assert_close(prefill_launch.paged_attention_prefill_kernel(*args, runner=cpu), want, dtype)
    assert_close(paged_attention_prefill_sdpa(*args), want, dtype)


@dtypes
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
def test_chunks_with_and_without_prefix(cpu, dtype, group):
    # whole prompt (no prefix); chunk after a prefix that ends mid-block; one new token;
    # a chunk longer than one query tile over a block-aligned prefix
    check(cpu, dtype, query_lens=[7, 5, 1, 21], context_lens=[7, 14, 9, 29], num_q_heads=2 * group, num_kv_heads=2)


@dtypes
def test_empty_sequence_in_batch(cpu, dtype):
    check(cpu, dtype, query_lens=[3, 0, 4], context_lens=[3, 5, 12])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(cpu, head_dim):
    # 256 uses 8-query tiles and 16-key tiles
    check(cpu, torch.float16, query_lens=[18, 2], context_lens=[40, 2], head_dim=head_dim, block_size=16)


def test_single_token_context(cpu):
    check(cpu, torch.float32, query_lens=[1], context_lens=[1], num_q_heads=1, num_kv_heads=1)


def test_impl_selection(cpu):
    args = inputs(torch.float32, [3, 2], [3, 6], 2, 1, 32, 4)
    want = reference.paged_attention_prefill(*args)
    assert_close(prefill_launch.paged_attention_prefill(*args, impl="kernel", runner=cpu), want, torch.float32)
    assert_close(prefill_launch.paged_attention_prefill(*args, impl="sdpa"), want, torch.float32)
    with pytest.raises(ValueError, match="impl"):
        prefill_launch.paged_attention_prefill(*args, impl="flash")
    assert prefill_launch.DEFAULT_IMPL in prefill_launch.IMPLS


@pytest.mark.parametrize("query_lens", [[1, 1, 5, 1, 3, 1], [1, 6], [4, 1, 1]], ids=["interleaved", "one-decode", "decodes-last"])
def test_decodes_mixed_with_prefill_chunks(query_lens):
    # one-token sequences (decodes) go through the batched decode attention in one call, the others through SDPA
    context_lens = [n + 3 * i for i, n in enumerate(query_lens)]
    args = inputs(torch.float32, query_lens, context_lens, 4, 2, 32, 4)
    assert_close(paged_attention_prefill_sdpa(*args), reference.paged_attention_prefill(*args), torch.float32)


def test_host_lengths_spare_every_device_read(monkeypatch):
    from loraplex.kernels import remember_host_lengths

    args = inputs(torch.float32, [1, 1, 5, 2], [4, 9, 5, 6], 4, 2, 32, 4)
    q, k_cache, v_cache, tables, cu, lens, scale = args
    want = reference.paged_attention_prefill(*args)
    remember_host_lengths(cu, lens, cu.tolist(), lens.tolist())

    def read_back(self):
        raise AssertionError("a device tensor was read back")

    monkeypatch.setattr(torch.Tensor, "tolist", read_back)
    monkeypatch.setattr(torch.Tensor, "item", read_back)
    # the decodes take the batched reference, as a GPU takes the decode kernel (the CPU's per-sequence
    # decode reads the lengths on the host, where that is no device read)
    monkeypatch.setattr(reference, "CPU_DECODE", "padded")
    layers = [paged_attention_prefill_sdpa(*args) for _ in range(3)]  # every layer of the step
    monkeypatch.undo()
    for got in layers:
        assert_close(got, want, torch.float32)
