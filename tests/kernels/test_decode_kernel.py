"""Paged-attention decode (paged_attention_decode.cu) on the CPU shim matches the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, assert_close, paged_cache, randn
from loraplex.kernels import decode_launch, reference

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def check(cpu, dtype, context_lens, num_q_heads, num_kv_heads, head_dim=32, block_size=4, num_splits=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = randn(len(context_lens), num_q_heads, head_dim, dtype=dtype, gen=gen)
    scale = head_dim**-0.5
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    got = decode_launch.paged_attention_decode(*args, num_splits=num_splits, runner=cpu)
    assert_close(got, reference.paged_attention_decode(*args), dtype)


@dtypes
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
def test_context_edges_in_one_batch(cpu, dtype, group):
    # 1 token, one block minus one, exactly one block, one past the block boundary, longer
    check(cpu, dtype, [1, 3, 4, 5, 23], num_q_heads=2 * group, num_kv_heads=2, num_splits=1)


@dtypes
def test_split_context_matches_single_pass(cpu, dtype):
    # 3 splits of 12 tokens: the short sequences leave whole splits empty
    check(cpu, dtype, [1, 12, 13, 30, 33], num_q_heads=8, num_kv_heads=2, num_splits=3)


@pytest.mark.parametrize("splits", [2, 5, 64])
def test_split_counts(cpu, splits):
    check(cpu, torch.float32, [7, 40, 17], num_q_heads=4, num_kv_heads=4, num_splits=splits)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_head_dims(cpu, dtype, head_dim):
    check(cpu, dtype, [9, 16, 2], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=8, num_splits=2)


@pytest.mark.parametrize("group", [2, 3, 6, 8, 16])
def test_group_sizes_and_query_chunks(cpu, group):
    # 3 and 6 leave idle query slots in a block; 16 needs two blocks per KV head
    check(cpu, torch.bfloat16, [5, 11], num_q_heads=2 * group, num_kv_heads=2)


def test_zero_context_gives_zeros(cpu):
    check(cpu, torch.float16, [0, 6], num_q_heads=2, num_kv_heads=1, num_splits=1)
    check(cpu, torch.float16, [0, 6], num_q_heads=2, num_kv_heads=1, num_splits=2)


def test_block_size_sixteen_long_context_auto_splits(cpu):
    check(cpu, torch.float16, [300, 1, 170], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16)


def test_choose_splits_fills_device_within_context():
    assert decode_launch.choose_splits(blocks=512, max_context=4096, sm_count=132) == 2
    assert decode_launch.choose_splits(blocks=8, max_context=4096, sm_count=132) == 16
    assert decode_launch.choose_splits(blocks=8, max_context=256, sm_count=132) == 1
    assert decode_launch.choose_splits(blocks=4096, max_context=32768, sm_count=132) == 1


def test_split_plan_uses_whole_blocks_and_no_empty_split():
    assert decode_launch.split_plan(max_context=100, block_size=16, splits=3) == (48, 3)
    assert decode_launch.split_plan(max_context=64, block_size=16, splits=3) == (32, 2)
    assert decode_launch.split_plan(max_context=64, block_size=16, splits=1) == (64, 1)


def test_queries_per_block():
    assert [decode_launch.queries_per_block(g) for g in (1, 2, 3, 4, 5, 8, 16)] == [1, 2, 4, 4, 8, 8, 8]


def test_unsupported_head_dim_is_rejected(cpu):
    q = torch.randn(1, 2, 48)
    kv = torch.randn(2, 4, 2, 48)
    with pytest.raises(ValueError, match="head dim"):
        tables = torch.zeros(1, 1, dtype=torch.int32)
        decode_launch.paged_attention_decode(q, kv, kv, tables, torch.tensor([1]), 1.0, runner=cpu)


@pytest.mark.parametrize("group", [1, 3])
def test_reference_all_heads_and_per_head_agree(monkeypatch, group):
    """The reference's two ways (one matmul for all KV heads, or one per head) give the same
    attention, for decode and prefill, with NaN in every cache row outside the contexts."""
    gen = torch.Generator().manual_seed(7)
    lens = [0, 1, 15, 16, 17, 40]
    cache = paged_cache(lens, 2, 32, 16, torch.float32, gen)
    q = randn(len(lens), 2 * group, 32, dtype=torch.float32, gen=gen)
    counts = torch.tensor([0, 1, 3, 16, 2, 5])
    cu = torch.cat((torch.zeros(1, dtype=torch.long), counts.cumsum(0))).int()
    qp = randn(int(cu[-1]), 2 * group, 32, dtype=torch.float32, gen=gen)
    monkeypatch.setattr(reference, "CPU_DECODE", "padded")  # decode in padded batches too
    results = []
    for limit in (1 << 30, 0):  # everything on the all-heads path, then everything per head
        monkeypatch.setattr(reference, "_ALL_HEADS_ELEMENTS", limit)
        decode = reference.paged_attention_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                                  cache.context_lens, 0.2)
        prefill = reference.paged_attention_prefill(qp, cache.k_cache, cache.v_cache, cache.block_tables, cu,
                                                    cache.context_lens, 0.2)
        assert torch.isfinite(decode).all() and torch.isfinite(prefill).all()
        results.append((decode, prefill))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["each", "buckets", "padded"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_one_stream_sdpa_agrees_with_the_batched_path(monkeypatch, group, mode):
    """A decode step of one sequence takes torch's fused attention; it must give what the same
    sequence gets inside a batch (one sequence at a time, in buckets, or padded), NaN in the cache rows
    outside its context, empty ones too."""
    monkeypatch.setattr(reference, "CPU_DECODE", mode)
    gen = torch.Generator().manual_seed(11)
    lens = [0, 1, 15, 16, 17, 40]
    cache = paged_cache(lens, 2, 32, 16, torch.float32, gen)
    q = randn(len(lens), 2 * group, 32, dtype=torch.float32, gen=gen)
    batched = reference.paged_attention_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                               cache.context_lens, 0.2)
    for b in range(len(lens)):
        alone = reference.paged_attention_decode(q[b:b + 1], cache.k_cache, cache.v_cache,
                                                 cache.block_tables[b:b + 1].clone(), cache.context_lens[b:b + 1].clone(), 0.2)
        assert torch.isfinite(alone).all()
        torch.testing.assert_close(alone[0], batched[b], rtol=1e-5, atol=1e-6)


def test_cpu_decode_attends_one_at_a_time_where_that_pays(monkeypatch):
    cache = torch.zeros(4, 16, 8, 64)  # W1's KV row: 8 heads x 64, 4 KiB for K and V of a token
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert reference._decode_each_pays(torch.tensor([32, 40, 300]), cache) == (threads == 1)  # 496 KiB
        assert not reference._decode_each_pays(torch.tensor([20, 24, 28]), cache)  # 96 KiB a context
    assert not reference._decode_each_pays(torch.tensor([0, 0]), cache)


def test_cpu_decode_buckets_cut_at_the_slack_and_the_size():
    # lengths 10, 12, 30, 31, 100 (and an empty context, in no bucket), blocks of 4: 12 <= 1.5 * 10 + 4, 30 is not
    lens = torch.tensor([30, 10, 0, 100, 12, 31], dtype=torch.int32)
    tables = torch.arange(6 * 25, dtype=torch.int32).view(6, 25)
    plan = reference._bucket_plan(tables, lens, 4, 2 * 32)
    assert [seqs.tolist() for seqs, *_ in plan] == [[1, 4], [0, 5], [3]]
    small = reference._bucket_plan(tables, lens, 4, reference.BUCKET_ELEMENTS // 40)  # 40 tokens a bucket
    assert [seqs.tolist() for seqs, *_ in small] == [[1, 4], [0], [5], [3]]
