"""benchmarks/gpu_kernels.py imports, parses its options and builds its shapes without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "gpu_kernels.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu_kernels")


def test_default_and_quick_options(bench):
    args = bench.parse_args([])
    assert args.batches == [64, 128, 256] and args.contexts == [512, 1024, 2048, 4096]
    assert args.ranks == [8, 16, 32, 64] and args.budget_s < 300
    quick = bench.parse_args(["--quick"])
    assert quick.batches == [64, 256] and quick.iters == 10


def test_shapes(bench):
    decode = bench.decode_shapes([64, 256], [512, 4096])
    assert [(s.batch, s.context) for s in decode] == [(64, 512), (64, 4096), (256, 512), (256, 4096)]
    assert {(s.num_q_heads, s.num_kv_heads, s.head_dim) for s in decode} == {(32, 8, 128)}
    bgmv = bench.bgmv_shapes([64], [8, 64])
    assert [s.ranks[0] for s in bgmv[:2]] == [8, 64] and set(bgmv[2].ranks) == {8, 64}
    assert all(len(s.ranks) == bench.NUM_ADAPTERS and s.hidden == 4096 for s in bgmv)


def test_byte_counts(bench):
    s = bench.DecodeShape(batch=2, context=10)
    assert bench.decode_bytes(s, 2) == 2 * 10 * 8 * 128 * 2 * 2 + 2 * 2 * 32 * 128 * 2
    b = bench.BgmvShape(batch=3, ranks=(8, 16), hidden=4096)
    assert bench.bgmv_bytes(b, [1], 2) == (3 * 4096 + 2 * 3 * 16 + 2 * 3 * 4096) * 2 + 2 * 16 * 4096 * 2


def test_out_path_follows_env(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.out_path(bench.parse_args([])) == tmp_path / "gpu_kernels.json"
    assert bench.out_path(bench.parse_args(["--out", "x.json"])) == Path("x.json")


def test_import_kernels_gives_the_dispatch_api(bench):
    assert hasattr(bench.import_kernels(), "paged_attention_decode")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_exits_with_message_without_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


def test_imports_kernels_from_the_checkout_when_not_installed():
    code = (
        "import sys, importlib.util\n"
        "sys.meta_path = [f for f in sys.meta_path if 'Editable' not in getattr(f, '__name__', type(f).__name__)]\n"
        f"spec = importlib.util.spec_from_file_location('bench', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['bench'] = m; spec.loader.exec_module(m)\n"
        "k = m.import_kernels()\n"
        f"assert k.__file__ == {str(SCRIPT.parents[1] / 'backend' / 'kernels' / '__init__.py')!r}, k.__file__\n"
        "from loraplex.kernels import decode_launch\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_lora_variant_options_and_bytes(bench):
    args = bench.parse_args([])
    assert args.lora_batches == [1, 16, 64, 256] and args.lora_rank == 16
    assert bench.parse_args(["--lora-batches"]).lora_batches == []  # the section skipped
    # two used slots of rank 16 on 8B's q/k/v: 3 A stacks of 16 x 4096, B of 16 x (4096 + 1024 + 1024), bf16
    assert bench.qkv_adapter_bytes([16, 16], 4096, (4096, 1024, 1024), 2) == 2 * 16 * (3 * 4096 + 6144) * 2


def test_lora_variants_run_on_the_shim(bench, cpu, monkeypatch):
    """The section's code runs end to end on the CPU shim (CPU tensors launch there; a stand-in timer: one call
    each, no figures)."""
    monkeypatch.setattr(bench.torch, "randn", lambda *shape, **kw: torch.zeros(*shape, **kw))  # fast, shapes only

    class OneCall:
        def ms(self, fn):
            fn()
            return 1.0

    rows = bench.bench_lora_variants([1, 2], 4, torch.float32, OneCall(), 1000.0, float("inf"), adapters=3,
                                     device="cpu")
    assert [r["batch"] for r in rows] == [1, 2] and rows[0]["splits"] >= 2 and rows[0]["group_hbm"] > 0
