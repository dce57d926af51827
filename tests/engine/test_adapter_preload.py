"""A cold adapter is read on a worker thread: the loop serves everyone else meanwhile.

The engine runs its own loop thread (as under Triton). The read of demo-b is held on an
event, planted in ``AdapterManager.read``: while it is held, a running request keeps
producing tokens; afterwards the waiting request equals peft exactly. Aborting or
shutting down while the read is held still ends the request once, and nothing leaks.
"""

from __future__ import annotations

import queue
import threading

from test_containment import (add_good, assert_exact, assert_idle, collect, engine_factory,  # noqa: F401 - fixtures
                              reference, request)

from loraplex.engine.request import SamplingParams


def held_read(engine):
    """Make reads of demo-b wait for the returned event; returns (event, started)."""
    release, started = threading.Event(), threading.Event()
    read = engine.adapters.read

    def slow_read(name, folder):
        if name == "demo-b":
            started.set()
            assert release.wait(60)
        return read(name, folder)

    engine.adapters.read = slow_read
    engine.preloader._read = slow_read
    return release, started


def start(engine):
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    engine.on_outputs = lambda outs: [delivered.put(o) for o in outs]
    engine.start()
    return delivered


def test_a_running_request_keeps_streaming_while_an_adapter_is_read(engine_factory, reference):
    engine = engine_factory()
    release, started = held_read(engine)
    delivered = start(engine)
    try:
        long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, lora_name="demo-a")
        engine.add_request(engine.make_request("long", "The quick brown fox", long))
        first = delivered.get(timeout=60)  # demo-a is in memory and streaming
        engine.add_request(request(engine, "cold", "LoRA adapters", "demo-b"))
        assert started.wait(30)
        during = [delivered.get(timeout=30) for _ in range(5)]  # five more steps while demo-b is being read
        assert {o.request_id for o in [first, *during]} == {"long"} and not any(o.finished for o in during)
        assert engine.num_waiting_requests() == 1  # counted as waiting meanwhile
        release.set()
        outputs = collect(delivered, 2)
    finally:
        release.set()
        engine.stop()
    outputs["long"] = [first, *during, *outputs["long"]]
    assert_exact(engine, outputs, "cold", "LoRA adapters", "demo-b", reference)
    assert sum(len(o.token_ids) for o in outputs["long"]) == 60
    assert engine.adapters.loads_from_disk == 2 and "demo-b" in engine.adapters.host_names()
    assert_idle(engine)


def test_abort_and_shutdown_while_an_adapter_is_read_end_the_request_once(engine_factory, reference):
    engine = engine_factory()
    release, started = held_read(engine)
    delivered = start(engine)
    try:
        engine.add_request(request(engine, "aborted", "LoRA adapters", "demo-b"))
        assert started.wait(30)
        engine.abort("aborted")
        release.set()
        outputs = collect(delivered, 1)
        assert [o.finish_reason for o in outputs["aborted"]] == ["abort"]
        jobs = add_good(engine)  # demo-b is in memory now: everyone runs
        outputs = collect(delivered, len(jobs))
        for rid, prompt, lora in jobs:
            assert_exact(engine, outputs, rid, prompt, lora, reference)
        assert_idle(engine)
        engine.adapters.register("demo-b", engine.adapters._paths["demo-b"])  # cold again
        release.clear()
        started.clear()
        engine.add_request(request(engine, "at shutdown", "LoRA adapters", "demo-b"))
        assert started.wait(30)
        threading.Timer(0.5, release.set).start()
        ended = engine.shutdown()
    finally:
        release.set()
        engine.stop()
    assert [o.request_id for o in ended] == ["at shutdown"] and ended[0].finished
    assert "shutting down" in str(ended[0].error)
    assert delivered.empty() and engine._loading == {}
