"""The exported kernel API: reference on CPU, same signatures, CuPy never imported on CPU."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
import torch

import loraplex.kernels as kernels
from loraplex.kernels import decode_launch, lora_launch, prefill_launch, reference
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
