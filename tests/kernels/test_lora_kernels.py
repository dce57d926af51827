"""LoRA shrink/expand kernels (lora.cu) run on the CPU shim and match the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cases import DTYPE_IDS, DTYPES, assert_close, randn
from loraplex.kernels import lora_launch, reference
from loraplex.kernels.instances import BGMV_TILES

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def adapters(num_slots, max_rank, h_in, h_out, ranks, dtype, gen):
    """A/B stacks whose rows/columns past each slot's rank are NaN (must never be read)."""
    a = randn(num_slots, max_rank, h_in, dtype=dtype, gen=gen)
    b = randn(num_slots, h_out, max_rank, dtype=dtype, gen=gen)
    for s, r in enumerate(ranks):
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return a, b, ranks_t, scales


def check_bgmv(cpu, dtype, slots, ranks, max_rank, h_in=64, h_out=96, seed=0, tile=lora_launch.BGMV_TILE):
    gen = torch.Generator().manual_seed(seed)
    a, b, ranks_t, scales = adapters(len(ranks), max_rank, h_in, h_out, ranks, dtype, gen)
    slots_t = torch.tensor(slots, dtype=torch.int32)
    x = randn(len(slots), h_in, dtype=dtype, gen=gen)
    x[slots_t < 0] = float("nan")  # rows without an adapter are never read
    out = lora_launch.lora_shrink_bgmv(x, a, slots_t, ranks_t, runner=cpu, tile=tile)
    want = reference.lora_shrink_bgmv(x, a, slots_t, ranks_t)
    assert_close(out, want, dtype)
    v = randn(len(slots), max_rank, dtype=dtype, gen=gen)
    y = randn(len(slots), h_out, dtype=dtype, gen=gen)
    got = lora_launch.lora_expand_bgmv(y.clone(), v, b, slots_t, ranks_t, scales, runner=cpu, tile=tile)
    assert_close(got, reference.lora_expand_bgmv(y.clone(), v, b, slots_t, ranks_t, scales), dtype)


def check_sgmv(cpu, dtype, starts, seg_slots, num_tokens, ranks, max_rank, h_in=64, h_out=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, b, ranks_t, scales = adapters(len(ranks), max_rank, h_in, h_out, ranks, dtype, gen)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    slots_t = torch.tensor(seg_slots, dtype=torch.int32)
    x = randn(num_tokens, h_in, dtype=dtype, gen=gen)
    out = lora_launch.lora_shrink_sgmv(x, a, starts_t, slots_t, ranks_t, runner=cpu)
    assert_close(out, reference.lora_shrink_sgmv(x, a, starts_t, slots_t, ranks_t), dtype)
    v = randn(num_tokens, max_rank, dtype=dtype, gen=gen)
    y = randn(num_tokens, h_out, dtype=dtype, gen=gen)
    got = lora_launch.lora_expand_sgmv(y.clone(), v, b, starts_t, slots_t, ranks_t, scales, runner=cpu)
    assert_close(got, reference.lora_expand_sgmv(y.clone(), v, b, starts_t, slots_t, ranks_t, scales), dtype)


@dtypes
@pytest.mark.parametrize("tile", BGMV_TILES)
def test_bgmv_mixed_slots_and_ranks(cpu, dtype, tile):
    # ranks 1 (minimum), 16 (= max rank) and 5; slot -1 rows; runs of equal slots across tiles
    check_bgmv(cpu, dtype, [0, 1, -1, 2, 2, 2, 2, 0, 1, 1, -1, 0, 2], ranks=[1, 16, 5], max_rank=16, tile=tile)


def test_bgmv_tile_must_be_instantiated(cpu):
    with pytest.raises(ValueError, match="not instantiated"):
        check_bgmv(cpu, torch.float32, [0], ranks=[2], max_rank=2, tile=3)


@dtypes
def test_bgmv_unaligned_hidden_sizes_use_scalar_loads(cpu, dtype):
    check_bgmv(cpu, dtype, [1, 0, 1], ranks=[3, 7], max_rank=7, h_in=30, h_out=131)


@dtypes
def test_bgmv_rank_above_one_shared_memory_chunk(cpu, dtype):
    check_bgmv(cpu, dtype, [0, 1, 0, 1, 1], ranks=[72, 65], max_rank=72, h_in=40, h_out=33)


def test_bgmv_all_tokens_without_adapter(cpu):
    check_bgmv(cpu, torch.float16, [-1] * 6, ranks=[4], max_rank=4)


def test_bgmv_single_token(cpu):
    check_bgmv(cpu, torch.bfloat16, [0], ranks=[8], max_rank=8)


@dtypes
def test_sgmv_segments_with_empty_and_unadapted(cpu, dtype):
    # segments: [0,5) slot 1, [5,5) empty, [5,22) slot 0, [22,25) none, [25,40) slot 2
    check_sgmv(cpu, dtype, [0, 5, 5, 22, 25, 40], [1, 2, 0, -1, 2], 40, ranks=[8, 1, 32], max_rank=32)


def test_sgmv_tokens_outside_segments_get_nothing(cpu):
    # rows 0-2 precede the first segment, rows 20-23 follow the last one
    check_sgmv(cpu, torch.float32, [3, 9, 20], [0, 1], 24, ranks=[4, 6], max_rank=6)


def test_sgmv_no_segments(cpu):
    check_sgmv(cpu, torch.float32, [0], [], 5, ranks=[4], max_rank=4)


def test_expand_into_non_contiguous_output(cpu):
    gen = torch.Generator().manual_seed(3)
    a, b, ranks, scales = adapters(2, 8, 16, 48, [8, 2], torch.float16, gen)
    slots = torch.tensor([1, 0, 1, -1], dtype=torch.int32)
    v = randn(4, 8, dtype=torch.float16, gen=gen)
    base = randn(4, 64, dtype=torch.float16, gen=gen)
    want = base.clone()
    reference.lora_expand_bgmv(want[:, 8:56], v, b, slots, ranks, scales)
    got = base.clone()
    lora_launch.lora_expand_bgmv(got[:, 8:56], v, b, slots, ranks, scales, runner=cpu)
    assert_close(got, want, torch.float16)


def test_empty_batch(cpu):
    x = torch.empty(0, 16)
    a = torch.randn(2, 4, 16)
    out = lora_launch.lora_shrink_bgmv(x, a, torch.empty(0, dtype=torch.int32), torch.tensor([4, 4]), runner=cpu)
    assert out.shape == (0, 4)


def test_mismatched_dtypes_are_rejected(cpu):
    with pytest.raises(TypeError, match="dtype"):
        x, a = torch.randn(2, 8), torch.randn(1, 2, 8).half()
        lora_launch.lora_shrink_bgmv(x, a, torch.zeros(2, dtype=torch.int32), torch.tensor([2]), runner=cpu)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    num_slots=st.integers(1, 4),
    num_tokens=st.integers(1, 20),
    max_rank=st.integers(1, 12),
    dtype_index=st.integers(0, 2),
)
def test_bgmv_and_sgmv_random(cpu, data, num_slots, num_tokens, max_rank, dtype_index):
    dtype = DTYPES[dtype_index]
    ranks = data.draw(st.lists(st.integers(1, max_rank), min_size=num_slots, max_size=num_slots))
    slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_tokens, max_size=num_tokens))
    check_bgmv(cpu, dtype, slots, ranks, max_rank, h_in=24, h_out=40)
    cuts = sorted(data.draw(st.lists(st.integers(0, num_tokens), min_size=1, max_size=6)))
    seg_slots = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=len(cuts) - 1, max_size=len(cuts) - 1))
    check_sgmv(cpu, dtype, cuts, seg_slots, num_tokens, ranks, max_rank, h_in=24, h_out=40)
