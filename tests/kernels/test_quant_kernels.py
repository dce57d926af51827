"""Quantized linear kernels (quant_linear.cu: GEMV, tensor-core GEMM, dequantize) against the naive
dequantize-then-matmul reference: on the CPU shim here, on CUDA where a device is present (gpu_session.sh's
cuda_kernel_tests stage), and the SGLang case (an FP8 base with LoRA and base rows in one captured CUDA graph equals
the eager step) on CUDA only."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import loraplex.kernels as kernels
from kernel_cases import assert_close
from loraplex.kernels import cpu_runner, dispatch, quant_args, quant_launch, reference
from loraplex.kernels.sources import KERNEL_DIR

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (benchmarks/gpu_session.sh runs it in its cuda_kernel_tests stage)"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def fp8_weight(n, k, gen):
    """Every finite e4m3fn code (subnormals and +-448 included), never the NaN codes 0x7f / 0xff."""
    codes = torch.randint(0, 254, (n, k), generator=gen, dtype=torch.int32)
    codes += (codes >= 0x7F).int()
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_scale(kind, n, k, gen):
    """(scale, block) of a layout: tensor, channel, or block:<rows>x<inputs>."""
    if kind == "tensor":
        return torch.rand(1, generator=gen) * 0.01 + 1e-3, None
    if kind == "channel":
        return torch.rand(n, generator=gen) * 0.01 + 1e-3, None
    bn, bk = map(int, kind.split(":")[1].split("x"))
    return torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 0.01 + 1e-3, (bn, bk)


def int4_weight(n, k, group, scale_dtype, gen):
    """(qweight, scales, zeros): random nibbles (an odd K's spare nibble too), zeros 0..15 with both ends present,
    one negative scale."""
    groups = -(-k // group)
    qweight = torch.randint(0, 256, (n, -(-k // 2)), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    zeros[0, 0], zeros[-1, -1] = 0, 15
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    scales[-1, 0] = -scales[-1, 0]
    return qweight, scales.to(scale_dtype), zeros


def case(fmt, dtype, m, n, k, layout, bias, seed=0, device="cpu"):
    """(args of fp8_linear / w4a16_linear after x, x, the reference output). layout: the fp8 scale kind, or
    (group, scale dtype) for int4."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    if fmt == "fp8":
        weight = fp8_weight(n, k, gen)
        scale, block = fp8_scale(layout, n, k, gen)
        args = (weight, scale, block, b)
    else:
        args = (*int4_weight(n, k, *layout, gen), layout[0], b)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    x = x.to(device)
    ref = (reference.fp8_linear if fmt == "fp8" else reference.w4a16_linear)(x.cpu(), *(
        a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    return x, args, ref


def launch(fmt, x, args, **options):
    return (quant_launch.fp8_linear if fmt == "fp8" else quant_launch.w4a16_linear)(x, *args, **options)


# (format, dtype, m, n, k, layout, bias): odd N, K off the loads / groups / tiles, partial FP8 blocks, groups of
# 32/64/128, one group per row, non-power-of-two groups (byte-by-byte path), scales in and not in x's dtype
GEMV_CASES = [
    ("fp8", BF16, 1, 37, 256, "channel", True),
    ("fp8", FP16, 5, 37, 200, "block:32x64", False),
    ("fp8", FP32, 3, 16, 96, "tensor", True),
    ("fp8", BF16, 8, 33, 320, "block:128x128", True),
    ("int4", BF16, 1, 37, 256, (32, BF16), True),
    ("int4", FP16, 6, 21, 256, (128, FP16), False),
    ("int4", BF16, 2, 19, 192, (64, FP16), True),
    ("int4", FP16, 9, 13, 201, (64, FP32), False),
    ("int4", FP32, 4, 11, 160, (32, FP16), True),
    ("int4", BF16, 1, 9, 96, (96, BF16), False),
    ("int4", BF16, 3, 10, 200, (500, BF16), True),
]
GEMM_CASES = [
    ("fp8", BF16, 33, 70, 200, "block:32x64", True),
    ("fp8", FP16, 9, 37, 256, "channel", False),
    ("int4", BF16, 17, 70, 256, (32, BF16), True),
    ("int4", FP16, 33, 37, 201, (64, FP16), True),
    ("int4", BF16, 12, 65, 384, (128, FP16), False),
]


def _ids(cases):
    return [f"{c[0]}-{str(c[1])[6:]}-m{c[2]}-n{c[3]}-k{c[4]}-{c[5] if isinstance(c[5], str) else c[5][0]}"
            for c in cases]


@pytest.mark.parametrize("fmt,dtype,m,n,k,layout,bias", GEMV_CASES, ids=_ids(GEMV_CASES))
def test_gemv_matches_reference(cpu, fmt, dtype, m, n, k, layout, bias):
    x, args, ref = case(fmt, dtype, m, n, k, layout, bias)
    assert_close(launch(fmt, x, args, runner=cpu, impl="gemv"), ref, dtype)


@pytest.mark.parametrize("fmt,dtype,m,n,k,layout,bias", GEMM_CASES, ids=_ids(GEMM_CASES))
def test_gemm_matches_reference(cpu, fmt, dtype, m, n, k, layout, bias):
    x, args, ref = case(fmt, dtype, m, n, k, layout, bias)
    assert_close(launch(fmt, x, args, runner=cpu, impl="gemm"), ref, dtype)


@pytest.mark.parametrize("impl", ["gemv", "gemm"])
def test_split_k_matches_reference(cpu, impl):
    for fmt, layout in (("fp8", "block:16x128"), ("int4", (64, BF16))):
        x, args, ref = case(fmt, BF16, 3, 24, 512, layout, True, seed=3)
        assert_close(launch(fmt, x, args, runner=cpu, impl=impl, splits=3), ref, BF16)


def test_dequantize_rounds_each_weight_as_the_reference(cpu):
    gen = torch.Generator().manual_seed(5)
    weight = fp8_weight(33, 200, gen)
    scale, block = fp8_scale("block:16x64", 33, 200, gen)
    x = torch.zeros(1, 200, dtype=BF16)
    w = quant_launch.Weights("Fp8Weights", weight.view(torch.uint8), scale, weight.view(torch.uint8),
                             tuple(quant_args.fp8_layout(x, weight, scale, block)), 1, 64)
    want = reference.fp8_dequantize(weight, scale, block).to(BF16)
    assert torch.equal(quant_launch.dequantize(w, BF16, 200, runner=cpu), want)
    assert torch.equal(quant_launch.dequantize(w, BF16, 200, 5, 11, runner=cpu), want[5:16])
    for scale_dtype in (FP16, FP32):
        q, s, z = int4_weight(7, 201, 64, scale_dtype, gen)
        w = quant_launch.Weights(f"Int4Weights<{'__half' if scale_dtype == FP16 else 'float'}>", q, s, z, (64, 4, 0),
                                 2, 64)
        want = reference.int4_dequantize(q, s, z, 64, 201)
        assert torch.equal(quant_launch.dequantize(w, FP16, 201, runner=cpu), want.to(FP16))


def test_dequantize_then_torch_gemm_in_chunks(cpu, monkeypatch):
    monkeypatch.setattr(quant_launch, "DEQUANT_CHUNK_BYTES", 5 * 128 * 2)  # five rows of W a chunk
    for fmt, layout in (("fp8", "channel"), ("int4", (32, BF16))):
        x, args, ref = case(fmt, BF16, 4, 23, 128, layout, True, seed=7)
        assert_close(launch(fmt, x, args, runner=cpu, impl="dequant"), ref, BF16)


def test_auto_picks_gemv_for_decode_rows_then_gemm_then_dequantize():
    assert [quant_launch.choose_impl(m, BF16) for m in (1, 8, 9, 511, 512)] == [
        "gemv", "gemv", "gemm", "gemm", "dequant"]
    assert quant_launch.choose_impl(9, FP32) == "dequant"


def test_choose_splits_fills_the_device_only_when_the_grid_is_small():
    assert quant_launch.choose_splits(blocks=512, k=4096, sm_count=132) == 1
    assert quant_launch.choose_splits(blocks=128, k=4096, sm_count=132) == 3
    assert quant_launch.choose_splits(blocks=64, k=1536, sm_count=132) == 1  # not two slices of 1024
    assert quant_launch.choose_splits(blocks=1, k=65536, sm_count=132) == quant_launch.MAX_SPLITS


def test_run_shift_serves_powers_of_two_and_whole_rows():
    assert [quant_launch.run_shift(r, 4096) for r in (32, 128, 4096, 8192, 96)] == [5, 7, 31, 31, None]


@pytest.mark.parametrize("name", ["fp8_linear", "w4a16_linear"])
def test_the_package_function_and_launcher_take_the_reference_arguments(name):
    ref = inspect.signature(getattr(reference, name))
    assert inspect.signature(getattr(kernels, name)) == ref
    launcher = list(inspect.signature(getattr(quant_launch, name)).parameters.values())
    assert [p.name for p in launcher[: len(ref.parameters)]] == list(ref.parameters)
    assert all(p.kind is p.KEYWORD_ONLY for p in launcher[len(ref.parameters):])


def test_devices_before_compute_capability_8_take_the_reference():
    from loraplex.kernels.preconditions import QUANT, KernelShapes, reason

    assert "compute capability 8.0 or newer" in reason(QUANT, KernelShapes(FP16, capability=(7, 5)))
    assert reason(QUANT, KernelShapes(BF16, capability=(9, 0))) is None
    assert reason(QUANT, KernelShapes(FP32)) is None  # the shim
    assert reason(QUANT, KernelShapes(torch.float64)) is not None


def test_launcher_constants_match_the_source():
    text = (KERNEL_DIR / "quant_linear.cu").read_text()

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))

    assert quant_launch.GEMV_THREADS == 32 * constant("kGemvWarps")
    assert quant_launch.GEMV_ROWS == constant("kGemvWarps") * constant("kGemvRowsPerWarp")
    assert (quant_launch.TILE_M, quant_launch.TILE_N, quant_launch.TILE_K) == tuple(
        constant(n) for n in ("kTileM", "kTileN", "kTileK"))
    assert quant_launch.GEMM_THREADS == constant("kGemmThreads")
    assert quant_launch.DEQUANT_THREADS == constant("kDequantThreads")


def test_shim_mode_routes_the_package_functions_to_the_kernels(cpu, monkeypatch):
    monkeypatch.setattr(dispatch, "MODE", "shim")
    launched = []
    real = cpu_runner.CpuRunner.launch
    monkeypatch.setattr(cpu_runner.CpuRunner, "launch",
                        lambda self, family, name, *a: (launched.append(name), real(self, family, name, *a))[1])
    x, args, ref = case("int4", BF16, 6, 21, 128, (32, BF16), True)
    got = kernels.w4a16_linear(x.view(2, 3, 128), *args)
    assert got.shape == (2, 3, 21) and launched == ["quant_gemv<__nv_bfloat16, Int4Weights<__nv_bfloat16>, 8>"]
    assert_close(got.view(6, 21), ref, BF16)
    x, args, ref = case("fp8", FP16, 1, 16, 64, "tensor", False)
    assert_close(kernels.fp8_linear(x, *args), ref, FP16)
    assert launched[-1] == "quant_gemv<__half, Fp8Weights, 1>"


def test_no_rows_gives_an_empty_result(cpu):
    x, args, _ = case("fp8", BF16, 1, 5, 32, "channel", True)
    assert launch("fp8", x[:0], args, runner=cpu).shape == (0, 5)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, s: reference.fp8_linear(x, w, s[:3]), r"scale \[3\] of weight \[8, 32\]"),
    (lambda x, w, s: reference.fp8_linear(x, w, torch.ones(1, 1), (128, 0)), "block must be a positive"),
    (lambda x, w, s: reference.fp8_linear(x, w, torch.ones(2, 1), (4, 16)), r"needs \[2, 2\]"),
    (lambda x, w, s: reference.fp8_linear(x[:, :16], w, s), "not the weight's 32 inputs"),
    (lambda x, w, s: reference.fp8_linear(x, w.float(), s), "weight must be float8_e4m3fn"),
    (lambda x, w, s: reference.w4a16_linear(x, torch.zeros(8, 15, dtype=torch.uint8), torch.ones(8, 1),
                                            torch.zeros(8, 1, dtype=torch.uint8), 32), r"qweight must be uint8 \[N, 16\]"),
    (lambda x, w, s: reference.w4a16_linear(x, torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1),
                                            torch.zeros(8, 2, dtype=torch.uint8), 32), r"zeros must be uint8 \[8, 1\]"),
    (lambda x, w, s: reference.w4a16_linear(x, torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1),
                                            torch.zeros(8, 1, dtype=torch.uint8), 0), "group_size must be a positive"),
    (lambda x, w, s: quant_launch.w4a16_linear(x, torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1),
                                               torch.zeros(8, 1, dtype=torch.uint8), 32, impl="scaled_mm"),
     "FP8 weights only"),
])
def test_bad_arguments_are_refused_naming_them(call, match):
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 32, generator=gen), fp8_weight(8, 32, gen), torch.ones(8))


def test_scaled_mm_route_quantizes_each_row_of_x():
    # torch._scaled_mm runs on the CPU too: the route's arithmetic against per-row e4m3 activations
    x, (weight, scale, _, bias), _ = case("fp8", BF16, 5, 48, 64, "channel", True, seed=9)
    x[2] = 0  # an all-zero row keeps a finite scale
    got = quant_launch.fp8_scaled_mm(x, weight, scale, bias)
    x_scale = x.float().abs().amax(1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 448
    x_e4m3 = (x.float() / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    want = (x_e4m3 @ reference.fp8_dequantize(weight, scale).T + bias).to(BF16)
    assert_close(got, want, BF16)
    assert not quant_launch.scaled_mm_serves(x, weight, None)  # a CPU tensor: never in auto


def test_scaled_mm_knob_routes_only_prefill_rows_in_auto(cpu, monkeypatch):
    monkeypatch.setattr(quant_launch, "SCALED_MM", True)
    monkeypatch.setattr(quant_launch, "scaled_mm_serves", lambda x2, weight, block: True)
    routed = []
    real = quant_launch.fp8_scaled_mm
    monkeypatch.setattr(quant_launch, "fp8_scaled_mm", lambda *a: (routed.append(a[0].shape[0]), real(*a))[1])
    for rows in (8, 9):
        x, args, _ = case("fp8", BF16, rows, 16, 64, "channel", False)
        launch("fp8", x, args, runner=cpu)
    assert routed == [9]
    monkeypatch.setenv(quant_launch.SCALED_MM_ENV, "yes")
    with pytest.raises(ValueError, match="LORAPLEX_FP8_SCALED_MM='yes' is not 0 or 1"):
        quant_launch.read_scaled_mm()


# ---- CUDA (a lent GPU: gpu_session.sh) --------------------------------------------------------------


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("impl,cases", [("gemv", GEMV_CASES), ("gemm", GEMM_CASES), ("dequant", GEMM_CASES)])
def test_cuda_kernels_match_reference(impl, cases):
    for fmt, dtype, m, n, k, layout, bias in cases:
        if impl != "gemv" and dtype == FP32:
            continue
        x, args, ref = case(fmt, dtype, m, n, k, layout, bias, device="cuda")
        assert_close(launch(fmt, x, args, impl=impl).cpu(), ref, dtype)


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("fmt,layout", [("fp8", "channel"), ("fp8", "block:128x128"), ("int4", (128, BF16))])
@pytest.mark.parametrize("rows", [1, 8, 24])
def test_quantized_base_and_lora_rows_in_one_cuda_graph_equal_the_eager_step(fmt, layout, rows):
    """SGLang #29157 / #26930: an FP8 base with CUDA graphs corrupted LoRA outputs. One captured step holds base
    rows (slot -1) and rows of three adapters over a quantized projection; every replay, with new inputs and a new
    slot assignment copied into the static buffers, equals the eager step bit for bit and the reference."""
    from loraplex.worker.decode_graphs import cuda_graph_capture

    gen = torch.Generator().manual_seed(rows)
    n, k, rank, slots = 384, 512, 16, 3
    x, args, _ = case(fmt, BF16, rows, n, k, layout, True, device="cuda")
    a = (torch.randn(slots, rank, k, generator=gen) * 0.05).to(BF16).cuda()
    b = (torch.randn(slots, n, rank, generator=gen) * 0.05).to(BF16).cuda()
    ranks = torch.tensor([16, 8, 4], dtype=torch.int32).cuda()
    scales = torch.tensor([2.0, 1.0, 0.5]).cuda()
    token_slots = torch.full((rows,), -1, dtype=torch.int32).cuda()
    linear = kernels.fp8_linear if fmt == "fp8" else kernels.w4a16_linear

    def step():
        y = linear(x, *args)
        v = kernels.lora_shrink_bgmv(x, a, token_slots, ranks)
        kernels.lora_expand_bgmv(y, v, b, token_slots, ranks, scales)
        return y

    replay, out = cuda_graph_capture()(step)
    for trial in range(3):
        x.copy_(torch.randn(rows, k, generator=gen).to(BF16))
        token_slots.copy_(torch.randint(-1, slots, (rows,), generator=gen, dtype=torch.int32))
        eager = step().clone()
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"replay {trial} differs from the eager step"
        ref = (reference.fp8_linear if fmt == "fp8" else reference.w4a16_linear)(
            x.cpu(), *(t.cpu() if isinstance(t, torch.Tensor) else t for t in args))
        v = reference.lora_shrink_bgmv(x.cpu(), a.cpu(), token_slots.cpu(), ranks.cpu())
        reference.lora_expand_bgmv(ref, v, b.cpu(), token_slots.cpu(), ranks.cpu(), scales.cpu())
        assert_close(out.cpu(), ref, BF16)
