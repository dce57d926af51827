"""Adapter tiers under pressure: one device slot, one host place, three adapters.

With the engine's own loop thread (as under Triton), no adapter is ever read from disk on
that thread, even when a waiting request's adapter was pushed out of host memory by a later
one: it is read again off the loop while the request waits and others run; every output
equals peft's. The loop's snapshot and observations carry the per-tier gauges and the load
latency histograms (docs/metrics.md).
"""

from __future__ import annotations

import queue
import threading

from test_containment import assert_exact, assert_idle, collect, reference, request  # noqa: F401 - fixtures

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.stats import ADAPTER_LOAD, STEP_SECONDS


def tight_engine(demo, max_cpu_loras: int = 1) -> LLMEngine:
    """demo-c is demo-a's folder under another name (another adapter to the engine, the same oracle)."""
    lora = {"demo-a": str(demo["demo-a"]), "demo-b": str(demo["demo-b"]), "demo-c": str(demo["demo-a"])}
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora=lora, max_loras=1,
                                  max_cpu_loras=max_cpu_loras))


def record_reads(engine: LLMEngine) -> list[tuple[str, str]]:
    """(adapter, thread name) of every disk read, wherever it runs."""
    reads, read = [], engine.adapters.read

    def recorded(name, folder):
        reads.append((name, threading.current_thread().name))
        return read(name, folder)

    engine.adapters.read = recorded
    engine.preloader._read = recorded
    return reads


def oracle(engine, prompt, lora, reference):
    return reference(engine, prompt, "demo-a" if lora == "demo-c" else lora)


def test_no_disk_read_on_the_loop_thread_when_the_host_tier_is_full(demo, reference):
    engine = tight_engine(demo)
    reads = record_reads(engine)
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    engine.on_outputs = lambda outs: [delivered.put(o) for o in outs]
    engine.start()
    jobs = [("long", "The quick brown fox", "demo-a", 40), ("b1", "LoRA adapters", "demo-b", 12),
            ("c1", "Tenants", "demo-c", 12), ("b2", "Hello there", "demo-b", 12), ("base", "Hello there", None, 12)]
    try:
        for rid, prompt, lora, max_tokens in jobs:
            engine.add_request(request(engine, rid, prompt, lora, max_tokens=max_tokens))
        outputs = collect(delivered, len(jobs))
    finally:
        engine.stop()
    for rid, prompt, lora, max_tokens in jobs:
        outs = outputs[rid]
        assert all(o.error is None for o in outs) and outs[-1].finished, rid
        if max_tokens <= 12:  # the oracle's length
            assert [t for o in outs for t in o.token_ids] == oracle(engine, prompt, lora, reference), rid
    assert reads and all(thread != "loraplex-engine" for _, thread in reads), reads
    assert engine.adapters.host_evictions >= 1  # the host tier was too small for what waited
    assert_idle(engine)
    values = engine.snapshot()
    assert values[("adapters_resident", ("disk",))] == 3
    assert values[("adapters_resident", ("device",))] == 1 and values[("adapters_resident", ("host",))] == 1
    assert values[("adapters_loading", ("host",))] == 0
    assert values[("adapters_waiting", ("host",))] == values[("adapters_waiting", ("disk",))] == 0
    seen = engine.stats.drain()
    stages = {label for name, label, _ in seen if name == ADAPTER_LOAD}
    assert stages == {"disk_read", "host_to_device"}
    assert len([1 for name, label, _ in seen if name == ADAPTER_LOAD and label == "disk_read"]) == len(reads)
    steps = [(label, value) for name, label, value in seen if name == STEP_SECONDS]
    assert {label for label, _ in steps} <= {"true", "false"} and "true" in {label for label, _ in steps}
    assert all(value > 0 for _, value in steps)


def test_waiting_adapters_are_counted_by_tier(demo, reference):
    """Stepped on the caller's thread (exact steps): b1 waits for the one slot, its adapter first in host memory,
    then (re-registered: its copies dropped) on disk."""
    engine = tight_engine(demo, max_cpu_loras=2)
    engine.add_request(request(engine, "long", "The quick brown fox", "demo-a", max_tokens=12))
    engine.add_request(request(engine, "b1", "LoRA adapters", "demo-b"))
    outputs: dict = {}
    for out in engine.step():
        outputs.setdefault(out.request_id, []).append(out)
    values = engine.snapshot()
    assert values[("adapters_waiting", ("host",))] == 1 and values[("adapters_waiting", ("disk",))] == 0
    engine.adapters.register("demo-b", engine.adapters._paths["demo-b"])
    values = engine.snapshot()
    assert values[("adapters_waiting", ("host",))] == 0 and values[("adapters_waiting", ("disk",))] == 1
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert_exact(engine, outputs, "long", "The quick brown fox", "demo-a", reference)
    assert_exact(engine, outputs, "b1", "LoRA adapters", "demo-b", reference)
    assert_idle(engine)


def test_the_loading_gauge_counts_distinct_adapters_in_flight():
    from loraplex.lora.preloader import AdapterPreloader

    release, delivered = threading.Event(), queue.SimpleQueue()

    def read(name, folder):
        assert release.wait(30)
        return name

    preloader = AdapterPreloader(read, lambda rid, preloaded: delivered.put((rid, preloaded)))
    for rid, name in (("r1", "a"), ("r2", "a"), ("r3", "b")):
        preloader.submit(rid, name, f"/adapters/{name}")
    assert preloader.loading() == 2  # a (twice) and b
    release.set()
    assert sorted(delivered.get(timeout=30) for _ in range(3)) == [("r1", "a"), ("r2", "a"), ("r3", "b")]
    assert preloader.loading() == 0
    preloader.close()
