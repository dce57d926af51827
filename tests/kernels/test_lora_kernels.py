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


def check_group(cpu, dtype, slots, module_ranks, max_rank, h_in=64, h_outs=(96, 32, 32), seed=0, tile=lora_launch.BGMV_TILE,
                fused_output=True):
    """The fused group shrink/expand against the reference, module by module; the outputs as column views of
    one fused output (the model's q/k/v split) or separate tensors."""
    gen = torch.Generator().manual_seed(seed)
    stacks = [adapters(len(ranks), max_rank, h_in, h, ranks, dtype, gen) for ranks, h in zip(module_ranks, h_outs)]
    a_s, b_s, r_s, s_s = (list(col) for col in zip(*stacks))
    slots_t = torch.tensor(slots, dtype=torch.int32)
    x = randn(len(slots), h_in, dtype=dtype, gen=gen)
    x[slots_t < 0] = float("nan")
    v = lora_launch.lora_shrink_bgmv_group(x, a_s, slots_t, r_s, runner=cpu, tile=tile)
    assert_close(v, reference.lora_shrink_bgmv_group(x, a_s, slots_t, r_s), dtype)
    base = randn(len(slots), sum(h_outs), dtype=dtype, gen=gen)
    vv = randn(len(slots), len(h_outs) * max_rank, dtype=dtype, gen=gen)
    want = base.clone()
    reference.lora_expand_bgmv_group(vv, list(want.split(list(h_outs), 1)), b_s, slots_t, r_s, s_s)
    got = base.clone()
    ys = list(got.split(list(h_outs), 1)) if fused_output else [y.clone() for y in got.split(list(h_outs), 1)]
    lora_launch.lora_expand_bgmv_group(vv, ys, b_s, slots_t, r_s, s_s, runner=cpu, tile=tile)
    assert_close(torch.cat(ys, 1) if not fused_output else got, want, dtype)


@dtypes
@pytest.mark.parametrize("tile", BGMV_TILES)
def test_group_qkv_fused_into_views_of_one_output(cpu, dtype, tile):
    # three modules, each slot with its own rank per module (0: a module the adapter does not target)
    check_group(cpu, dtype, [0, 1, -1, 2, 2, 2, 0, 1, 1, -1, 0], [[4, 16, 1], [16, 3, 8], [2, 16, 5]], 16, tile=tile)


@dtypes
def test_group_gate_up_separate_outputs_unaligned(cpu, dtype):
    check_group(cpu, dtype, [1, 0, 1, 1, -1], [[3, 7], [7, 2]], 7, h_in=30, h_outs=(131, 129), fused_output=False)


def test_group_rank_above_one_shared_memory_chunk(cpu):
    check_group(cpu, torch.bfloat16, [0, 1, 0], [[72, 65], [65, 72]], 72, h_in=40, h_outs=(33, 300))


def test_group_of_one_module_equals_bgmv(cpu):
    check_group(cpu, torch.float16, [0, -1, 0, 0], [[8]], 8, h_outs=(40,))


def test_group_rejects_mixed_max_ranks(cpu):
    a = [torch.randn(1, 4, 8), torch.randn(1, 2, 8)]
    with pytest.raises(ValueError, match="one max rank"):
        lora_launch.lora_shrink_bgmv_group(torch.randn(2, 8), a, torch.zeros(2, dtype=torch.int32),
                                           [torch.tensor([4]), torch.tensor([2])], runner=cpu)


@dtypes
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_shrink(cpu, dtype, splits):
    # h_in 1000: slices that are not whole in the last pass; slot -1 rows and ranks below the max read nothing
    gen = torch.Generator().manual_seed(splits)
    a, _, ranks, _ = adapters(3, 16, 1000, 8, [16, 1, 5], dtype, gen)
    slots = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    x = randn(4, 1000, dtype=dtype, gen=gen)
    x[1] = float("nan")
    got = lora_launch.lora_shrink_bgmv(x, a, slots, ranks, runner=cpu, splits=splits)
    assert_close(got, reference.lora_shrink_bgmv(x, a, slots, ranks), dtype)


def test_split_choice_rule():
    choose = lora_launch.choose_splits
    assert choose(1, 16, 4096, 132) > 1  # one decode row on an H100/H200: the tiled grid fills 4 of 132 SMs
    assert choose(256, 16, 4096, 132) == 1  # batch 256: 256 blocks, enough
    assert choose(1, 16, 1024, 132) == 1  # too few features for two slices
    assert choose(1, 16, 4096, 2) == 1  # the shim's two "SMs"
    assert choose(1, 16, 1 << 20, 132) <= lora_launch.MAX_SPLITS
