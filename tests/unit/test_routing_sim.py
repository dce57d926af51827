"""benchmarks/routing_sim.py's invariants on a tiny fleet with made-up costs: each request served once, whole;
a router that piles everything on one replica is worse; the pieces behave as the policies they model."""

from __future__ import annotations

import json

import pytest

from scripts import BENCHMARKS, load_benchmark

sim = load_benchmark("routing_sim")

COSTS = {  # seconds; a made-up replica, not a measurement
    "engine": {"max_loras": 2, "max_cpu_loras": 4, "max_num_seqs": 8, "max_num_batched_tokens": 256,
               "block_size": 16, "kv_blocks": 64},
    "step_seconds": [{"batch": b, "adapters": a, "seconds": 0.01 + 0.002 * b + 0.001 * a}
                     for b in (1, 2, 4, 8) for a in (0, 1, 2) if a <= b],
    "prefill_seconds_per_token": 0.0002,
    "slot_load_seconds": {"8": 0.002, "64": 0.004},
    "disk_read_seconds": {"8": 0.01, "64": 0.03},
}


def run(policy, rate: float = 40.0, requests: int = 300, trace: list | None = None) -> dict:
    workload = sim.Workload(adapters=40, alpha=1.0, tenants=6, prompt_tokens=24, output_tokens=8, seed=3)
    return sim.simulate(policy, sim.Costs(COSTS), workload, replicas=4, requests=requests, rate=rate, trace=trace)


@pytest.mark.parametrize("policy", sim.POLICIES)
def test_every_request_is_served_once_and_whole(policy):
    trace = []
    result = run(policy, trace=trace)
    assert result["completions"] == result["served"] == len(trace) == 300
    assert len({r.rid for r in trace}) == 300
    for r in trace:
        assert 0 <= r.replica < 4
        assert r.arrival < r.first_token <= r.finished
        assert r.output == r.generated and r.blocks == 0 and not r.pinned  # ended: no KV, no slot pin held
    assert result["slot_loads_per_request"] > 0 and result["ttft_p99_s"] >= result["ttft_p50_s"] > 0


def test_one_replica_for_everything_is_worse_than_round_robin():
    def always_first(request, fleet):
        return 0

    piled, spread = run(always_first), run("round_robin")
    assert piled["busiest_replica_share"] == 1.0 and spread["busiest_replica_share"] == 0.25
    assert piled["ttft_p99_s"] > 2 * spread["ttft_p99_s"]
    assert piled["throughput_tok_s"] < spread["throughput_tok_s"]


def test_step_costs_interpolate_and_never_fall():
    costs = sim.Costs({**COSTS, "step_seconds": [
        {"batch": 1, "adapters": 0, "seconds": 0.010}, {"batch": 1, "adapters": 1, "seconds": 0.012},
        {"batch": 4, "adapters": 0, "seconds": 0.020}, {"batch": 4, "adapters": 1, "seconds": 0.018},  # noise
        {"batch": 8, "adapters": 0, "seconds": 0.030}, {"batch": 8, "adapters": 1, "seconds": 0.034}]})
    assert costs.step(4, 1) == pytest.approx(0.020)  # made monotone: never cheaper with an adapter more
    assert costs.step(2, 0) == pytest.approx(0.010 + (0.020 - 0.010) / 3)
    assert costs.step(16, 1) == pytest.approx(0.034 + (0.034 - 0.020) / 4 * 8)  # the last slope, past the grid
    assert costs.step(8, 5) == costs.step(8, 1)  # past the measured adapter counts: the last one
    assert costs.slot_seconds(16) == 0.002 and costs.read_seconds(48) == 0.03  # the nearest measured rank
    assert sim.Costs(COSTS).scaled(0.5).step(1, 0) == pytest.approx(0.006)


def test_ring_keeps_a_key_on_its_replica_until_it_is_overloaded():
    ring = sim.Ring(4, balance_factor=125)
    home = ring.pick("tenant-7", [0, 0, 0, 0])
    assert all(ring.pick("tenant-7", [0, 0, 0, 0]) == home for _ in range(3))
    load = [1, 1, 1, 1]
    load[home] = 9  # 12 active, slots = ceil(ceil(13 * 1.25) / 4) = 5
    assert ring.pick("tenant-7", load) != home
    assert sim.Ring(4, balance_factor=0).pick("tenant-7", load) == home  # no bound: pure affinity
    assert len({ring.pick(f"tenant-{i}", [0] * 4) for i in range(64)}) == 4


def test_picker_scores_follow_the_extension():
    scrape = sim.Scrape
    replicas = [scrape(0, 0.0, frozenset({5}), frozenset()),  # running the adapter
                scrape(0, 0.0, frozenset({1}), frozenset()),  # room for it (2 < max_lora 3)
                scrape(0, 0.0, frozenset({1, 2}), frozenset({5})),  # full, the adapter waiting
                scrape(0, 0.0, frozenset({1, 2}), frozenset({3}))]  # full
    lora = sim.picker_scores(replicas, 5, max_lora=3, lora_weight=1.0, queue_weight=0.0, kv_weight=0.0)
    assert lora == pytest.approx([1.0, 0.8, 0.6, 0.0])
    busy = [scrape(4, 0.5), scrape(0, 0.0), scrape(2, 0.25)]
    assert sim.picker_scores(busy, 5, 3, 0.0) == pytest.approx([2 * 0 + 2 * 0.5, 2 * 1 + 2 * 1, 2 * 0.5 + 2 * 0.75])


def test_the_committed_costs_were_measured_and_load():
    data = json.loads((BENCHMARKS / "data" / "routing_costs.json").read_text())
    costs = sim.Costs(data)
    assert {"command", "commit", "date", "model"} <= set(data["measured"])
    assert set(costs.slot_load) == set(costs.disk_read) == {8, 16, 32, 64}
    assert all(costs.step(b, a) > 0 for b in (1, 8, 64) for a in (0, 1, 8))
    assert sim.Shape.from_costs(costs).kv_blocks == data["engine"]["kv_blocks"]
