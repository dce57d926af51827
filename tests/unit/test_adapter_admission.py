"""Adapter-aware admission (``adapter_admission="resident_first"``) and waiting for adapter reads.

A request whose adapter would take another adapter's device slot is passed over while
requests whose adapters are resident go first, at most ``max_adapter_wait_steps`` steps or
``max_adapter_wait_seconds`` after its arrival; a request whose adapter must be read from
disk waits in the queue (the engine reads it off the loop thread) while others run.
"""

from __future__ import annotations

from scheduler_harness import Harness


def ids(seqs):
    return [s.request.request_id for s in seqs]


def _a_resident_b_pinned(policy: str, **kw) -> Harness:
    """Two slots: B pinned by a long request, A resident and unpinned (its request ended)."""
    h = Harness(num_blocks=64, block_size=4, adapter_slots=2, adapter_admission=policy, **kw)
    h.add("b1", 3, max_tokens=30, lora="B")
    h.add("a1", 3, max_tokens=1, lora="A")
    assert ids(h.step().admitted) == ["b1", "a1"]
    assert h.adapters.resident == {"B": [0, 1], "A": [1, 0]}
    return h


def test_resident_adapter_goes_before_one_that_would_evict():
    h = _a_resident_b_pinned("resident_first")
    h.add("c1", 3, max_tokens=2, lora="C")
    h.add("a2", 3, max_tokens=2, lora="A")
    assert ids(h.step().admitted) == ["a2"]  # c1 would evict A, which a2 then wants: a2 first, c1 waits
    assert h.requests["c1"][0].adapter_skips == 1 and h.adapters.loads == ["B", "A"]
    h.run()
    assert h.adapters.loads == ["B", "A", "C"]
    for rid in ("b1", "a1", "a2", "c1"):
        assert h.streamed[(rid, 0)] == h.expected(rid)
    h.assert_idle_and_clean()


def test_policy_admission_evicts_in_queue_order():
    h = _a_resident_b_pinned("policy")
    h.add("c1", 3, max_tokens=2, lora="C")
    h.add("a2", 3, max_tokens=2, lora="A")
    assert ids(h.step().admitted) == ["c1"]  # c1 evicts A; a2 must reload it later
    h.run()
    assert h.adapters.loads == ["B", "A", "C", "A"]
    h.assert_idle_and_clean()


def test_deferred_requests_are_admitted_after_the_resident_ones_in_the_same_step():
    h = Harness(num_blocks=64, block_size=4, adapter_slots=3, adapter_admission="resident_first")
    h.add("b1", 3, max_tokens=30, lora="B")
    h.add("a1", 3, max_tokens=1, lora="A")
    h.add("d1", 3, max_tokens=1, lora="D")
    h.step()
    h.add("c1", 3, max_tokens=2, lora="C")  # evicts one of A, D: the one nobody waiting wants
    h.add("a2", 3, max_tokens=2, lora="A")
    assert ids(h.step().admitted) == ["a2", "c1"]
    assert set(h.adapters.resident) == {"B", "A", "C"}
    h.run()
    h.assert_idle_and_clean()


def _starved(**kw) -> tuple[Harness, list[str]]:
    """c1 would evict A every step while a new A request arrives each step; returns the admission per step."""
    h = _a_resident_b_pinned("resident_first", max_num_seqs=2, **kw)
    h.add("c1", 3, max_tokens=2, lora="C")
    steps = []
    for i in range(6):
        h.add(f"a{i + 2}", 3, max_tokens=1, lora="A")
        steps.append(ids(h.step().admitted))
        h.now += 0.6
        if "c1" in steps[-1]:
            break
    return h, steps


def test_a_passed_over_request_is_admitted_after_max_adapter_wait_steps():
    h, steps = _starved(max_adapter_wait_steps=2, max_adapter_wait_seconds=100.0)
    assert steps == [["a2"], ["a3"], ["c1"]]  # passed over twice, then in queue order (it evicts A)
    assert h.requests["c1"][0].adapter_skips == 2
    h.run()
    h.assert_idle_and_clean()


def test_a_passed_over_request_is_admitted_after_max_adapter_wait_seconds():
    h, steps = _starved(max_adapter_wait_steps=100, max_adapter_wait_seconds=1.0)
    assert steps == [["a2"], ["a3"], ["c1"]]  # at t=0 and 0.6 passed over; at 1.2 over the bound
    h.run()
    h.assert_idle_and_clean()


def test_fair_share_still_serves_a_tenant_whose_adapters_are_cold():
    """Tenant y's requests all want resident A; tenant x's each want a new adapter (evicting A).

    x is passed over at most max_adapter_wait_steps steps per request, so it keeps being
    served; with fair share its counter stays lowest while it waits, so it is first once due.
    """
    bound = 3
    h = Harness(num_blocks=256, block_size=4, adapter_slots=2, max_num_seqs=3, max_adapter_wait_steps=bound,
                max_adapter_wait_seconds=100.0, adapter_admission="resident_first")
    h.add("b", 3, max_tokens=60, lora="B", tenant="z")
    for i in range(12):
        h.add(f"y{i}", 3, max_tokens=2, lora="A", tenant="y")
        if i < 4:
            h.add(f"x{i}", 3, max_tokens=2, lora=f"C{i}", tenant="x")
    h.run()
    for i in range(4):
        assert h.streamed[(f"x{i}", 0)] == h.expected(f"x{i}")
    assert h.started.index("x3") < h.started.index("y7")  # x is served alongside y, not left for last
    h.assert_idle_and_clean()


def test_a_request_whose_adapter_is_being_read_waits_while_others_run():
    h = Harness(num_blocks=64, block_size=4, adapter_slots=2)
    reads = []
    h.sched.read_adapter = lambda request: reads.append(request.adapter_key) or True
    h.adapters.unread.add("C")
    h.add("c1", 3, max_tokens=2, lora="C")
    h.add("a1", 3, max_tokens=2, lora="A")
    assert ids(h.step().admitted) == ["a1"] and reads == ["C"]
    assert h.requests["c1"][0].adapter_skips == 0  # waiting for a read is not waiting for a slot
    h.adapters.unread.clear()  # the read was adopted into host memory
    assert ids(h.step().admitted) == ["c1"]
    h.run()
    h.assert_idle_and_clean()


def test_without_a_reader_acquire_reads_at_admission():
    h = Harness(num_blocks=64, block_size=4, adapter_slots=2)
    h.sched.read_adapter = lambda request: False  # no loop thread: exact step counts, read where acquired
    h.adapters.unread.add("C")
    h.add("c1", 3, max_tokens=2, lora="C")
    assert ids(h.step().admitted) == ["c1"]
    h.run()
    h.assert_idle_and_clean()
