"""Scheduler, model-free: exact batches, block ids, copy and swap pairs, admission order, caps, timeouts.

The fake runner (tests/support/scheduler_harness.py) checks every KV slot each sequence reads,
so each test here also proves the KV contents stay right through what it exercises.
"""

from __future__ import annotations

import pytest
from scheduler_harness import Harness

from loraplex.config import EngineConfig
from loraplex.kv_cache import SwapSpace
from loraplex.sched.policies import (
    admission_key, fcfs_key, longest_first, lowest_priority, most_preempted_last, priority_key, sjf_key,
)
from loraplex.sched.preemption import AdmissionCap
from loraplex.engine.request import FinishReason, Request, SamplingParams, Sequence, SeqStatus
from loraplex.sched.waiting_queue import WaitingQueue


def rows(batch):
    """(request/index, new tokens, block table) per scheduled sequence."""
    return [
        (s.request.request_id + (f"/{s.index}" if s.index else ""), n, list(t))
        for s, n, t in zip(batch.seqs, batch.num_new_tokens, batch.block_tables)
    ]


def ids(seqs):
    return [s.request.request_id for s in seqs]


def admitted_order(h: Harness, max_steps: int = 500) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order = []
    for _ in range(max_steps):
        if not h.sched.has_work():
            return order
        batch = h.step()
        order += [r for r in ids(batch.seqs) if r not in order]
    raise AssertionError("did not finish")


def assert_streams_equal_reference(h: Harness) -> None:
    for (rid, index), tokens in h.streamed.items():
        assert tokens == h.expected(rid, index), (rid, index)


# ---------------------------------------------------------------- budget, chunks, prefix


def test_chunked_prefill_and_prefix_hit_skip_cached_tokens():
    h = Harness(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    shared = list(range(3, 13))  # 10 tokens: two full blocks and a partial one
    h.add("a", shared, max_tokens=2)
    h.add("b", shared + [50], max_tokens=2)
    assert rows(h.step()) == [("a", 8, [0, 1])]  # budget 8: first chunk; b must wait
    # a's last chunk (2 tokens, new block 2); b hits a's two computed blocks and computes 3 tokens
    assert rows(h.step()) == [("a", 2, [0, 1, 2]), ("b", 3, [0, 1, 3])]
    assert h.sched.prefix_query_tokens == {"t": 21} and h.sched.prefix_hit_tokens == {"t": 8}
    assert rows(h.step()) == [("a", 1, [0, 1, 2]), ("b", 1, [0, 1, 3])]
    h.assert_idle_and_clean()
    assert h.kv.pool.free_queue.ids() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 3, 1, 0]
    assert_streams_equal_reference(h)


def test_prefix_hits_are_per_tenant_and_adapter():
    h = Harness(num_blocks=32, block_size=4)
    prompt = list(range(3, 12))  # 9 tokens: 2 full blocks
    h.add("first", prompt, max_tokens=1)
    h.run()
    for rid, tenant, lora in (("same", "t", None), ("other-tenant", "u", None), ("other-adapter", "t", "a")):
        h.add(rid, prompt, max_tokens=1, tenant=tenant, lora=lora)
        h.run()
    assert h.sched.prefix_hit_tokens == {"t": 8, "u": 0}
    assert h.sched.prefix_query_tokens == {"t": 27, "u": 9}


def test_decodes_are_scheduled_before_prefill_chunks():
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    a, = h.add("a", 2, max_tokens=6)
    assert rows(h.step()) == [("a", 2, [0])]
    b, = h.add("b", 12, max_tokens=1)
    assert rows(h.step()) == [("a", 1, [0]), ("b", 3, [1])]
    h.sched.running.reverse()  # b (mid-prefill) ahead of a (decoding) in the running list
    assert rows(h.step()) == [("a", 1, [0]), ("b", 3, [1, 2])]  # b alone would have taken the whole budget
    h.run()
    assert_streams_equal_reference(h)


# ---------------------------------------------------------------- preemption


def _two_growing(mode: str, host_blocks: int) -> Harness:
    """a and b (7-token prompts, 8 tokens each) in 6 blocks of 4: b is preempted at step 7."""
    h = Harness(num_blocks=6, block_size=4, num_host_blocks=host_blocks, preemption_mode=mode,
                victim_policy="longest_first")
    h.add("a", 7, max_tokens=8)
    h.add("b", 7, max_tokens=8)
    for _ in range(6):
        h.step()
    assert h.kv.pool.free_queue.ids() == [] and h.sched.num_preemptions == 0
    return h


def test_recompute_preemption_frees_blocks_and_resumes_from_the_prefix_cache():
    h = _two_growing("recompute", 0)
    b = h.requests["b"][0]
    batch = h.step()  # a needs a 4th block: b (tie on tokens -> latest arrival) is the victim
    assert rows(batch) == [("a", 1, [0, 1, 4, 5])] and batch.swap_out == []
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(h.sched.waiting) == [b]
    assert h.kv.pool.free_queue.ids() == [3, 2]  # b's blocks, tail first; a took block 5
    assert rows(h.step()) == [("a", 1, [0, 1, 4, 5])]  # no room for b yet (watermark); a finishes
    assert rows(h.step()) == [("b", 5, [2, 3, 5, 4])]  # 13 tokens, 8 of them hit in its own cached blocks 2, 3
    assert h.sched.prefix_hit_tokens == {"t": 0}  # a resumed sequence is not a new prompt lookup
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


def test_swap_preemption_copies_blocks_out_and_back_in():
    h = _two_growing("swap", 8)
    b = h.requests["b"][0]
    batch = h.step()
    assert rows(batch) == [("a", 1, [0, 1, 4, 5])]
    assert batch.swap_out == [(2, 0), (3, 1), (5, 2)]  # 12 computed tokens: 3 blocks
    assert b.status is SeqStatus.SWAPPED and b.host_blocks == [0, 1, 2] and list(h.sched.swapped) == [b]
    assert h.sched.swap_space.num_free == 5
    h.step()
    batch = h.step()
    assert batch.swap_in == [(0, 3), (1, 2), (2, 5)] and rows(batch) == [("b", 1, [3, 2, 5, 4])]
    assert b.num_computed_tokens == 13 and h.sched.num_swapped_out == 1
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    h = _two_growing("swap", 2)  # b needs 3 host blocks
    batch = h.step()
    assert batch.swap_out == [] and list(h.sched.waiting) == [h.requests["b"][0]]
    assert h.sched.num_swapped_out == 0 and h.sched.num_preemptions == 1
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


def test_victim_scheduled_earlier_in_the_step_is_taken_back_out():
    h = Harness(num_blocks=5, block_size=4, victim_policy="longest_first")
    h.add("a", 3, max_tokens=8)
    h.add("b", 3, max_tokens=8)
    assert rows(h.step()) == [("a", 3, [0]), ("b", 3, [1])]
    h.sched.running.reverse()  # b is scheduled first from now on
    for _ in range(5):
        batch = h.step()
    assert rows(batch) == [("b", 1, [1, 2]), ("a", 1, [0, 3])] and h.kv.pool.free_queue.ids() == [4]
    # b takes the last free block for position 8; then a needs one too: the tie picks b (later
    # arrival), which leaves the batch again; its blocks 4, 2, 1 are freed and a gets block 4
    batch = h.step()
    assert rows(batch) == [("a", 1, [0, 3, 4])]
    b = h.requests["b"][0]
    assert list(h.sched.waiting) == [b] and b.num_computed_tokens == 0 and b.num_output_tokens == 6
    assert h.kv.pool.free_queue.ids() == [2, 1]
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


def _seq(seq_id, output_tokens, preemptions=0, priority=0, arrival=0.0):
    req = Request(f"r{seq_id}", "", [1, 2, 3], SamplingParams(priority=priority), arrival_time=arrival)
    seq = Sequence(seq_id, req, 0, [1, 2, 3] + [5] * output_tokens, 3)
    seq.num_preemptions = preemptions
    return seq


def test_victim_policies():
    a = _seq(0, output_tokens=9, preemptions=2, priority=0, arrival=1.0)
    b = _seq(1, output_tokens=5, preemptions=0, priority=3, arrival=2.0)
    c = _seq(2, output_tokens=5, preemptions=0, priority=1, arrival=3.0)
    d = _seq(3, output_tokens=1, preemptions=1, priority=3, arrival=4.0)
    running = [a, b, c, d]
    assert longest_first(running) is a  # most tokens generated
    assert most_preempted_last(running) is c  # fewest preemptions (b, c), most tokens (tie), latest arrival
    assert lowest_priority(running) is d  # largest priority value (b, d), latest arrival
    assert longest_first([b, c]) is c and lowest_priority([a, c]) is c


@pytest.mark.parametrize("policy, victim", [("longest_first", "a"), ("most_preempted_last", "b"),
                                            ("lowest_priority", "a")])
def test_victim_policy_is_used_by_the_scheduler(policy, victim):
    h = Harness(num_blocks=7, block_size=4, victim_policy=policy)
    h.add("a", 4, max_tokens=12, priority=5)
    h.step()  # a is one token ahead of b from now on
    h.add("b", 4, max_tokens=12, priority=0)
    h.requests["a"][0].num_preemptions = 1  # as if a had been preempted before
    while h.sched.num_preemptions == 0:
        h.step()
    assert ids(h.sched.waiting) == [victim]
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


# ---------------------------------------------------------------- admission cap


def test_admission_cap_halves_under_thrash_and_doubles_when_calm():
    cap = AdmissionCap(limit=16, window=4, threshold=2)
    trace = []
    for preempted, running in [(1, 12), (0, 12), (1, 12), (1, 11), (0, 11), (3, 8), (0, 4), (0, 4), (0, 4), (0, 4),
                               (0, 4), (0, 4), (0, 4), (0, 4), (1, 4), (0, 4), (0, 4), (0, 4), (0, 8)]:
        cap.record(preempted, running)
        trace.append(cap.value)
    # 3 preemptions within 4 steps -> min(16, 11 + 1) // 2 = 6; 3 at once -> min(6, 8 + 3) // 2 = 3;
    # each 4 quiet steps double it (6, 12, then 16, the limit); one preemption alone changes nothing
    # but restarts the quiet count
    assert trace == [16, 16, 16, 6, 6, 3, 3, 3, 3, 6, 6, 6, 6, 12, 12, 12, 12, 12, 16]
    assert (cap.num_lowered, cap.num_raised) == (2, 3)


def test_admission_cap_limits_admission_and_an_empty_batch_always_admits():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=8)
    h.sched.cap.value = 1
    for i in range(3):
        h.add(f"r{i}", 3, max_tokens=2, n=1 if i else 3)
    assert rows(h.step()) == [("r0", 3, [0])]  # a group of 3 samples exceeds the cap, but the batch is empty
    assert ids(h.step().seqs) == ["r0", "r0", "r0"]  # forked; r1 waits for the cap
    assert ids(h.step().seqs) == ["r1"]
    h.run()
    h.assert_idle_and_clean()


def test_sustained_preemption_lowers_the_cap_and_it_recovers():
    h = Harness(num_blocks=12, block_size=2, max_num_seqs=8, preemption_window_steps=4, preemption_threshold=1,
                victim_policy="longest_first")
    for i in range(8):
        h.add(f"r{i}", 3, max_tokens=10)
    caps = []
    while h.sched.has_work():
        h.step()
        caps.append(h.sched.cap.value)
    assert h.sched.num_preemptions >= 2 and min(caps) < 8
    lowest = min(caps)
    for i in range(4):  # calm traffic: one short request at a time, no preemption
        h.add(f"calm{i}", 2, max_tokens=8)
        h.run()
    assert h.sched.cap.value == 8 and h.sched.cap.num_raised >= 1 and lowest <= 4
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


# ---------------------------------------------------------------- admission order


def _order_of(policy: str, specs, **kw) -> list[str]:
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=1, admission_policy=policy, **kw)
    for rid, max_tokens, priority, arrival in specs:
        h.add(rid, 3, max_tokens=max_tokens, priority=priority, arrival=arrival)
    return admitted_order(h)


SPECS = [("a", 9, 2, 0.0), ("b", 3, 0, 1.0), ("c", 6, 1, 2.0), ("d", 3, 2, 3.0), ("e", 1, 0, 4.0)]


def test_fcfs_admits_in_arrival_order():
    assert _order_of("fcfs", SPECS) == ["a", "b", "c", "d", "e"]


def test_priority_admits_lower_priority_value_first_then_by_arrival():
    assert _order_of("priority", SPECS) == ["b", "e", "c", "a", "d"]


def test_sjf_admits_fewest_max_tokens_first():
    assert _order_of("sjf", SPECS, sjf_aging_rate=0.0) == ["e", "b", "d", "c", "a"]


def test_sjf_aging_lets_a_long_waiting_request_go_first():
    # keys: max_tokens + rate * arrival -> a: 9 + 0, b: 3 + 2, c: 6 + 4, d: 3 + 6, e: 1 + 8 (ties by arrival):
    # a, the longest, has waited longest and now goes before the shorter d and e
    assert _order_of("sjf", SPECS, sjf_aging_rate=2.0) == ["b", "a", "d", "e", "c"]
    assert admission_key("sjf", 2.0)(Harness().add("x", 3, max_tokens=5, arrival=10.0)[0])[0] == 25.0


def test_admission_keys():
    s = _seq(7, 0, priority=4, arrival=2.5)
    assert fcfs_key(s) == (2.5, 7) and priority_key(s) == (4, 2.5, 7) and sjf_key(1.0)(s)[0] == 16 + 2.5
    with pytest.raises(ValueError):
        admission_key("random")


def test_preempted_sequences_resume_before_new_ones_under_any_policy():
    h = Harness(num_blocks=8, block_size=4, admission_policy="priority", victim_policy="longest_first")
    h.add("old", 4, max_tokens=14, priority=5)
    h.add("old2", 4, max_tokens=14, priority=5)
    while h.sched.num_preemptions == 0:
        h.step()
    h.add("urgent", 4, max_tokens=2, priority=-10)
    victim = list(h.sched.waiting)[0]
    assert ids(h.sched.waiting) == [victim.request.request_id, "urgent"]
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


def test_static_batching_admits_only_into_an_empty_batch():
    order = {}
    for batching in ("continuous", "static"):
        h = Harness(num_blocks=64, block_size=4, max_num_seqs=2, batching=batching)
        h.add("long", 3, max_tokens=6)
        h.add("short", 3, max_tokens=2)
        h.add("third", 3, max_tokens=2)
        first_step = {}
        step = 0
        while h.sched.has_work():
            step += 1
            for rid in ids(h.step().seqs):
                first_step.setdefault(rid, step)
        order[batching] = first_step
    assert order["continuous"] == {"long": 1, "short": 1, "third": 3}  # joins when "short" ends
    assert order["static"] == {"long": 1, "short": 1, "third": 7}  # waits for the whole batch


# ---------------------------------------------------------------- adapters (issue 4 part)


def test_requests_for_unpinnable_adapters_wait_and_resident_ones_go_first():
    h = Harness(num_blocks=64, block_size=4, adapter_slots=1, max_adapter_wait_steps=100)
    h.add("a1", 3, max_tokens=4, lora="A")
    h.add("b1", 3, max_tokens=2, lora="B")
    h.add("a2", 3, max_tokens=2, lora="A")
    assert ids(h.step().seqs) == ["a1", "a2"]  # b1 skipped: A holds the only slot, pinned
    assert h.requests["b1"][0].adapter_skips == 1 and ids(h.sched.waiting) == ["b1"]
    assert admitted_order(h) == ["a1", "a2", "b1"]
    h.assert_idle_and_clean()


def test_adapter_wait_is_bounded_then_blocks_later_admissions():
    h = Harness(num_blocks=64, block_size=4, adapter_slots=1, max_adapter_wait_steps=2)
    h.add("a1", 3, max_tokens=6, lora="A")
    h.add("b1", 3, max_tokens=2, lora="B")
    h.add("a2", 3, max_tokens=3, lora="A")
    assert ids(h.step().seqs) == ["a1", "a2"]  # b1 skipped once
    h.add("a3", 3, max_tokens=2, lora="A")
    assert ids(h.step().seqs) == ["a1", "a2", "a3"]  # skipped twice: still within the bound
    h.add("a4", 3, max_tokens=2, lora="A")
    assert ids(h.step().seqs) == ["a1", "a2", "a3"]  # third skip exceeds it: a4 must wait behind b1
    b1 = h.requests["b1"][0]
    assert b1.adapter_skips == 3 and ids(h.sched.waiting) == ["b1", "a4"]
    order = admitted_order(h)
    assert order.index("b1") < order.index("a4")
    h.assert_idle_and_clean()


def test_an_adapter_that_breaks_while_its_request_waits_fails_only_that_request():
    h = Harness(num_blocks=64, block_size=4, adapter_slots=1)
    h.add("a1", 3, max_tokens=3, lora="A")
    b1, b1_1 = h.add("b1", 3, max_tokens=2, lora="B", n=2)
    h.add("a2", 3, max_tokens=2, lora="A")
    h.step()
    h.adapters.broken.add("B")
    failed = []
    while h.sched.has_work():
        failed += [(s.request.request_id, s.index) for s in h.step().finished]
    assert failed == [("b1", 0), ("b1", 1)]  # once A's slot freed and B was loaded
    assert str(b1.error) == "adapter 'B' is broken on disk" and b1_1.error is None
    assert h.reasons[("b1", 0)] == "abort" and h.streamed[("b1", 0)] == []
    h.assert_idle_and_clean()
    assert h.streamed[("a1", 0)] == h.expected("a1") and h.streamed[("a2", 0)] == h.expected("a2")


def test_an_adapter_that_breaks_while_swapped_out_fails_only_that_request():
    h = _fork_parent_preempted("swap")
    h.step()
    g = h.requests["g"][0]
    assert g.status is SeqStatus.SWAPPED
    h.adapters.broken.add("A")
    batch = h.step()
    assert [(s.request.request_id, s.index) for s in batch.finished] == [("g", 0), ("g", 1)]
    assert batch.swap_in == [] and str(g.error) == "adapter 'A' is broken on disk"
    h.run()
    h.sched.swap_space.flush()
    assert h.sched.swap_space.num_free == 8 and h.streamed[("w", 0)] == h.expected("w")
    h.assert_idle_and_clean()


# ---------------------------------------------------------------- forks (n > 1)


def test_fork_after_prefill_shares_blocks_and_copies_on_first_write():
    h = Harness(num_blocks=12, block_size=4, max_num_batched_tokens=4)
    a, a1, a2 = h.add("a", 6, max_tokens=3, n=3)
    assert a1.status is SeqStatus.FORK_PENDING and a.forks == [a1, a2]
    assert rows(h.step()) == [("a", 4, [0])]  # chunked prefill: the samples wait for it
    batch = h.step()
    assert rows(batch) == [("a", 2, [0, 1])] and [(i, c.index) for i, c in batch.forks] == [(0, 1), (0, 2)]
    assert h.kv.block_table(a1.seq_id) == [0, 1] == h.kv.block_table(a2.seq_id)  # shares the partly filled block 1
    assert [h.kv.pool.blocks[b].ref_count for b in (0, 1)] == [3, 3]
    batch = h.step()
    assert rows(batch) == [("a", 1, [0, 2]), ("a/1", 1, [0, 3]), ("a/2", 1, [0, 1])]
    assert batch.copy_pairs == [(1, 2), (1, 3)]  # the last writer keeps the original
    assert h.kv.usage()["used"] == 4  # three separate requests would hold 6
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)
    assert len({tuple(h.streamed[("a", i)]) for i in range(3)}) == 3


def _fork_parent_preempted(mode: str) -> Harness:
    """g (13-token prompt, n=2, lowest priority) is preempted mid-prefill at step 5, its sample still pending."""
    h = Harness(num_blocks=5, block_size=4, max_num_batched_tokens=4, victim_policy="lowest_priority",
                preemption_mode=mode, num_host_blocks=8 if mode == "swap" else 0)
    h.add("x", 3, max_tokens=5, lora="A")
    h.add("g", 13, max_tokens=3, n=2, lora="A", priority=5)
    h.add("w", 3, max_tokens=2, lora="B")
    for _ in range(4):
        h.step()
    assert h.adapters.resident["A"] == [0, 3]  # x, g and g's pending sample each hold a pin
    return h


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempting_a_parent_mid_prefill_keeps_its_pending_samples(mode):
    h = _fork_parent_preempted(mode)
    g, g1 = h.requests["g"]
    batch = h.step()
    assert g.num_preemptions == 1 and g1.status is SeqStatus.FORK_PENDING and g.forks == [g1]
    assert h.adapters.resident["A"] == [0, 0]  # x finished; g gave back its pin and its sample's
    if mode == "swap":
        assert g.status is SeqStatus.SWAPPED and batch.swap_out == [(1, 0), (3, 1), (4, 2)]  # 10 computed tokens
        batch = h.step()
        assert batch.swap_in == [(0, 4), (1, 3), (2, 1)] and rows(batch) == [("g", 3, [4, 3, 1, 2])]
    else:
        assert g.status is SeqStatus.WAITING
        assert rows(h.step()) == [("g", 4, [1, 3, 4])]  # 8 tokens hit its own cached blocks; a 4-token chunk
        batch = h.step()
        assert rows(batch) == [("g", 1, [1, 3, 4, 2])]
    assert [(i, c.index) for i, c in batch.forks] == [(0, 1)] and h.adapters.resident["A"] == [0, 2]
    h.run()
    h.assert_idle_and_clean()
    assert_streams_equal_reference(h)


# ---------------------------------------------------------------- timeouts and removal


def test_timeout_ends_waiting_and_running_requests_and_frees_their_blocks():
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=1)
    h.add("a", 5, max_tokens=10, timeout=3.5)
    h.add("b", 5, max_tokens=10, timeout=2.5)
    h.add("c", 5, max_tokens=2, n=2)
    finished = []
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        h.now = now
        batch = h.step()
        finished.append([(s.request.request_id, s.index) for s in batch.finished])
        if now == 4.0:
            assert rows(batch) == [("c", 5, [2, 3])]  # a's blocks were freed before c was admitted
    assert finished == [[], [], [("b", 0)], [("a", 0)], []]
    assert h.reasons == {("a", 0): "timeout", ("b", 0): "timeout", ("c", 0): "length", ("c", 1): "length"}
    assert h.streamed[("a", 0)] == h.expected("a")[:3] and h.streamed[("b", 0)] == []
    h.assert_idle_and_clean()


def test_timeout_of_swapped_and_fork_pending_sequences():
    h = Harness(num_blocks=5, block_size=4, max_num_batched_tokens=4, victim_policy="lowest_priority",
                preemption_mode="swap", num_host_blocks=8)
    h.add("x", 3, max_tokens=5)
    g, g1 = h.add("g", 13, max_tokens=3, n=2, priority=5, timeout=5.5)
    for now in range(1, 6):
        h.now = float(now)
        h.step()
    assert g.status is SeqStatus.SWAPPED and g1.status is SeqStatus.FORK_PENDING and h.sched.swap_space.num_free == 5
    h.now = 6.0
    batch = h.step()
    assert [(s.request.request_id, s.index) for s in batch.finished] == [("g", 0), ("g", 1)]
    assert h.reasons == {("x", 0): "length", ("g", 0): "timeout", ("g", 1): "timeout"}
    assert g.host_blocks == [] and not h.sched.swapped and g.forks == [] and batch.swap_in == []
    h.assert_idle_and_clean()


def test_default_timeout_applies_when_the_request_has_none():
    h = Harness(num_blocks=12, block_size=4, default_timeout=2.5)
    h.add("a", 3, max_tokens=50)
    for now in (1.0, 2.0, 3.0):
        h.now = now
        h.step()
    assert h.reasons == {("a", 0): "timeout"}
    h.assert_idle_and_clean()


@pytest.mark.parametrize("state, steps, rid, index, ended", [
    ("waiting", 5, "w", 0, [("w", 0)]),
    ("running", 4, "x", 0, [("x", 0)]),
    ("running", 4, "g", 0, [("g", 0), ("g", 1)]),  # a parent takes its pending sample along
    ("swapped", 5, "g", 0, [("g", 0), ("g", 1)]),
    ("fork_pending", 5, "g", 1, [("g", 1)]),
])
def test_remove_from_every_state_releases_everything(state, steps, rid, index, ended):
    h = _fork_parent_preempted("swap")
    for _ in range(steps - 4):
        h.step()
    target = h.requests[rid][index]
    assert target.status.name.lower() == state
    got = h.sched.remove(target, FinishReason.ABORT)
    assert [(s.request.request_id, s.index) for s in got] == ended
    assert all(s.status is SeqStatus.FINISHED and s.finish_reason is FinishReason.ABORT for s in got)
    assert h.sched.remove(target, FinishReason.ABORT) == []  # idempotent
    if (rid, index) == ("g", 1):
        assert h.requests["g"][0].forks == []
    for rid, seqs in h.requests.items():
        for s in seqs:
            if s.status is not SeqStatus.FINISHED:
                h.sched.remove(s, FinishReason.ABORT)
    h.kv.check_invariants()
    h.sched.swap_space.flush()
    assert h.kv.usage()["used"] == 0 and h.adapters.total_pins() == 0
    assert h.sched.swap_space.num_free == 8 and not h.sched.has_work() and h.sched.num_new_waiting == 0
    assert h.adapters.resident["A"][1] == 0


# ---------------------------------------------------------------- small parts


def test_waiting_queue_front_heap_and_lazy_removal():
    q = WaitingQueue(priority_key)
    seqs = [_seq(i, 0, priority=p, arrival=float(i)) for i, p in enumerate([3, 1, 2, 1])]
    for s in seqs:
        q.push(s)
    resumed = _seq(9, 4, preemptions=1, priority=9)
    q.push_front(resumed)
    assert [s.seq_id for s in q] == [9, 1, 3, 2, 0] and len(q) == 5
    q.remove(seqs[3])
    assert seqs[3] not in q and len(q) == 4
    assert [q.pop().seq_id for _ in range(2)] == [9, 1]
    q.unpop([resumed, seqs[1]])
    assert [s.seq_id for s in q] == [9, 1, 2, 0]
    assert [q.pop().seq_id for _ in range(4)] == [9, 1, 2, 0] and not q
    with pytest.raises(IndexError):
        q.pop()


def test_swap_space_defers_release_to_the_next_step():
    space = SwapSpace(4)
    assert space.take(3) == [0, 1, 2] and space.num_free == 1
    space.release_later([1, 0])
    assert space.num_free == 1
    with pytest.raises(ValueError, match="need 2 host blocks, 1 free"):
        space.take(2)
    space.flush()
    assert space.take(3) == [0, 1, 3]
    space.check()


@pytest.mark.parametrize("key, value, message", [
    ("batching", "dynamic", "batching must be continuous, static or static-shrink"),
    ("admission_policy", "lifo", "admission_policy must be fcfs, priority or sjf"),
    ("preemption_mode", "kill", "preemption_mode must be recompute or swap"),
    ("victim_policy", "random", "victim_policy must be longest_first, most_preempted_last or lowest_priority"),
    ("max_waiting_requests", 0, "max_waiting_requests must be >= 1"),
    ("default_timeout", -1.0, "default_timeout must be >= 0 (0 = none)"),
    ("swap_space_bytes", -1, "swap_space_bytes must be >= 0"),
    ("preemption_window_steps", 0, "preemption_window_steps must be >= 1"),
    ("preemption_threshold", -1, "preemption_threshold must be >= 0"),
    ("kv_watermark", 1.0, "kv_watermark must be in [0, 1)"),
    ("sjf_aging_rate", -1.0, "sjf_aging_rate must be >= 0"),
    ("max_adapter_wait_steps", -1, "max_adapter_wait_steps must be >= 0"),
])
def test_config_validation(key, value, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(**{key: value})
    assert str(err.value) == f"EngineConfig: {message}"
