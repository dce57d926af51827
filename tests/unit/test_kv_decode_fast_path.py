"""KVCacheManager's decode case (one new token a step): exact tables, copies and hash chains at each step."""

from loraplex.kv_cache import KVCacheManager, namespace_key

NS = namespace_key("tenant-a", "digest-1")
BS = 4


def test_decode_one_token_at_a_time_appends_only_at_block_boundaries():
    kv = KVCacheManager(8, BS)
    tokens = list(range(6))
    assert kv.allocate("a", 0, 6)
    kv.cache_full_blocks("a", tokens, 6, NS)
    tables, chains = [], []
    for computed in range(6, 13):  # the token at position `computed` is written this step
        assert kv.allocate("a", computed, 1)
        tokens.append(100 + computed)
        kv.cache_full_blocks("a", tokens, computed + 1, NS)
        tables.append(list(kv.block_table("a")))
        chains.append(len(kv._hashes["a"]))
        kv.check_invariants()
    assert tables == [[0, 1]] * 2 + [[0, 1, 2]] * 4 + [[0, 1, 2, 3]]
    assert chains == [1, 2, 2, 2, 2, 3, 3]
    assert kv.take_copy_pairs() == []
    assert kv.find_cached_prefix(tokens + [0], NS) == ([0, 1, 2], 12)


def test_decode_into_a_shared_last_block_copies_it_then_writes_in_place():
    kv = KVCacheManager(8, BS)
    assert kv.allocate("a", 0, 6)
    kv.fork("a", "b")
    assert kv.allocate("b", 6, 1)
    assert kv.block_table("b") == [0, 2] and kv.take_copy_pairs() == [(1, 2)]
    assert kv.allocate("b", 7, 1) and kv.allocate("a", 6, 1)  # neither shares its last block now
    assert kv.block_table("b") == [0, 2] and kv.block_table("a") == [0, 1] and kv.take_copy_pairs() == []
    kv.check_invariants()


def test_decode_allocation_that_needs_a_block_fails_when_none_is_free():
    kv = KVCacheManager(2, BS)
    assert kv.allocate("a", 0, 8)  # both blocks
    assert kv.allocate("a", 7, 1)  # last slot of block 1: no block needed
    assert not kv.allocate("a", 8, 1)
    assert kv.block_table("a") == [0, 1]
    kv.check_invariants()
