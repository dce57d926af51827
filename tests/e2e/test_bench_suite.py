"""`make bench`'s suite, --quick, end to end: real loraplex-serve processes under real AIPerf load.

Every part at a tiny size: W1 (our server over its adapters, then every in-process peer on
the prompts AIPerf sent), continuous against static batching at two offered rates on one
server each, the prefix cache on and off, the model families, quantized bases' quality and
throughput (issue 41); then the goals table, the plots (matplotlib in AIPerf's virtualenv)
and the generated docs section, into a copy of docs/benchmarks.md.
Checks the figures' shape only, never a timing. Skipped where AIPerf is not installed
(`make bench` and `make test` install it into .cache/aiperf-venv).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from scripts import BENCHMARKS, load_benchmark

suite = load_benchmark("suite")
serving = suite.serving
needs_aiperf = pytest.mark.skipif(
    not serving.DEFAULT_AIPERF.exists(),
    reason=f"aiperf is not installed at {serving.DEFAULT_AIPERF} (`make bench` installs it)")


def served(result: dict, requests: int) -> None:
    """One AIPerf run: every request answered in full, its latencies kept for the CDFs."""
    assert result["request_count"] == requests and result["errors"] == 0
    assert result["output_tokens"] == result["output_tokens_asked"] > 0 and result["output_tokens_per_s"] > 0
    assert len(result["ttft_ms_all"]) == len(result["e2e_ms_all"]) == requests


@needs_aiperf
def test_quick_suite_measures_every_goal_and_writes_plots_and_the_docs_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    shutil.copy(suite.ROOT / "docs" / "benchmarks.md", doc)
    out, plots = tmp_path / "suite.json", tmp_path / "plots"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "suite.py"), "--quick", "--json", str(out),
                          "--artifacts", str(tmp_path / "artifacts"), "--docs", str(doc), "--plots-dir", str(plots)],
                         check=True, timeout=1200, stdout=subprocess.PIPE, text=True)
    report = json.loads(out.read_text())
    assert list(report["parts"]) == list(suite.PARTS) and report["quick"]

    w1, workload = report["parts"]["w1"], serving.QUICK_W1_WORKLOAD
    ours = w1["ours"]["adapters"]
    assert list(w1["ours"]) == ["adapters"] and len(w1["adapters"]) == workload.adapters
    assert ours["request_count"] == workload.requests and ours["errors"] == 0
    assert ours["output_tokens"] == ours["output_tokens_asked"] == workload.output_total
    assert list(w1["peers"]) == list(serving.PEERS)
    measured = {name: peer for name, peer in w1["peers"].items() if "skipped" not in peer}
    assert set(w1["peers"]) - set(measured) <= {"hf-generate-batch"}  # only where transformers lacks it
    for peer in measured.values():
        assert peer["useful_tokens"] == peer["tokens_asked"] == workload.output_total
    assert w1["table"].startswith("system") and "ours through Triton" in w1["table"]

    batching = report["parts"]["batching"]
    runs = {(r["config"], r["rate"]) for r in batching["results"]}
    assert runs == {(c, rate) for c in ("continuous", "static") for rate in suite.QUICK_RATES}
    for result in batching["results"]:
        served(result, suite.QUICK_BATCHING.requests)
        assert result["engine_config"] == serving.CONFIGURATIONS[result["config"]]

    on, off = report["parts"]["prefix"]["results"]
    assert (on["config"], off["config"]) == ("continuous", "no-prefix-cache")
    for result in (on, off):
        served(result, suite.QUICK_PREFIX.requests)
    assert 0 < on["prefill_tokens"] <= off["prefill_tokens"]

    fams = report["parts"]["families"]
    assert [r["family"] for r in fams["rows"]] == suite.families.QUICK_FAMILIES.split(",")
    assert all(r[f"ms_b{b}"] > 0 for r in fams["rows"] for b in fams["batches"])

    quality = report["parts"]["quality"]
    assert [r["format"] for r in quality["rows"]] == ["fp32", "int8", "fp8-channel", "fp8-tensor", "int4-g128",
                                                     "int4-load"]
    assert [r["format"] for r in quality["engine_rows"]] == ["fp32", "int8"]
    assert all(r["ppl"] > 0 and len(r["first_divergence"]) == quality["prompts"]
               for r in quality["rows"] + quality["engine_rows"])
    served_quantized = {(r["workload"], r["server"]) for r in report["parts"]["quantized"]["runs"]}
    assert served_quantized == {(w, s) for w in ("single", "mixed x2") for s in ("int8", "fp16")}

    goals = {g["key"]: g for g in report["goals"]}
    assert set(goals) == set(suite.GOALS) - {"int8-llama"}  # --quick starts no llama.cpp
    assert all(g["measured"] > 0 and g["met"] == (g["measured"] >= g["asked"]) for g in goals.values())
    assert run.stdout.count("\n| ") >= len(goals)  # the goals table, printed

    assert sorted(p.name for p in plots.iterdir()) == ["latency_cdf.png", "throughput_vs_load.png"]
    text = doc.read_text()
    section = text[text.index(suite.BEGIN):text.index(suite.END)]
    assert "## The latest `make bench`" in section and "--quick" in section
    assert "](plots/throughput_vs_load.png)" in section and "](plots/latency_cdf.png)" in section
    assert "### Model families (issue 40)" in section and "| qwen3-moe |" in section
    assert "### Quantized bases: quality (issue 41)" in section and "### Quantized bases: throughput" in section
    original = (suite.ROOT / "docs" / "benchmarks.md").read_text()
    after = original[original.index(suite.END):]
    assert text.count(suite.BEGIN) == 1 and text.endswith(after)  # the per-script sections after it stay as they were
    suite.main(["--from-json", str(out), "--docs", str(doc), "--plots-dir", str(plots)])
    assert doc.read_text() == text  # regenerated in place, not added again


def test_goals_pick_one_offered_load_for_all_three_batching_ratios():
    def result(config, rate, tok_s, ttft_p99, e2e_mean):
        return {"config": config, "rate": rate, "output_tokens_per_s": tok_s, "ttft_p99_ms": ttft_p99,
                "e2e_mean_ms": e2e_mean}

    part = {"rates": [16.0, 64.0], "results": [
        result("continuous", 16.0, 100, 10, 10), result("static", 16.0, 100, 200, 100),  # 1x, 20x, 10x
        result("continuous", 64.0, 300, 10, 10), result("static", 64.0, 100, 60, 40)]}  # 3x, 6x, 4x
    goals = {g["key"]: g for g in suite.measured_goals({"batching": part})}
    assert {k: g["measured"] for k, g in goals.items()} == {"throughput": 3.0, "ttft-p99": 6.0, "e2e-mean": 4.0}
    assert all(g["met"] and g["where"] == "64 requests/s" for g in goals.values())
