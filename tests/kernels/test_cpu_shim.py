"""The CUDA-on-CPU shim runs CUDA semantics faithfully: barriers, shuffles, atomics, 16-bit floats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loraplex.kernels.cpu_runner import CpuLibrary, build_source

SOURCE = Path(__file__).with_name("shim_selftest.cu")
NAMES = (
    "reverse_in_block", "shuffles", "atomics", "indices", "math", "divergent_barrier", "partial_mask",
    "convert<float>", "convert<__half>", "convert<__nv_bfloat16>",
)


@pytest.fixture(scope="module")
def lib():
    return CpuLibrary(build_source(SOURCE, NAMES, tag="shim_selftest"), NAMES)


def test_syncthreads_orders_shared_memory(lib):
    out = torch.zeros(3 * 256, dtype=torch.int32)
    lib.launch("reverse_in_block", (3,), (256,), [out])
    expect = [b * 1000 + (255 - t) for b in range(3) for t in range(256)]
    assert out.tolist() == expect


def test_warp_shuffles_match_cuda_semantics(lib):
    out = torch.zeros(9, 64, dtype=torch.int32)
    lib.launch("shuffles", (1,), (64,), [out])
    for w in range(2):
        lanes = range(32)
        v = [100 * w + lane for lane in lanes]
        row = lambda i: out[i, 32 * w : 32 * w + 32].tolist()  # noqa: E731
        assert row(0) == [v[lane ^ 5] for lane in lanes]
        assert row(1) == [v[lane + 3] if lane + 3 < 32 else v[lane] for lane in lanes]
        assert row(2) == [v[lane - 2] if lane >= 2 else v[lane] for lane in lanes]
        assert row(3) == [v[7]] * 32
        assert row(4) == [v[lane ^ 5] for lane in lanes]  # 5 < 8: stays within the group of 8
        assert row(5) == [v[lane + 3] if lane % 8 + 3 < 8 else v[lane] for lane in lanes]
        assert row(6) == [v[(lane // 8) * 8 + 7] for lane in lanes]
        assert row(7) == [sum(v)] * 32
        assert row(8) == [max(v[(lane // 4) * 4 : (lane // 4) * 4 + 4]) for lane in lanes]


def test_atomics_across_parallel_blocks(lib):
    total = torch.zeros(2, dtype=torch.float32)
    count = torch.zeros(1, dtype=torch.int32)
    lib.launch("atomics", (50,), (64,), [total, count])
    assert total.tolist() == [50.0 * 64, 64.0 * sum(range(50))]
    assert count.item() == 50 * 64


def test_thread_and_block_indices_in_three_dimensions(lib):
    grid, block = (3, 2, 2), (4, 2, 3)
    threads, blocks = 4 * 2 * 3, 3 * 2 * 2
    ids = torch.full((blocks * threads, 6), -1, dtype=torch.int32)
    dims = torch.zeros(6, dtype=torch.int32)
    lib.launch("indices", grid, block, [ids, dims])
    assert dims.tolist() == [*block, *grid]
    expect = [
        [tx, ty, tz, bx, by, bz]
        for bz in range(2) for by in range(2) for bx in range(3)
        for tz in range(3) for ty in range(2) for tx in range(4)
    ]
    assert ids.tolist() == expect


def _special_floats() -> torch.Tensor:
    half_bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    bf16_bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    edges = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, -1e9, 6e-8, 3e-8, 2.9e-8, 1e-40, float("inf"), -float("inf")]
    edges = torch.tensor(edges)
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=gen) * torch.logspace(-9, 6, 20000)
    mids = (half_bits[1:2000] + half_bits[:1999]) / 2  # ties between neighbouring halves
    return torch.cat([half_bits, bf16_bits, edges, rand, mids])


@pytest.mark.parametrize(
    "dtype,name",
    [(torch.float16, "convert<__half>"), (torch.bfloat16, "convert<__nv_bfloat16>"), (torch.float32, "convert<float>")],
)
def test_float_conversions_match_torch_bitwise(lib, dtype, name):
    x = _special_floats()
    x = x[~x.isnan()]
    out = torch.empty(x.numel(), dtype=dtype)
    back = torch.empty(x.numel(), dtype=torch.float32)
    n = x.numel()
    lib.launch(name, ((n + 255) // 256,), (256,), [out, back, x, np.int32(n)])
    expect = x.to(dtype)
    if dtype != torch.float32:
        assert torch.equal(out.view(torch.int16), expect.view(torch.int16))
    assert torch.equal(back, expect.float())


def test_nan_converts_to_nan(lib):
    x = torch.tensor([float("nan"), -float("nan")])
    for dtype, name in [(torch.float16, "convert<__half>"), (torch.bfloat16, "convert<__nv_bfloat16>")]:
        out = torch.empty(2, dtype=dtype)
        back = torch.empty(2)
        lib.launch(name, (1,), (32,), [out, back, x, np.int32(2)])
        assert out.isnan().all() and back.isnan().all()


def test_math_functions(lib):
    x = torch.linspace(-20, 20, 101)
    out = torch.empty(101, 3)
    lib.launch("math", (4,), (32,), [out, x, np.int32(101)])
    torch.testing.assert_close(out[:, 0], torch.exp(x))
    torch.testing.assert_close(out[:, 1], torch.clamp(x, min=0.5))
    torch.testing.assert_close(out[:, 2], torch.rsqrt(x.abs() + 1))


def test_divergent_barrier_is_reported_as_deadlock(lib):
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="deadlock"):
        lib.launch("divergent_barrier", (2,), (64,), [out])


def test_partial_mask_shuffle_is_refused(lib):
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="partial mask"):
        lib.launch("partial_mask", (1,), (32,), [out])


@pytest.mark.parametrize("grid,block", [((0,), (32,)), ((1,), (0,)), ((1,), (2048,))])
def test_invalid_launch_configuration_is_an_error(lib, grid, block):
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="invalid"):
        lib.launch("reverse_in_block", grid, block, [out])
