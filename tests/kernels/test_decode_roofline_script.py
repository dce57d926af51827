"""benchmarks/decode_roofline.py: its byte counts, and a --tiny run on the CPU end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "decode_roofline.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_roofline")


def test_llama3_8b_step_bytes(bench):
    s = bench.LLAMA3_8B
    proj = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert bench.step_bytes(s, 1, 0, 0, 16) == (proj + 4096 * 128256) * 2  # ~16.1 GB: ~3.4 ms at 4.8 TB/s
    kv = 64 * 512 * 32 * 2 * 8 * 128
    lora = 8 * 16 * 32 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336) + 14336 + 4096)
    assert bench.step_bytes(s, 64, 512, 8, 16) == (proj + 4096 * 128256 + kv + lora) * 2
    assert bench.roofline_tokens_s(4_800_000_000, 4, 4800.0) == pytest.approx(4000.0)


def test_tiny_run_on_the_cpu(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--batches", "1", "3", "--adapters", "0", "2",
                    "--iters", "1", "--context", "20", "--json", str(out)], check=True, timeout=300)
    report = json.loads(out.read_text())
    rows = {(r["adapters"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(0, 1), (0, 3), (2, 1), (2, 3)} and report["shape"]["hidden"] == 64
    assert all(r["tokens_s"] > 0 and 0 < r["of_roofline"] and r["of_base"] > 0 for r in rows.values())
