"""KV manager support for preemption: pending copies of a freed sequence, and what a swap-out must read."""

from loraplex.kv_cache import KVCacheManager, namespace_key

NS = namespace_key("t", None)


def _forked_pair():
    """Seq 0 (6 tokens computed, 4 per block) forked into seq 1; both share blocks 0 and 1."""
    kv = KVCacheManager(8, 4)
    tokens = list(range(10, 16))
    assert kv.allocate(0, 0, 6)
    kv.cache_full_blocks(0, tokens, 6, NS)
    kv.fork(0, 1)
    return kv


def test_source_blocks_reads_a_pending_copy_destination_as_its_source():
    kv = _forked_pair()
    assert kv.allocate(1, 6, 1)  # seq 1 writes position 6 into shared block 1: copy-on-write 1 -> 2
    assert kv.block_table(1) == [0, 2]
    assert kv.source_blocks(1, 6) == [0, 1]  # block 2 holds nothing until the runner copies
    assert kv.source_blocks(1, 4) == [0]
    assert kv.take_copy_pairs() == [(1, 2)]
    assert kv.source_blocks(1, 6) == [0, 2]  # after the copy ran, the block itself


def test_free_drops_pending_copies_into_the_freed_blocks():
    kv = _forked_pair()
    assert kv.allocate(1, 6, 1)
    assert kv.allocate(0, 6, 1) and kv.block_table(0) == [0, 1]  # sole owner now: writes in place
    assert kv.allocate(0, 7, 3) and kv.block_table(0) == [0, 1, 3]
    kv.free(1)  # preempted in the same step: its copy 1 -> 2 must not run (block 2 may be reused)
    assert kv.take_copy_pairs() == []
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 2]
    kv.check_invariants()
    kv.free(0)
    assert kv.usage() == {"used": 0, "cached": 1, "free": 8}


def test_free_keeps_other_sequences_pending_copies():
    kv = _forked_pair()
    kv.fork(0, 2)
    assert kv.allocate(1, 6, 1) and kv.allocate(2, 6, 1)
    assert kv.block_table(1) == [0, 2] and kv.block_table(2) == [0, 3]
    kv.free(1)
    assert kv.take_copy_pairs() == [(1, 3)]
    kv.check_invariants()
