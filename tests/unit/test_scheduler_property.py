"""Property test: random workloads through the scheduler under random configurations.

Tiny KV pools force preemption (both modes, every victim policy), alongside chunked
prefill, prefix hits across tenants and adapters, n > 1 forks, adapter-slot contention,
timeouts and aborts, with fair share on or off and tenants with weights and concurrency
limits, and with or without a sliding window (then requests longer than the pool, their
blocks freed as the window moves, hits past freed holes). After every step the harness checks the KV manager's invariants, the swap space,
that every KV slot each scheduled sequence reads holds its own history, and the per-tenant
counts and queue structure against a recount. At the end: every sample ended exactly once, every stream equals its reference
(a prefix of it for timeouts and aborts: nothing lost, nothing repeated), and every
block, host block and adapter pin is free again.
"""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_harness import Harness

from loraplex.engine.request import FinishReason
from loraplex.kv_cache import KVCacheManager

MAX_STEPS = 3000


@st.composite
def workloads(draw):
    mode = draw(st.sampled_from(["recompute", "swap"]))
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(5, 14))
    config = dict(
        num_blocks=num_blocks, block_size=block_size, preemption_mode=mode,
        num_host_blocks=draw(st.sampled_from([2, 6, 40])) if mode == "swap" else 0,
        adapter_slots=draw(st.integers(1, 3)),
        victim_policy=draw(st.sampled_from(["longest_first", "most_preempted_last", "lowest_priority"])),
        admission_policy=draw(st.sampled_from(["fcfs", "priority", "sjf"])),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(3, 40)),
        preemption_window_steps=draw(st.integers(1, 8)),
        preemption_threshold=draw(st.integers(0, 3)),
        max_adapter_wait_steps=draw(st.integers(0, 4)),
        batching=draw(st.sampled_from(["continuous", "continuous", "static", "static-shrink"])),
        enable_prefix_caching=draw(st.booleans()),
        fair_share=draw(st.sampled_from(["vtc", "off"])),
    )
    limits = {t: dict(weight=draw(st.sampled_from([None, 1, 2, 0.5])),
                      max_concurrent=draw(st.sampled_from([None, 0, 1, 2]))) for t in ("t", "u", "v")}
    config["window"] = window = draw(st.sampled_from([None, None, 1, 2, 3, 6]))
    kv = KVCacheManager(num_blocks, block_size, window=window)
    usable = kv.num_usable_blocks - 1  # the watermark is 1 block for pools this small
    longest = 14 if window is None else 30  # a window lets a sequence outgrow the pool
    shared = draw(st.lists(st.integers(3, 6), min_size=24, max_size=24))
    requests = []
    for i in range(draw(st.integers(2, 10))):
        prompt_len = draw(st.integers(1, longest))
        max_tokens = draw(st.integers(1, longest))
        while kv.max_blocks_held(prompt_len + max_tokens, config["max_num_batched_tokens"]) > usable:
            prompt_len, max_tokens = max(1, prompt_len // 2), max(1, max_tokens // 2)  # what the engine refuses
        prompt = prompt_len
        if draw(st.booleans()):  # share a prefix with other requests
            prompt = (shared[: draw(st.integers(0, 24))] + [7] * prompt_len)[:prompt_len]
        requests.append(dict(
            at=draw(st.integers(0, 6)), rid=f"r{i}", prompt=prompt, max_tokens=max_tokens,
            n=draw(st.sampled_from([1, 1, 2, 3])) if config["max_num_seqs"] >= 3 else 1,
            priority=draw(st.integers(0, 2)), lora=draw(st.sampled_from([None, "A", "B", "C"])),
            tenant=draw(st.sampled_from(["t", "u", "v"])),
            timeout=draw(st.sampled_from([None, None, None, 3.0, 12.0])),
            abort_at=draw(st.sampled_from([None, None, None, None, 2, 9])),
        ))
    return config, limits, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    config, limits, requests = workload
    h = Harness(**config)
    pending = sorted(requests, key=lambda r: r["at"])
    aborted = set()
    step = 0
    while pending or h.sched.has_work():
        assert step < MAX_STEPS, "no progress"
        while pending and pending[0]["at"] <= step:
            r = pending.pop(0)
            h.add(r["rid"], r["prompt"], max_tokens=r["max_tokens"], n=r["n"], priority=r["priority"],
                  lora=r["lora"], tenant=r["tenant"], timeout=r["timeout"], **limits[r["tenant"]])
        for r in requests:
            if r["abort_at"] is not None and r["at"] + r["abort_at"] == step and r["rid"] in h.requests:
                for seq in h.requests[r["rid"]]:
                    for ended in h.sched.remove(seq, FinishReason.ABORT):
                        h.finals[(r["rid"], ended.index)] = h.finals.get((r["rid"], ended.index), 0) + 1
                aborted.add(r["rid"])
        h.now += 1.0
        h.step()
        step += 1
    h.assert_idle_and_clean()
    event(f"preempted: {bool(h.sched.num_preemptions)}, swapped: {bool(h.sched.num_swapped_out)}")
    event(f"forked: {any(len(seqs) > 1 for seqs in h.requests.values())}, cap lowered: {bool(h.sched.cap.num_lowered)}")
    event(f"fair share: {config['fair_share']}, limited: {any(v['max_concurrent'] for v in limits.values())}")
    if config["window"] is not None:
        event(f"window: freed {h.kv.num_freed_by_window > 0}, hit past a hole {h.kv.num_hits_past_a_hole > 0}")
    for rid, seqs in h.requests.items():
        for seq in seqs:
            got, expected = h.streamed.get((rid, seq.index), []), h.expected(rid, seq.index)
            if seq.finish_reason is FinishReason.LENGTH:
                assert got == expected, (rid, seq.index)
            else:
                assert seq.finish_reason in (FinishReason.TIMEOUT, FinishReason.ABORT)
                assert got == expected[: len(got)], (rid, seq.index)
