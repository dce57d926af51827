"""KV cache: exact block ids and free-queue order for hits, misses, eviction, fork and COW."""

import pytest

from kv_snapshot import snapshot
from loraplex.kv_cache import BlockPool, FreeBlockQueue, KVCacheManager, hash_block, namespace_key
from loraplex.kv_cache import manager as manager_mod
from loraplex.kv_cache.block_pool import Block

NS = namespace_key("tenant-a", "digest-1")
BS = 4


def queue(kv):
    return kv.pool.free_queue.ids()


def prefill(kv, seq, tokens, ns=NS):
    """Find the cached prefix, allocate the rest, 'compute' it and register full blocks."""
    blocks, covered = kv.find_cached_prefix(tokens, ns)
    assert kv.allocate(seq, covered, len(tokens) - covered, blocks)
    kv.cache_full_blocks(seq, tokens, len(tokens), ns)
    kv.check_invariants()
    return blocks, covered


# ------------------------------------------------------------------ hashing


def test_namespace_key_no_aliasing():
    keys = [
        namespace_key(None, None),
        namespace_key("", None),
        namespace_key(None, ""),
        namespace_key("", ""),
        namespace_key("ab", "c"),
        namespace_key("a", "bc"),
        namespace_key("abc", None),
        namespace_key(None, "abc"),
    ]
    assert len(set(keys)) == len(keys)
    assert namespace_key("t", "d") == namespace_key("t", "d")


def test_hash_block_unambiguous():
    h = hash_block(None, [1, 2, 3])
    assert len(h) == 32 and h == hash_block(None, (1, 2, 3))
    distinct = {
        h,
        hash_block(b"", [1, 2, 3]),
        hash_block(h, [1, 2, 3]),
        hash_block(None, [1, 2], b"\x03"),
        hash_block(None, [1, 2, 3], b"x"),
        hash_block(None, [3, 2, 1]),
        hash_block(None, [1, 2, 3, 0]),
    }
    assert len(distinct) == 7


# ------------------------------------------------------------ free queue


def test_free_block_queue_o1_ops():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert q.ids() == [1, 3] and blocks[2].prev is None and blocks[2].next is None
    q.append(blocks[2])
    assert q.ids() == [1, 3, 2]
    assert q.popleft() is blocks[1]
    assert [b.block_id for b in q] == [3, 2] and len(q) == 2
    q.popleft(), q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_block_pool_initial_order_and_counts():
    pool = BlockPool(4)
    assert pool.free_queue.ids() == [0, 1, 2, 3] and pool.num_free == 4
    assert pool.take_new(2) == [0, 1]
    pool.release([1, 0])
    assert pool.free_queue.ids() == [2, 3, 1, 0]


# --------------------------------------------------------------- hit / miss


def test_miss_allocates_in_id_order():
    kv = KVCacheManager(8, BS)
    assert kv.usage() == {"used": 0, "cached": 0, "free": 8}
    assert prefill(kv, "a", list(range(10))) == ([], 0)
    assert kv.block_table("a") == [0, 1, 2]
    assert queue(kv) == [3, 4, 5, 6, 7]
    assert kv.usage() == {"used": 3, "cached": 0, "free": 5}
    assert kv.block_table("nope") == []


def test_full_hit_takes_cached_blocks_and_unlinks_them():
    kv = KVCacheManager(8, BS)
    tokens = list(range(10))
    prefill(kv, "a", tokens)
    kv.free("a")
    # tail-first free: 2 (partial) then 1 then 0 join the tail
    assert queue(kv) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert kv.usage() == {"used": 0, "cached": 2, "free": 8}

    assert kv.find_cached_prefix(tokens, NS) == ([0, 1], 8)
    assert kv.usage()["free"] == 8  # find takes no references
    assert kv.blocks_needed("b", 8, 2, [0, 1]) == 3
    assert kv.allocate("b", 8, 2, [0, 1])
    assert kv.block_table("b") == [0, 1, 3]
    assert queue(kv) == [4, 5, 6, 7, 2]
    assert kv.usage() == {"used": 3, "cached": 0, "free": 5}
    kv.check_invariants()


def test_partial_hit():
    kv = KVCacheManager(8, BS)
    prefill(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.free("a")
    assert queue(kv) == [3, 4, 5, 6, 7, 2, 1, 0]
    other = [1, 2, 3, 4, 5, 6, 7, 99, 9, 10]
    assert prefill(kv, "b", other) == ([0], 4)
    assert kv.block_table("b") == [0, 3, 4]
    assert queue(kv) == [5, 6, 7, 2, 1]
    # block 1 (free, cached) is still findable: lazy eviction
    assert kv.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0], NS) == ([0, 1], 8)


def test_last_token_never_hit_for_aligned_prompt():
    kv = KVCacheManager(8, BS)
    tokens = list(range(8))
    prefill(kv, "a", tokens)
    assert kv.pool.cached.keys() == {kv.pool.blocks[0].block_hash, kv.pool.blocks[1].block_hash}
    kv.free("a")
    assert kv.find_cached_prefix(tokens, NS) == ([0], 4)
    assert kv.find_cached_prefix(tokens + [8], NS) == ([0, 1], 8)
    assert kv.find_cached_prefix(tokens[:1], NS) == ([], 0)
    assert kv.find_cached_prefix([], NS) == ([], 0)
    assert prefill(kv, "b", tokens) == ([0], 4)
    assert kv.block_table("b") == [0, 2]  # block 1 stays cached and free; 2 is the head


# ------------------------------------------------------------------ eviction


def test_eviction_lru_lazy_and_tail_first():
    kv = KVCacheManager(6, BS)
    a = [10, 11, 12, 13, 14, 15, 16, 17]
    b = [20, 21, 22, 23, 24, 25, 26, 27]
    prefill(kv, "a", a)  # [0, 1], both full and registered
    assert kv.block_table("a") == [0, 1]
    kv.free("a")
    assert queue(kv) == [2, 3, 4, 5, 1, 0]
    prefill(kv, "b", b)
    assert kv.block_table("b") == [2, 3]
    kv.free("b")
    assert queue(kv) == [4, 5, 1, 0, 3, 2]
    assert kv.usage() == {"used": 0, "cached": 4, "free": 6}

    # needs 3 blocks: 4, 5 (plain) then 1 (a's tail block, evicted before a's prefix block 0)
    assert kv.allocate("c", 0, 12)
    assert kv.block_table("c") == [4, 5, 1]
    assert queue(kv) == [0, 3, 2]
    assert kv.pool.blocks[1].block_hash is None and kv.pool.blocks[1].token_ids == ()
    assert kv.usage() == {"used": 3, "cached": 3, "free": 3}
    assert kv.find_cached_prefix(a + [0], NS) == ([0], 4)

    # a hit on b's free cached blocks unlinks them from the middle/tail; the new block evicts 0
    assert kv.find_cached_prefix(b + [0], NS) == ([2, 3], 8)
    assert kv.allocate("d", 8, 1, [2, 3])
    assert kv.block_table("d") == [2, 3, 0]
    assert queue(kv) == []
    assert kv.find_cached_prefix(a + [0], NS) == ([], 0)
    assert kv.usage() == {"used": 6, "cached": 0, "free": 0}
    kv.check_invariants()


def test_free_shared_prefix_stays_held_and_tail_goes_first():
    kv = KVCacheManager(8, BS)
    p = list(range(8))
    prefill(kv, "a", p + [100, 101, 102])
    assert kv.block_table("a") == [0, 1, 2]
    prefill(kv, "b", p + [200, 201, 202, 203, 204])
    assert kv.block_table("b") == [0, 1, 3, 4]
    kv.free("b")
    assert queue(kv) == [5, 6, 7, 4, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    kv.free("a")
    assert queue(kv) == [5, 6, 7, 4, 3, 2, 1, 0]
    kv.free("a")  # unknown seq: no-op
    kv.check_invariants()


def test_duplicate_content_keeps_existing_entry():
    kv = KVCacheManager(8, BS)
    tokens = list(range(9))
    for seq in ("a", "b"):
        blocks, covered = kv.find_cached_prefix(tokens, NS)
        assert (blocks, covered) == ([], 0)
        assert kv.allocate(seq, 0, 9)
    assert kv.block_table("a") == [0, 1, 2] and kv.block_table("b") == [3, 4, 5]
    kv.cache_full_blocks("a", tokens, 9, NS)
    kv.cache_full_blocks("b", tokens, 9, NS)
    assert [kv.pool.blocks[i].block_hash is not None for i in range(6)] == [True, True, False, False, False, False]
    assert len(kv.pool.cached) == 2
    assert kv._hashes["a"] == kv._hashes["b"]
    kv.free("a")
    kv.free("b")
    assert kv.usage() == {"used": 0, "cached": 2, "free": 8}
    assert kv.find_cached_prefix(tokens, NS) == ([0, 1], 8)
    kv.check_invariants()


# --------------------------------------------------------- allocation failure


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(4, BS)
    prefill(kv, "a", list(range(9)))  # [0, 1, 2]
    kv.free("a")
    assert queue(kv) == [3, 2, 1, 0]
    prompt = list(range(8)) + list(range(50, 59))  # 17 tokens: 2 cached + 3 new
    blocks, covered = kv.find_cached_prefix(prompt, NS)
    assert (blocks, covered) == ([0, 1], 8)
    # 3 new blocks would fit in 4 free, but the 2 free cached blocks also come out of supply
    assert kv.blocks_needed("b", covered, 9, blocks) == 5
    assert not kv.can_allocate(5)
    before = snapshot(kv)
    assert not kv.allocate("b", covered, 9, blocks)
    assert snapshot(kv) == before
    assert "b" not in kv._tables
    kv.check_invariants()
    # 16 tokens: 2 cached + 2 new = 4 fits exactly
    assert kv.allocate("b", 8, 8, [0, 1])
    assert kv.block_table("b") == [0, 1, 3, 2]
    kv.check_invariants()


def test_allocate_failure_on_append_and_cow_changes_nothing():
    kv = KVCacheManager(3, BS)
    prefill(kv, "a", list(range(6)))  # [0, 1]
    kv.fork("a", "b")
    assert kv.allocate("c", 0, 4)  # takes the last block
    before = snapshot(kv)
    assert kv.blocks_needed("b", 6, 1) == 1
    assert not kv.allocate("b", 6, 1)  # COW needs a block, none free
    assert not kv.allocate("a", 6, 3)  # COW + one new block
    assert snapshot(kv) == before
    kv.check_invariants()


# ------------------------------------------------------------ fork / COW


def test_fork_shares_partial_block_and_cow_on_first_write():
    kv = KVCacheManager(8, BS)
    prompt = [1, 2, 3, 4, 5, 6]
    prefill(kv, "a", prompt)
    assert kv.block_table("a") == [0, 1]
    kv.fork("a", "b")
    assert kv.block_table("b") == [0, 1]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    assert kv._hashes["b"] == kv._hashes["a"] and len(kv._hashes["a"]) == 1
    kv.check_invariants()

    # allocating no new slots writes nothing: no copy
    assert kv.blocks_needed("b", 6, 0) == 0
    assert kv.allocate("b", 6, 0)
    assert kv.take_copy_pairs() == [] and kv.block_table("b") == [0, 1]
    # first writer into the shared partial block gets a private copy
    assert kv.blocks_needed("b", 6, 1) == 1
    assert kv.allocate("b", 6, 1)
    assert kv.block_table("b") == [0, 2]
    assert kv.take_copy_pairs() == [(1, 2)]
    assert kv.take_copy_pairs() == []
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    # second writer now writes in place
    assert kv.blocks_needed("a", 6, 1) == 0
    assert kv.allocate("a", 6, 1)
    assert kv.block_table("a") == [0, 1]
    assert kv.take_copy_pairs() == []
    # growing past the block boundary appends fresh blocks
    assert kv.allocate("b", 7, 2)
    assert kv.block_table("b") == [0, 2, 3]
    assert kv.take_copy_pairs() == []
    assert queue(kv) == [4, 5, 6, 7]
    kv.check_invariants()

    # the child's chain extends from the shared hash of block 0
    b_tokens = prompt + [70, 80, 90]
    kv.cache_full_blocks("b", b_tokens, 9, NS)
    assert kv.find_cached_prefix(b_tokens, NS) == ([0, 2], 8)
    a_tokens = prompt + [7, 8]
    kv.cache_full_blocks("a", a_tokens, 8, NS)
    assert kv.find_cached_prefix(a_tokens + [0], NS) == ([0, 1], 8)

    kv.free("a")
    assert queue(kv) == [4, 5, 6, 7, 1]
    kv.free("b")
    assert queue(kv) == [4, 5, 6, 7, 1, 3, 2, 0]
    kv.check_invariants()


def test_cow_of_multiple_shared_blocks_records_all_pairs():
    kv = KVCacheManager(8, BS)
    assert kv.allocate("a", 0, 6)  # [0, 1], nothing computed yet
    kv.fork("a", "b")
    assert kv.allocate("b", 2, 4)  # writes into blocks 0 and 1, both shared
    assert kv.block_table("b") == [2, 3]
    assert kv.take_copy_pairs() == [(0, 2), (1, 3)]
    assert kv.block_table("a") == [0, 1]
    kv.check_invariants()


def test_fork_errors():
    kv = KVCacheManager(4, BS)
    assert kv.allocate("a", 0, 3)
    with pytest.raises(KeyError):
        kv.fork("missing", "x")
    kv.fork("a", "b")
    with pytest.raises(ValueError):
        kv.fork("a", "b")


# ---------------------------------------------------------- isolation / guard


@pytest.mark.parametrize(
    "other",
    [
        namespace_key("tenant-b", "digest-1"),
        namespace_key("tenant-a", "digest-2"),
        namespace_key("tenant-a", None),
        namespace_key(None, "digest-1"),
        namespace_key("tenant-a", ""),
    ],
)
def test_namespace_isolation(other):
    kv = KVCacheManager(8, BS)
    tokens = list(range(13))
    prefill(kv, "a", tokens)
    assert kv.find_cached_prefix(tokens, NS) == ([0, 1, 2], 12)
    assert kv.find_cached_prefix(tokens, other) == ([], 0)
    assert prefill(kv, "b", tokens, ns=other) == ([], 0)
    assert kv.block_table("b") == [4, 5, 6, 7]


def test_hash_collision_guard(monkeypatch):
    monkeypatch.setattr(manager_mod, "hash_block", lambda parent, tokens, extra=b"": b"\x00" * 32)
    kv = KVCacheManager(8, BS)
    prefill(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(kv.pool.cached) == 1  # block 1 collides with block 0: not double-registered
    assert kv.find_cached_prefix([9, 9, 9, 9, 9], NS) == ([], 0)
    # first block verifies; the colliding second lookup returns block 0 whose tokens differ
    assert kv.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], NS) == ([0], 4)


# ---------------------------------------------------------------- misc


def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    prefill(kv, "a", tokens)
    assert kv.pool.cached == {}
    kv.free("a")
    assert kv.find_cached_prefix(tokens, NS) == ([], 0)
    assert kv.usage() == {"used": 0, "cached": 0, "free": 8}


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    tokens = list(range(9))
    prefill(kv, "a", tokens)
    prefill(kv, "b", list(range(100, 109)))
    kv.free("a")
    assert kv.usage() == {"used": 3, "cached": 2, "free": 5}
    kv.reset_prefix_cache()
    kv.check_invariants()
    assert kv.usage() == {"used": 3, "cached": 0, "free": 5}
    assert kv.find_cached_prefix(tokens, NS) == ([], 0)
    # a running seq keeps its chain and goes on registering new full blocks
    b_tokens = list(range(100, 113))
    assert kv.allocate("b", 9, 4)
    kv.cache_full_blocks("b", b_tokens, 13, NS)
    assert len(kv.pool.cached) == 1
    kv.check_invariants()


def test_cached_blocks_contract():
    kv = KVCacheManager(8, BS)
    prefill(kv, "a", list(range(9)))
    with pytest.raises(ValueError):
        kv.allocate("a", 9, 1, [0])  # not the first allocation
    with pytest.raises(ValueError):
        kv.allocate("b", 4, 5, [0, 1])  # cached blocks beyond num_computed_tokens
    with pytest.raises(ValueError):
        kv.allocate("b", 12, 1, [0, 1, 2])  # block 2 is not cached
    kv.check_invariants()


def test_check_invariants_detects_corruption():
    kv = KVCacheManager(4, BS)
    assert kv.allocate("a", 0, 5)
    kv.check_invariants()
    kv.pool.blocks[0].ref_count += 1
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv.pool.blocks[0].ref_count -= 1
    kv._tables["b"] = [0, 0]
    kv._hashes["b"] = []
    with pytest.raises(AssertionError):
        kv.check_invariants()
