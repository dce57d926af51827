"""benchmarks/serving.py --quick end to end: a real loraplex-serve process under real AIPerf load.

Checks the results' shape only (the configuration, the requests asked for, no errors,
positive throughput), never timings. Skipped where AIPerf is not installed (`make bench`
installs it into .cache/aiperf-venv). --quick serves one configuration: what more of them
would add (their knobs merged and handed to the server, the table's ratio rows) is checked
here without servers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from scripts import BENCHMARKS, load_benchmark

serving = load_benchmark("serving")
COMMON_KNOBS = {"max_num_seqs": 8}  # not the default, harmless for 8 requests: the server must get it


@pytest.mark.skipif(not serving.DEFAULT_AIPERF.exists(),
                    reason=f"aiperf is not installed at {serving.DEFAULT_AIPERF} (`make bench` installs it)")
def test_quick_run_measures_its_configuration(tmp_path):
    out = tmp_path / "serving.json"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "serving.py"), "--quick", "--json", str(out),
                          "--engine-config", json.dumps(COMMON_KNOBS), "--artifacts", str(tmp_path / "artifacts")],
                         check=True, timeout=600, stdout=subprocess.PIPE, text=True)
    report = json.loads(out.read_text())
    names = serving.QUICK_CONFIGS.split(",")
    assert [r["config"] for r in report["results"]] == names and report["baseline"] == names[0]
    for result in report["results"]:
        assert result["engine_config"] == {**COMMON_KNOBS, **serving.CONFIGURATIONS[result["config"]]}
        assert result["request_count"] == serving.QUICK_WORKLOAD.requests
        assert result["errors"] == 0
        assert result["output_tokens"] == result["output_tokens_asked"] > 0
        assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0
    table = run.stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[0] == "configuration" and [row.split()[0] for row in table[1:]] == names


def test_configurations_merge_the_common_knobs_under_their_own():
    parse = serving.build_parser().parse_args
    assert list(serving.chosen_configs(parse(["--quick"]))) == serving.QUICK_CONFIGS.split(",")
    assert list(serving.chosen_configs(parse([]))) == list(serving.CONFIGURATIONS)
    args = parse(["--quick", "--configs", "continuous,static", "--engine-config",
                  json.dumps({"batching": "continuous", **COMMON_KNOBS})])
    assert serving.chosen_configs(args) == {"continuous": {"batching": "continuous", **COMMON_KNOBS},
                                            "static": {"batching": "static", **COMMON_KNOBS}}
    with pytest.raises(SystemExit, match="unknown configuration"):
        serving.chosen_configs(parse(["--configs", "continuous,nope"]))


def test_each_configuration_hands_its_knobs_to_the_server(tmp_path):
    knobs = {"batching": "static", **COMMON_KNOBS}
    launcher = serving.Launcher(["--model", "tiny"], knobs, tmp_path / "store", tmp_path / "serve.log")
    command = launcher.command
    assert json.loads(command[command.index("--engine-config") + 1]) == knobs
    assert command[command.index("--adapter-store") + 1] == str(tmp_path / "store")
    ports = {command[command.index(flag) + 1] for flag in ("--http-port", "--grpc-port", "--metrics-port")}
    assert len(ports) == 3


def test_the_table_has_a_ratio_row_per_configuration_after_the_baseline():
    def result(name, scale):
        return {"config": name, **{key: scale * 10.0 for key, *_ in serving.COLUMNS}, "itl_p50_ms": None}

    lines = serving.format_table([result("continuous", 1), result("static", 2), result("no-prefix-cache", 3)])
    rows = [line.split() for line in lines.splitlines()]
    assert [row[0] for row in rows] == ["configuration", "continuous", "static", "no-prefix-cache",
                                        "static", "no-prefix-cache"]
    assert rows[4][:3] == ["static", "/", "continuous"] and rows[5][:3] == ["no-prefix-cache", "/", "continuous"]
    itl = [heading for _, heading, *_ in serving.COLUMNS].index("ITL p50 ms")
    assert rows[4][3:] == ["2.00x"] * itl + ["-"] + ["2.00x"] * (len(serving.COLUMNS) - itl - 1)
    assert rows[5][3] == "3.00x" and rows[2][1 + itl] == "-"
