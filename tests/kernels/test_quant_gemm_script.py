"""benchmarks/quant_gemm.py: its options, byte counts, and one tiny run of every impl on the CPU shim."""

from __future__ import annotations

import math

import pytest
from scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("quant_gemm")


def test_defaults_are_the_8b_shapes_at_batches_1_16_64(bench):
    args = bench.parse_args([])
    assert args.shapes == ["4096x4096", "4096x14336", "14336x4096", "4096x128256"] and args.batches == [1, 16, 64]
    assert bench.parse_args(["--device", "cpu"]).shapes == ["96x80"]
    assert bench.shape_of("4096x128256") == (4096, 128256)


def test_bytes_are_the_formats(bench):
    m, k, n = 2, 256, 10
    activations = 2 * m * k + 2 * m * n
    assert bench.format_bytes("bf16", m, k, n) == 2 * n * k + activations
    assert bench.format_bytes("fp8", m, k, n) == n * k + 4 * n + activations
    assert bench.format_bytes("int4", m, k, n, group=128) == n * k // 2 + 3 * n * 2 + activations


def test_the_driver_runs_every_impl_on_the_shim(bench, cpu, tmp_path):
    out = tmp_path / "q.json"
    assert bench.main(["--device", "cpu", "--shapes", "64x24", "--batches", "1", "--iters", "1",
                       "--json", str(out)]) == 0
    report = __import__("json").loads(out.read_text())
    impls = {(r["format"], r["impl"]) for r in report["rows"]}
    assert impls == {("bf16", "torch"), *((f, i) for f in ("fp8", "int4") for i in ("auto", "gemv", "gemm", "dequant"))}
    assert len(report["numerics"]) == 8 and all(e["max_error"] < 1e-2 for e in report["numerics"])
    assert all(math.isnan(r["peak_fraction"]) and r["ms"] > 0 for r in report["rows"])
