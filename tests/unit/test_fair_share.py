"""Fair share (VTC) and max_concurrent_requests, model-free, through the real Scheduler.

The harness (tests/support/scheduler_harness.py) recounts the per-tenant state after every step,
so each test here also proves the counts never leak.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import Harness

from loraplex.sched import scheduler as scheduler_module
from loraplex.sched.fair_share import ActiveRequests, VirtualTokenCounter
from loraplex.engine.request import FinishReason


def ids(seqs):
    return [s.request.request_id for s in seqs]


def running_of(h: Harness, tenant: str) -> int:
    """Requests of a tenant holding a place: running, swapped or preempted."""
    held = [*h.sched.running, *h.sched.swapped, *(s for s in h.sched.waiting if s.num_preemptions)]
    return len({s.request.request_id for s in held if s.request.tenant == tenant})


# ---------------------------------------------------------------- the counter


def test_prompt_is_charged_at_first_admission_and_each_generated_token_in_update():
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    h.add("a", 6, max_tokens=3, tenant="acme")
    vtc = h.sched.vtc
    assert vtc.counters == {"acme": 0.0}
    h.step()  # first chunk (4 of 6 tokens): the whole prompt is charged now, once
    assert vtc.counters == {"acme": 6.0}
    h.step()  # last chunk + first token
    assert vtc.counters == {"acme": 7.0}
    h.step()
    assert vtc.counters == {"acme": 8.0}
    h.step()  # done: idle at the lift level (its own counter, the last admitted): dropped, level kept
    assert vtc.counters == {} and vtc.floor() == 9.0
    h.assert_idle_and_clean()


def test_weight_divides_the_charge_and_n_samples_are_all_charged():
    h = Harness(num_blocks=32, block_size=4)
    h.add("a", 8, max_tokens=3, n=2, tenant="heavy", weight=4)
    h.add("b", 8, max_tokens=3, tenant="other")  # keeps "heavy" from being the only one left
    h.add("c", 8, max_tokens=20, tenant="other")
    h.step()  # prompt once (8) + a token for each of 2 samples
    assert h.sched.vtc.counter("heavy") == (8 + 2) / 4
    h.step()
    assert h.sched.vtc.counter("heavy") == (8 + 4) / 4
    h.run()
    h.assert_idle_and_clean()


def test_preemption_does_not_charge_again():
    h = Harness(num_blocks=8, block_size=4, victim_policy="longest_first")
    h.add("a", 4, max_tokens=14)
    h.add("b", 4, max_tokens=14)
    while h.sched.num_preemptions == 0:
        h.step()
    h.run()
    assert h.sched.num_preemptions >= 1
    assert h.sched.vtc.floor() == 2 * (4 + 14)  # one tenant, charged exactly what it was served
    h.assert_idle_and_clean()


# ---------------------------------------------------------------- who goes next


def test_a_flooding_tenant_alternates_with_a_light_one():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1)
    for i in range(6):
        h.add(f"A{i}", 4, max_tokens=4, tenant="A")
    for i in range(2):
        h.add(f"B{i}", 4, max_tokens=4, tenant="B")
    h.run()
    assert h.started == ["A0", "B0", "A1", "B1", "A2", "A3", "A4", "A5"]
    h.assert_idle_and_clean()


def test_fair_share_off_is_arrival_order():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, fair_share="off")
    for i in range(6):
        h.add(f"A{i}", 4, max_tokens=4, tenant="A")
    for i in range(2):
        h.add(f"B{i}", 4, max_tokens=4, tenant="B")
    h.run()
    assert h.started == ["A0", "A1", "A2", "A3", "A4", "A5", "B0", "B1"]


def test_weights_split_the_served_tokens():
    h = Harness(num_blocks=256, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(30):
        h.add(f"A{i}", 4, max_tokens=8, tenant="A", weight=2)
        h.add(f"B{i}", 4, max_tokens=8, tenant="B", weight=1)
    while h.sched.waiting.has_tenant("A") and h.sched.waiting.has_tenant("B"):
        h.step()
    ratio = h.served["A"] / h.served["B"]
    assert 1.8 <= ratio <= 2.2, h.served
    vtc = h.sched.vtc
    assert abs(vtc.counter("A") - vtc.counter("B")) <= 12 + 3 * 8  # U: a prompt + what the batch generates
    h.run()
    h.assert_idle_and_clean()


@pytest.mark.parametrize("policy", ["priority", "sjf"])
def test_priority_and_sjf_order_requests_only_within_a_tenant(policy):
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, admission_policy=policy, sjf_aging_rate=0.0)
    for i in range(4):  # A sends "urgent" short requests; it must not starve B
        h.add(f"A{i}", 4, max_tokens=3 + (i % 2), priority=i % 2, tenant="A")
    h.add("B-late", 4, max_tokens=6, priority=9, tenant="B", arrival=0.0)
    h.add("B-first", 4, max_tokens=4, priority=1, tenant="B", arrival=1.0)
    h.run()
    # within A: priority 0 / the shorter first (A0, A2 before A1, A3); B interleaves; within B, B-first first
    assert h.started == ["A0", "B-first", "A2", "B-late", "A1", "A3"]
    h.assert_idle_and_clean()


def test_priority_without_fair_share_lets_one_tenant_starve_the_others():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, admission_policy="priority", fair_share="off")
    h.add("B0", 4, max_tokens=4, priority=1, tenant="B")
    for i in range(3):
        h.add(f"A{i}", 4, max_tokens=4, priority=0, tenant="A")
    h.run()
    assert h.started == ["A0", "A1", "A2", "B0"]


def test_preempted_sequences_resume_first_whatever_their_tenant():
    h = Harness(num_blocks=8, block_size=4, victim_policy="longest_first")
    h.add("a1", 4, max_tokens=14, tenant="A")
    h.add("a2", 4, max_tokens=14, tenant="A")
    while h.sched.num_preemptions == 0:
        h.step()
    victim = next(iter(h.sched.waiting))
    assert victim.num_preemptions == 1 and victim.request.tenant == "A"
    h.add("b", 4, max_tokens=2, tenant="B")
    assert h.sched.vtc.counter("B") == h.sched.vtc.counter("A")  # lifted to the last admitted: a tie
    assert ids(h.sched.waiting) == [victim.request.request_id, "b"]
    order = []
    while h.sched.has_work():
        order += [s.request.request_id for s in h.step().admitted]
    assert order[:2] == [victim.request.request_id, "b"]
    h.assert_idle_and_clean()


# ---------------------------------------------------------------- the lift


def test_a_returning_tenant_is_lifted_to_the_least_backlogged_counter():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1)
    for i in range(4):
        h.add(f"A{i}", 4, max_tokens=4, tenant="A")
    for _ in range(12):  # A0..A2 served: A's counter is 3 * 8 (+ the prompt of the one admitted)
        h.step()
    a = h.sched.vtc.counter("A")
    assert a >= 24
    h.add("B0", 4, max_tokens=4, tenant="B")  # B never seen: lifted to A's counter, no credit for its absence
    assert h.sched.vtc.counter("B") == a
    h.run()
    h.assert_idle_and_clean()


def test_with_none_backlogged_the_lift_is_the_last_admitted_tenants_counter():
    h = Harness(num_blocks=64, block_size=4)
    h.add("A0", 4, max_tokens=10, tenant="A")
    for _ in range(5):
        h.step()
    assert not h.sched.waiting and h.sched.vtc.counter("A") == 4 + 5
    h.add("B0", 4, max_tokens=2, tenant="B")
    assert h.sched.vtc.counter("B") == 9
    h.run()
    h.assert_idle_and_clean()


def test_a_tenant_with_running_requests_but_none_waiting_is_lifted_too():
    """As in the paper (a client not in the queue is lifted): running below its share banks no credit."""
    h = Harness(num_blocks=128, block_size=4, max_num_seqs=4)
    h.add("slow", 4, max_tokens=40, tenant="S")
    for i in range(12):
        h.add(f"A{i}", 4, max_tokens=8, tenant="A")
    for _ in range(20):
        h.step()
    s, a = h.sched.vtc.counter("S"), h.sched.vtc.counter("A")
    assert s < a and h.sched.vtc.counter("S") > 0  # S has one request running, none waiting
    h.add("S1", 4, max_tokens=8, tenant="S")
    assert h.sched.vtc.counter("S") == h.sched.waiting.level() == a  # A is the only backlogged tenant
    h.run()
    h.assert_idle_and_clean()


def test_a_returning_tenant_keeps_a_counter_above_the_level():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1)
    h.add("B0", 4, max_tokens=20, tenant="B")  # B is served a lot, then goes idle
    h.add("A0", 4, max_tokens=2, tenant="A")
    h.run()
    vtc = h.sched.vtc
    assert vtc.is_idle("B") and vtc.counter("B") == 24 and vtc.floor() == 6  # A was admitted last
    h.add("B1", 4, max_tokens=2, tenant="B")
    assert vtc.counter("B") == 24 and not vtc.is_idle("B")
    h.run()
    h.assert_idle_and_clean()


# ---------------------------------------------------------------- bounded state


@pytest.mark.parametrize("waves", [40, 400])
def test_one_shot_tenants_leave_bounded_state(waves):
    """Per-tenant state is what is waiting or started, plus at most max_idle idle counters."""
    h = Harness(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=256)
    vtc = h.sched.vtc
    vtc.max_idle = 32
    for wave in range(waves):
        for i in range(3):
            h.add(f"r{wave}-{i}", 2, max_tokens=1 + i % 5, tenant=f"one-shot-{wave}-{i}", max_concurrent=1)
        h.step()
        busy = {s.request.tenant for s in h.sched.waiting} | set(h.sched.active.counts)
        assert set(vtc.counters) - busy == set(vtc._idle) and len(vtc._idle) <= 32
        assert len(vtc._idle_heap) <= 2 * 32 + 64 and set(h.sched.limits) <= busy
    h.run()
    assert len(vtc.counters) <= 32 and not h.sched.limits and not h.sched.active.counts
    h.assert_idle_and_clean()


def test_idle_counters_are_dropped_at_the_level_and_capped():
    vtc = VirtualTokenCounter(max_idle=3)
    for i in range(6):
        vtc.lift(f"t{i}", 0.0)
        vtc.charge(f"t{i}", 10 * (i + 1), 1)
    vtc.retire("t0", 5.0)  # 10 > 5: kept
    assert vtc.is_idle("t0") and vtc.counter("t0") == 10
    for i in range(1, 6):
        vtc.retire(f"t{i}", 5.0)
    assert sorted(vtc.counters) == ["t3", "t4", "t5"]  # over the cap: the lowest counters went first
    vtc.lift("t4", 45.0)  # back (counter 50 stays); the level passes t3 (40)
    assert sorted(vtc.counters) == ["t4", "t5"] and vtc.counter("t4") == 50 and not vtc.is_idle("t4")
    vtc.lift("t0", 45.0)
    assert vtc.counter("t0") == 45.0


def test_active_requests_count_sequences():
    class R:
        def __init__(self, rid, tenant):
            self.request_id, self.tenant = rid, tenant

    active, a, b = ActiveRequests(), R("a", "t"), R("b", "t")
    assert active.start(a, 3) == 3 and active.start(b, 1) == 4
    assert active.finish(a, 2) == 2 and active.counts == {"t": 2}
    assert active.finish(a, 1) == 1 and active.finish(b, 1) == 0 and active.counts == {}
    assert active.finish(a, 1) is None  # not started (any more): nothing to do
    active.start(a, 3)
    assert active.cancel(a) == 0 and active.counts == {}  # a withdrawn request drops every sample


# ---------------------------------------------------------------- max_concurrent_requests


@pytest.mark.parametrize("fair_share", ["vtc", "off"])
def test_a_tenant_at_its_limit_queues_while_others_go_on(fair_share):
    h = Harness(num_blocks=128, block_size=4, max_num_seqs=4, fair_share=fair_share)
    for i in range(5):
        h.add(f"A{i}", 4, max_tokens=6, tenant="A", max_concurrent=2)
    for i in range(3):
        h.add(f"B{i}", 4, max_tokens=6, tenant="B")
    first = h.step()
    assert sorted(ids(first.admitted)) == ["A0", "A1", "B0", "B1"]
    most = 0
    while h.sched.has_work():
        h.step()
        most = max(most, running_of(h, "A"))
    assert most == 2
    h.assert_idle_and_clean()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_keeps_counting(mode):
    h = Harness(num_blocks=8, block_size=4, victim_policy="longest_first", preemption_mode=mode,
                num_host_blocks=16 if mode == "swap" else 0)
    h.add("a1", 4, max_tokens=20, tenant="A", max_concurrent=2)
    h.add("a2", 4, max_tokens=14, tenant="A")
    while h.sched.num_preemptions == 0:
        h.step()
    a2 = h.requests["a2"][0]
    assert a2.status.name == ("SWAPPED" if mode == "swap" else "WAITING") and a2.num_preemptions == 1
    assert h.sched.active.counts == {"A": 2}  # a1 running, a2 preempted: both hold a place
    h.add("a3", 2, max_tokens=1, tenant="A")
    h.run()
    assert h.started == ["a1", "a2", "a3"]
    h.assert_idle_and_clean()


def test_n_samples_count_as_sequences_and_each_end_releases_one():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=8)
    g = h.add("g", 4, max_tokens=6, n=3, tenant="A", max_concurrent=3)
    h.add("next", 4, max_tokens=2, tenant="A")
    h.step()
    h.step()
    assert h.sched.active.counts == {"A": 3} and "next" not in h.started
    h.sched.remove(g[1], FinishReason.ABORT)  # one sample ends: one place frees
    h.step()
    assert h.started == ["g", "next"] and h.sched.active.counts == {"A": 3}
    for s in g[1:2]:
        h.finals[("g", s.index)] = 1
    h.run()
    h.assert_idle_and_clean()


def test_a_request_whose_samples_do_not_fit_waits_below_the_limit():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=8)
    h.add("a1", 4, max_tokens=6, n=2, tenant="A", max_concurrent=4)
    h.add("a2", 4, max_tokens=6, n=3, tenant="A")
    h.add("b1", 4, max_tokens=6, tenant="B")
    h.step()
    h.step()
    assert h.sched.active.counts == {"A": 2, "B": 1}  # 2 + 3 > 4: a2 waits though A is below its limit
    assert h.started == ["a1", "b1"]
    most = 0
    while h.sched.has_work():
        h.step()
        most = max(most, h.sched.active.counts.get("A", 0))
    assert h.started == ["a1", "b1", "a2"] and most == 3
    h.assert_idle_and_clean()


def test_a_withdrawn_newcomer_stops_counting_and_counts_again_when_readmitted():
    h = Harness(num_blocks=64, block_size=4)
    h.add("a", 4, max_tokens=3, tenant="A", max_concurrent=1)
    batch = h.sched.schedule()
    assert h.sched.active.counts == {"A": 1}
    h.sched.withdraw(batch, list(batch.admitted))  # the forward failed: back to the queue, suspect
    assert h.sched.active.counts == {} and ids(h.sched.waiting) == ["a"]
    h.sched.check_tenants()
    counter = h.sched.vtc.counter("A")
    h.run()
    assert h.sched.vtc.floor() == counter + 3  # the prompt was not charged twice
    h.assert_idle_and_clean()


def test_a_newer_higher_limit_unblocks_at_arrival():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=8)
    h.add("a1", 4, max_tokens=8, tenant="A", max_concurrent=1)
    h.add("a2", 4, max_tokens=8, tenant="A")
    h.step()
    assert h.started == ["a1"]
    h.add("a3", 4, max_tokens=8, tenant="A", max_concurrent=3)  # the tenants file was edited
    h.step()
    assert h.started == ["a1", "a2", "a3"]
    h.run()
    h.assert_idle_and_clean()


# ---------------------------------------------------------------- off == the old global heap


class OldWaitingQueue:
    """The WaitingQueue before fair share (one global policy-ordered heap), as the oracle of fair_share='off'."""

    def __init__(self, key, vtc=None):
        self._key, self._front, self._heap, self._entries = key, deque(), [], {}
        self._counter = itertools.count()

    def __len__(self):
        return len(self._front) + len(self._entries)

    def __bool__(self):
        return bool(self._front) or bool(self._entries)

    def __iter__(self):
        yield from self._front
        yield from (e[2] for e in sorted(self._entries.values(), key=lambda e: (e[0], e[1])))

    def push(self, seq):
        entry = [self._key(seq), next(self._counter), seq]
        self._entries[seq.seq_id] = entry
        heapq.heappush(self._heap, entry)

    def push_front(self, seq):
        self._front.appendleft(seq)

    def take(self):
        if self._front:
            return self._front.popleft()
        while self._heap:
            seq = heapq.heappop(self._heap)[2]
            if seq is not None:
                del self._entries[seq.seq_id]
                return seq
        return None

    def unpop(self, seqs):
        for seq in reversed(seqs):
            self._front.appendleft(seq) if seq.num_preemptions else self.push(seq)

    def remove(self, seq):
        entry = self._entries.pop(seq.seq_id, None)
        if entry is not None:
            entry[2] = None
        else:
            self._front.remove(seq)

    def block(self, name):
        raise AssertionError("no limits in this test")

    def unblock(self, name):
        pass

    def has_tenant(self, name):  # the scheduler asks when a tenant's last request ends
        return any(seq.request.tenant == name for seq in self)

    def check(self):
        pass


def _trace(config, requests, old: bool, monkeypatch) -> list:
    if old:
        monkeypatch.setattr(scheduler_module, "WaitingQueue", OldWaitingQueue)
    h = Harness(**config)
    monkeypatch.undo()
    trace, pending, step = [], sorted(requests, key=lambda r: r["at"]), 0
    while pending or h.sched.has_work():
        assert step < 2000
        while pending and pending[0]["at"] <= step:
            r = pending.pop(0)
            h.add(r["rid"], r["prompt"], max_tokens=r["max_tokens"], n=r["n"], priority=r["priority"],
                  tenant=r["tenant"], lora=r["lora"])
        h.now += 1.0
        batch = h.step()
        trace.append([(s.request.request_id, s.index, n, list(t))
                      for s, n, t in zip(batch.seqs, batch.num_new_tokens, batch.block_tables)])
        step += 1
    return trace


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fair_share_off_schedules_exactly_as_the_old_global_heap(data):
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    config = dict(num_blocks=data.draw(st.integers(6, 14)), block_size=2, preemption_mode=mode,
                  num_host_blocks=8 if mode == "swap" else 0, fair_share="off",
                  admission_policy=data.draw(st.sampled_from(["fcfs", "priority", "sjf"])),
                  max_num_seqs=data.draw(st.integers(1, 6)), max_num_batched_tokens=data.draw(st.integers(3, 24)),
                  adapter_slots=data.draw(st.integers(1, 2)), max_adapter_wait_steps=data.draw(st.integers(0, 3)))
    requests = [dict(at=data.draw(st.integers(0, 5)), rid=f"r{i}", prompt=data.draw(st.integers(1, 6)),
                     max_tokens=data.draw(st.integers(1, 6)), n=data.draw(st.sampled_from([1, 1, 2])),
                     priority=data.draw(st.integers(0, 2)), tenant=data.draw(st.sampled_from(["t", "u", "v"])),
                     lora=data.draw(st.sampled_from([None, "A", "B"])))
                for i in range(data.draw(st.integers(1, 10)))]
    with pytest.MonkeyPatch.context() as mp:
        assert _trace(config, requests, False, mp) == _trace(config, requests, True, mp)

