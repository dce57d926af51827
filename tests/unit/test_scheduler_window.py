"""Scheduler with a sliding window (decision 065), model-free: prompts of 3x the window in pools smaller than
them, blocks freed as the window moves, a prefix hit past a freed hole, n > 1 forks, preemption by recompute
and by swap inside the window, and the decode rows a repeated batch must read again.

The fake runner (tests/support/scheduler_harness.py) reads, for each query p, the slots of keys
p - W < k <= p and checks they hold the sequence's own history, and never reads the null block."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import Harness

from loraplex.worker.step_arrays import RepeatedDecode

W = 8
BS = 4


def rows(batch):
    return [(s.request.request_id, n, list(t)) for s, n, t in zip(batch.seqs, batch.num_new_tokens, batch.block_tables)]


def assert_streams_equal_reference(h: Harness) -> None:
    for (rid, index), tokens in h.streamed.items():
        assert tokens == h.expected(rid, index), (rid, index)


def test_a_prompt_of_three_windows_runs_in_a_pool_smaller_than_it():
    h = Harness(num_blocks=8, block_size=BS, window=W, max_num_batched_tokens=8)
    h.add("a", 24, max_tokens=16)  # 40 tokens: 10 blocks, and 6 usable (8 less the null block and the watermark)
    assert rows(h.step()) == [("a", 8, [1, 2])]
    assert rows(h.step()) == [("a", 8, [1, 2, 3, 4])]  # the chunk at 8 reads from key 1 on: block 1 stays
    assert rows(h.step()) == [("a", 8, [0, 0, 3, 4, 5, 6])]  # the chunk at 16 reads from key 9 (block 3) on
    assert rows(h.step()) == [("a", 1, [0, 0, 0, 0, 5, 6, 7])]  # the decode at 24 reads 17..24
    peak = 0
    while h.sched.has_work():
        h.step()
        peak = max(peak, h.kv.usage()["used"])
    assert peak == 3 and h.kv.num_freed_by_window == 7
    assert_streams_equal_reference(h)
    h.assert_idle_and_clean()


def test_a_prefix_hit_starts_past_the_freed_hole():
    h = Harness(num_blocks=10, block_size=BS, window=W, max_num_batched_tokens=8)
    prompt = list(range(3, 27))  # 24 tokens
    h.add("a", prompt, max_tokens=2)
    h.run()
    h.add("b", prompt + [50, 51, 52], max_tokens=2)
    batch = h.step()
    # b's first query, at 24, reads keys 17..24: a's cached blocks for 16..23 are all it needs
    (rid, n, table), = rows(batch)
    assert (rid, n) == ("b", 3) and table[:4] == [0, 0, 0, 0] and len(table) == 7
    assert h.sched.prefix_hit_tokens == {"t": 24} and h.kv.num_hits_past_a_hole == 1
    h.run()
    assert_streams_equal_reference(h)
    h.assert_idle_and_clean()


def test_forked_samples_share_the_window_and_free_it_apart():
    h = Harness(num_blocks=12, block_size=BS, window=W, max_num_batched_tokens=8)
    h.add("a", 24, max_tokens=12, n=3)
    h.run()
    assert len(h.streamed) == 3
    assert_streams_equal_reference(h)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_inside_the_window_resumes_with_the_same_window(mode):
    h = Harness(num_blocks=9, block_size=BS, window=W, max_num_batched_tokens=8, preemption_mode=mode,
                num_host_blocks=16 if mode == "swap" else 0, victim_policy="longest_first")
    for rid in "abc":
        h.add(rid, 20, max_tokens=20)  # each 40 tokens (10 blocks): a window each, never all three
    swapped_out = []
    while h.sched.has_work():
        batch = h.step()
        swapped_out += [len(batch.swap_out)] if batch.swap_out else []
    assert h.sched.num_preemptions > 0
    if mode == "swap":
        assert h.sched.num_swapped_out > 0 and max(swapped_out) <= 3  # the live blocks, not the whole sequence
    assert_streams_equal_reference(h)
    h.assert_idle_and_clean()


def test_a_repeated_decode_batch_reads_again_the_rows_the_window_changed():
    h = Harness(num_blocks=16, block_size=BS, window=W, max_num_batched_tokens=64)
    h.add("a", 9, max_tokens=20)
    h.add("b", 11, max_tokens=20)
    repeated = RepeatedDecode(BS)
    while h.sched.has_work():
        batch = h.sched.schedule()
        step, _ = repeated.build(batch)
        for i, table in enumerate(batch.block_tables):
            assert list(step.block_tables[i, :len(table)]) == table, (i, table)
        result = h.runner.execute(batch)
        h.sched.update(batch, result)
        repeated.sampled(np.asarray(result.token_ids), None)
    assert h.kv.num_freed_by_window > 0
