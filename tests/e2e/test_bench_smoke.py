"""benchmarks/serving.py without servers: configurations, tables, W1's workload, the peers' batches.

Its measuring path (a real loraplex-serve under real AIPerf load, W1 against every peer)
runs end to end in tests/e2e/test_bench_suite.py, through `make bench`'s suite.
"""

from __future__ import annotations

import json

import pytest
from scripts import load_benchmark

serving = load_benchmark("serving")
COMMON_KNOBS = {"max_num_seqs": 8}  # not the default, harmless for 8 requests: the server must get it


def test_configurations_merge_the_common_knobs_under_their_own():
    parse = serving.build_parser().parse_args
    assert list(serving.chosen_configs(parse(["--quick"]))) == serving.QUICK_CONFIGS.split(",")
    assert list(serving.chosen_configs(parse([]))) == serving.DEFAULT_CONFIGS.split(",")
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


def test_w1_lengths_are_fixed_by_the_seed_long_tailed_and_sum_to_the_total():
    w1 = serving.W1_WORKLOAD
    requests = serving.w1_requests(w1)
    prompts, outputs = [len(text) + 1 for text, _ in requests], [n for _, n in requests]  # + BOS: one token a byte
    assert len(requests) == w1.requests and sum(outputs) == w1.output_total
    assert all(w1.prompt_tokens[0] <= n <= w1.prompt_tokens[1] for n in prompts)
    assert min(outputs) == w1.output_tokens[0] and max(outputs) == w1.output_tokens[1]
    assert sorted(outputs)[len(outputs) // 2] < sum(outputs) / len(outputs) / 2  # most short, a few long
    assert all(text.isascii() for text, _ in requests)
    assert serving.w1_requests(w1) == requests != serving.w1_requests(serving.dataclasses.replace(w1, seed=1))
    with pytest.raises(ValueError, match="cannot sum"):
        serving.long_tailed_lengths(4, 4, 8, 40, serving.random.Random(0))


def test_w1_serves_one_configuration_and_knows_its_peers():
    parse = serving.build_parser().parse_args
    assert list(serving.chosen_configs(parse(["--workload", "w1"]))) == ["continuous"]
    with pytest.raises(SystemExit, match="one configuration"):
        serving.chosen_configs(parse(["--workload", "w1", "--configs", "continuous,static"]))
    assert serving.chosen_peers(parse([])) == list(serving.PEERS)
    with pytest.raises(SystemExit, match="unknown peer"):
        serving.chosen_peers(parse(["--peers", "hf-static,vllm"]))


def test_the_w1_table_has_a_ratio_column_per_run_of_ours_and_names_skipped_peers():
    report = {"workload": {"peer_batch": 16}, "adapters": ["lora00", "lora01"],
              "ours": {"adapters": {"output_tokens_per_s": 300.0, "benchmark_duration_s": 6.8},
                       "base": {"output_tokens_per_s": 400.0, "benchmark_duration_s": 5.1}},
              "peers": {"peft-one-at-a-time": {"output_tokens_per_s": 100.0, "seconds": 20.4},
                        "hf-generate-batch": {"skipped": "no continuous batching"}}}
    rows = [line.split("  ") for line in serving.format_w1_table(report).splitlines()]
    rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert rows[0] == ["system", "useful out tok/s", "wall s", "ours adapters / it", "ours base / it"]
    assert rows[1] == ["ours through Triton, 2 adapters", "300.0", "6.8", "1.00x", "1.33x"]
    assert rows[2] == ["ours through Triton, base model", "400.0", "5.1", "0.75x", "1.00x"]
    assert rows[3] == ["peft, one adapter at a time, static batches of 16", "100.0", "20.4", "3.00x", "4.00x"]
    assert rows[4][1:] == ["-"] * 4 and rows[5] == ["hf-generate-batch: skipped: no continuous batching"]


def test_peers_batch_one_adapter_at_a_time_or_in_arrival_order():
    peers = serving.peers
    jobs = [peers.Job([1], 1, adapter) for adapter in ["a", "b", "a", None, "a", "b", "a"]]
    assert peers.batches_by_adapter(jobs, 2) == [[0, 2], [4, 6], [1, 5], [3]]
    assert peers.batches_in_arrival_order(jobs, 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_long_tailed_arrivals_keep_the_mean_and_the_shared_prefixes():
    args = serving.build_parser().parse_args(["--output-lengths", "long-tailed", "--rate", "8", "--requests", "40"])
    workload = serving.workload_from(args)
    requests = serving.long_tailed_requests(workload)
    lengths = sorted(n for _, n in requests)
    assert len(requests) == 40 and sum(lengths) == 40 * workload.output_tokens
    assert serving.LONG_TAIL[0] <= lengths[0] and lengths[-1] <= serving.LONG_TAIL[1]
    assert lengths[len(lengths) // 2] < workload.output_tokens < lengths[-1] / 2  # most short, a few long
    prefixes = {text[:workload.prefix_tokens] for text, _ in requests}
    assert len(prefixes) == workload.prefix_prompts
    assert requests == serving.long_tailed_requests(workload)  # fixed by the seed
    flags = serving.arrival_load_flags(serving.Path("d.jsonl"), workload)
    assert flags[flags.index("--request-rate") + 1] == "8.0" and "poisson" in flags
