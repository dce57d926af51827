"""The exported kernel API: same signatures, CuPy never imported on CPU, routing to kernel / shim / torch path."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import loraplex.kernels as kernels
from loraplex.kernels import cpu_runner, decode_launch, dispatch, lora_launch, preconditions, prefill_launch, reference
from loraplex.kernels.preconditions import KernelShapes
from loraplex.kernels.prefill_sdpa import paged_attention_prefill_sdpa
from loraplex.kernels.sources import KERNEL_DIR

EXPORTED = [
    "copy_blocks", "lora_expand_bgmv", "lora_expand_sgmv", "lora_shrink_bgmv", "lora_shrink_sgmv",
    "paged_attention_decode", "paged_attention_prefill", "write_kv",
]
LAUNCHERS = {
    "lora_shrink_bgmv": lora_launch, "lora_shrink_sgmv": lora_launch, "lora_expand_bgmv": lora_launch,
    "lora_expand_sgmv": lora_launch, "paged_attention_decode": decode_launch,
    "paged_attention_prefill": prefill_launch,
}


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_signature_equals_reference(name):
    assert inspect.signature(getattr(kernels, name)) == inspect.signature(getattr(reference, name))


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_takes_the_reference_arguments_first(name):
    launcher = inspect.signature(getattr(LAUNCHERS[name], name)).parameters
    ref = inspect.signature(getattr(reference, name)).parameters
    assert list(launcher)[: len(ref)] == list(ref)
    assert all(p.kind is p.KEYWORD_ONLY for p in list(launcher.values())[len(ref) :])


def test_cpu_tensors_use_the_reference_without_importing_cupy():
    code = (
        "import sys, torch\n"
        "import loraplex.kernels as k\n"
        "x = torch.randn(3, 8); a = torch.randn(2, 4, 8)\n"
        "k.lora_shrink_bgmv(x, a, torch.tensor([0, -1, 1], dtype=torch.int32), torch.tensor([4, 2]))\n"
        "q = torch.randn(1, 2, 32); kv = torch.randn(2, 4, 2, 32)\n"
        "k.paged_attention_decode(q, kv, kv, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5]), 0.1)\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "assert 'cupy_backends' not in sys.modules, 'cupy_backends imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_dispatch_returns_reference_results():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen)
    a = torch.randn(2, 4, 16, generator=gen)
    slots = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    ranks = torch.tensor([4, 2], dtype=torch.int32)
    assert torch.equal(kernels.lora_shrink_bgmv(x, a, slots, ranks), reference.lora_shrink_bgmv(x, a, slots, ranks))


def _cu_constant(source: str, name: str) -> int:
    match = re.search(rf"constexpr int {name} = (\d+);", (KERNEL_DIR / source).read_text())
    assert match, f"{name} not found in {source}"
    return int(match.group(1))


def test_launcher_constants_match_kernel_sources():
    assert lora_launch.SHRINK_WARPS == _cu_constant("lora.cu", "kShrinkWarps")
    assert lora_launch.EXPAND_THREADS == _cu_constant("lora.cu", "kExpandThreads")
    assert lora_launch.BGMV_TILE == _cu_constant("lora.cu", "kBgmvTile")
    assert lora_launch.SGMV_TILE == _cu_constant("lora.cu", "kSgmvTile")
    assert decode_launch.THREADS == 32 * _cu_constant("paged_attention_decode.cu", "kWarps")
    prefill = (KERNEL_DIR / "paged_attention_prefill.cu").read_text()
    assert "BQ = D <= 128 ? 16 : 8;" in prefill
    assert [prefill_launch.queries_per_block(d) for d in (64, 128, 256)] == [16, 16, 8]
    assert prefill_launch.THREADS == 32 * int(re.search(r"WARPS = (\d+);", prefill).group(1))


# ---- routing: kernel, shim, torch path -----------------------------------------------------


def _decode_args():
    gen = torch.Generator().manual_seed(1)
    q, kv = torch.randn(2, 4, 32, generator=gen), torch.randn(6, 4, 2, 32, generator=gen)
    return q, kv, kv, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32), 0.2


@pytest.fixture
def as_if_cuda(monkeypatch):
    """CPU tensors treated as CUDA ones (kernels run); launchers record their calls instead of running."""
    launched = []
    monkeypatch.setattr(dispatch, "uses_kernels", lambda device: True)
    monkeypatch.setattr(dispatch, "launcher", lambda name: lambda *a, **kw: launched.append((name, kw)))
    return launched


def test_disabled_op_takes_the_reference_where_kernels_run(monkeypatch, as_if_cuda):
    monkeypatch.setattr(preconditions, "reason", lambda op, shapes: "off" if op == "paged_attention_decode" else None)
    args = _decode_args()
    assert torch.equal(kernels.paged_attention_decode(*args), reference.paged_attention_decode(*args))
    x, a = torch.randn(3, 8), torch.randn(2, 4, 8)
    kernels.lora_shrink_bgmv(x, a, torch.tensor([0, -1, 1], dtype=torch.int32), torch.tensor([4, 2]))
    assert [name for name, _ in as_if_cuda] == ["lora_shrink_bgmv"]


def test_enabled_ops_launch_with_a_runner_and_the_prefill_kernel_off_cuda(as_if_cuda):
    args = _decode_args()
    kernels.paged_attention_decode(*args)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    kernels.paged_attention_prefill(*args[:4], cu, args[4], args[5])
    (decode, decode_kw), (prefill, prefill_kw) = as_if_cuda
    assert (decode, prefill) == ("paged_attention_decode", "paged_attention_prefill")
    assert set(decode_kw) == {"runner"} and prefill_kw["impl"] == "kernel"


def test_call_shapes_feed_the_model_shapes():
    args = _decode_args()
    assert dispatch.call_shapes("paged_attention_decode", args) == KernelShapes(torch.float32, 32, 4, 2)
    assert dispatch.call_shapes("write_kv", args[1:]) == KernelShapes(torch.float32, 32, 0, 2)
    assert dispatch.call_shapes("lora", (args[0].half(),)) == KernelShapes(torch.float16)


def test_torch_path_is_sdpa_for_prefill_on_cuda_else_the_reference():
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    assert dispatch.torch_path("paged_attention_prefill", cuda) is paged_attention_prefill_sdpa
    assert dispatch.torch_path("paged_attention_prefill", cpu) is reference.paged_attention_prefill
    assert dispatch.torch_path("paged_attention_decode", cuda) is reference.paged_attention_decode


def test_shim_mode_runs_cpu_tensors_through_the_kernels(monkeypatch, cpu):
    monkeypatch.setattr(dispatch, "MODE", "shim")
    names = []
    launch = cpu_runner.CpuRunner.launch
    counting = lambda self, family, name, *rest: names.append(name) or launch(self, family, name, *rest)  # noqa: E731
    monkeypatch.setattr(cpu_runner.CpuRunner, "launch", counting)
    args = _decode_args()
    torch.testing.assert_close(kernels.paged_attention_decode(*args), reference.paged_attention_decode(*args))
    assert names == ["paged_decode<float, 32, 2>"]


@pytest.mark.parametrize("value,mode", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("shim", "shim")])
def test_mode_from_the_environment(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(dispatch.ENV, raising=False)
    else:
        monkeypatch.setenv(dispatch.ENV, value)
    assert dispatch.read_mode() == mode


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "gpu")
    with pytest.raises(ValueError, match="LORAPLEX_KERNELS='gpu' is not one of auto, reference, shim"):
        dispatch.read_mode()
