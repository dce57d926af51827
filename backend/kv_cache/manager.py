"""KVCacheManager: per-sequence block tables over a BlockPool, prefix caching, copy-on-write.

Usage per sequence (the scheduler's side):

    blocks, covered = kv.find_cached_prefix(tokens, ns)          # no references taken
    if kv.allocate(seq, covered, len(tokens) - covered, blocks):  # takes them; all or nothing
        ...run the step, copying kv.take_copy_pairs() first...
        kv.cache_full_blocks(seq, tokens, covered + n, ns)
    kv.free(seq)                                                  # when it ends or is preempted

Call ``allocate`` right after ``find_cached_prefix`` for the same sequence (no other
allocation in between), as vLLM does: another allocation may evict the found blocks.

With a sliding ``window`` W (every layer attends to keys p - W < k <= p, decision 065),
``free_skipped`` returns the blocks no future query can read to the pool (to the evictable
LRU, still findable by hash) and leaves ``null_block`` in their table entries, so a table
index still is a position // block_size. The null block is block 0, held for good, never
written: attention never reads it inside a window, and reads zeros if it reads it at all.
A sequence then holds at most ``max_blocks_held`` blocks, whatever its length.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from loraplex.kv_cache.block_pool import BlockPool
from loraplex.kv_cache.hashing import hash_block

SeqId = Hashable


class KVCacheManager:
    """Paged KV block allocator with prefix caching and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if window is not None and window < 1:
            raise ValueError("window must be >= 1 (or None: full attention)")
        if window and num_blocks < 2:
            raise ValueError("a windowed KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window or None
        self.pool = BlockPool(num_blocks)
        self._tables: dict[SeqId, list[int]] = {}
        self._hashes: dict[SeqId, list[bytes]] = {}  # hash chain of the seq's full blocks
        self._copy_pairs: list[tuple[int, int]] = []
        self._skipped: dict[SeqId, int] = {}  # window: leading null entries of each table (blocks freed)
        # window: blocks a prefix hit must hold before its end (the last W - 1 keys a first query reads)
        self._hit_run = max(1, -(-(window - 1) // block_size)) if window else 0
        self.null_block: int | None = self.pool.take_new(1)[0] if window else None  # block 0: held for good
        self.num_freed_by_window = 0  # blocks free_skipped gave back
        self.num_hits_past_a_hole = 0  # prefix hits whose blocks start after null entries

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0 (cached ones included: they are evictable)."""
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold: all but the null block (window)."""
        return self.num_blocks - (self.null_block is not None)

    def usage(self) -> dict[str, int]:
        """Block counts: used (ref>0, the null block not counted), cached (free and holding a prefix hash),
        free (ref==0, cached included)."""
        free = self.pool.num_free
        return {"used": self.num_usable_blocks - free, "cached": self.pool.num_cached_free, "free": free}

    def skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at position >= num_computed_tokens reads: those whose every token is at
        a position <= num_computed_tokens - W (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one sequence of num_tokens tokens holds at once when at most max_chunk tokens are computed
        in a step: all of its blocks, or with a window those holding the W - 1 keys before a chunk and the chunk,
        at worst starting one slot into a block: ceil((W + chunk + block_size - 2) / block_size)."""
        bs = self.block_size
        whole = -(-num_tokens // bs)
        if self.window is None:
            return whole
        chunk = max(1, min(max_chunk, num_tokens))
        return min(whole, -(-(self.window + chunk + bs - 2) // bs))

    def blocks_to_resume(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Blocks a swapped-out sequence takes to come back with num_new_tokens more: its live blocks and new ones."""
        return -(-(num_computed_tokens + num_new_tokens) // self.block_size) - self.skipped_blocks(num_computed_tokens)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The seq's block ids in order (the live list: do not mutate); [] for an unknown seq."""
        return self._tables.get(seq_id, [])

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks can be taken from the free supply now."""
        return num_blocks <= self.pool.num_free

    # ------------------------------------------------------------ prefix cache

    def find_cached_prefix(self, token_ids: Sequence[int], namespace: bytes) -> tuple[list[int], int]:
        """Longest run of cached full blocks for this prompt -> (block ids, tokens covered); never covers the last token.

        With a window, the hit ends at the last run of cached blocks that holds the W - 1 keys before its end
        (or runs from the start); blocks before that run are ``null_block`` (vLLM v1's SlidingWindowManager).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs if token_ids else 0
        if self.window is not None:
            return self._find_windowed(token_ids, namespace, max_blocks)
        cached = self.pool.cached
        ids: list[int] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, chunk, namespace if i == 0 else b"")
            block = cached.get(h)
            if block is None or block.token_ids != chunk:  # miss, or hash collision
                break
            ids.append(block.block_id)
            parent = h
        return ids, len(ids) * bs

    def _find_windowed(self, token_ids: Sequence[int], namespace: bytes, max_blocks: int) -> tuple[list[int], int]:
        """The windowed hit: every full block's chained hash (holes too), then the last run of hits long enough."""
        bs, cached = self.block_size, self.pool.cached
        found: list[int | None] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, chunk, namespace if i == 0 else b"")
            block = cached.get(parent)
            found.append(block.block_id if block is not None and block.token_ids == chunk else None)
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if found[i] is None:
                run = 0
                continue
            run += 1
            if run == self._hit_run:
                end = i + run
                skip = self.skipped_blocks(end * bs)  # i, or with W = 1 every block
                self.num_hits_past_a_hole += skip > 0
                return [self.null_block] * skip + found[skip:end], end * bs
        return found[:run], run * bs  # no run long enough: the one from the start, if any

    def cache_full_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_computed_tokens: int,
                          namespace: bytes) -> None:
        """Register every newly full computed block of the seq in the prefix cache, extending its hash chain."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.get(seq_id)  # the same keys as _tables
        bs = self.block_size
        if hashes is None or min(num_computed_tokens, len(token_ids)) // bs <= len(hashes):
            return  # unknown seq, or no block filled since the last call (most decode steps)
        table = self._tables[seq_id]
        num_full = min(min(num_computed_tokens, len(token_ids)) // bs, len(table))
        pool, null = self.pool, self.null_block
        for i in range(len(hashes), num_full):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(hashes[i - 1], chunk) if i else hash_block(None, chunk, namespace)
            hashes.append(h)  # a hole's hash too: the chain goes on through it
            if table[i] != null:
                pool.cache_block(table[i], h, chunk)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; held blocks stay held, running seqs keep their hash chains."""
        self.pool.reset_cache()

    # -------------------------------------------------------------- allocation

    def _plan(self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int,
              cached_blocks: Sequence[int]) -> tuple[list[int], int, list[int], int]:
        """-> (table so far, new blocks to append, table indices to copy-on-write, blocks taken from free supply)."""
        table = self._tables.get(seq_id)
        blocks = self.pool.blocks
        taken_free = 0
        if table is None:
            table = list(cached_blocks)
            if len(table) * self.block_size > num_computed_tokens:
                raise ValueError("cached_blocks cover more than num_computed_tokens")
            for bid in table[_leading(table, self.null_block):]:
                block = blocks[bid]
                if block.block_hash is None:
                    raise ValueError(f"block {bid} is no longer cached (allocate right after find_cached_prefix)")
                if block.ref_count == 0:
                    taken_free += 1
        elif cached_blocks:
            raise ValueError("cached_blocks are only taken on a seq's first allocation")
        bs = self.block_size
        end = -(-(num_computed_tokens + num_new_tokens) // bs)
        num_new = max(0, end - len(table))
        cow: list[int] = []
        if num_new_tokens > 0:
            for i in range(num_computed_tokens // bs, min(end, len(table))):
                if blocks[table[i]].ref_count > 1:
                    cow.append(i)
        return table, num_new, cow, taken_free + num_new + len(cow)

    def blocks_needed(self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int,
                      cached_blocks: Sequence[int] = ()) -> int:
        """How many blocks allocate would take from the free supply (cached-but-free hits count)."""
        return self._plan(seq_id, num_computed_tokens, num_new_tokens, cached_blocks)[3]

    def allocate(self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int,
                 cached_blocks: Sequence[int] = ()) -> bool:
        """Make the seq's table cover computed + new slots (copy-on-write for shared blocks written); all or nothing."""
        if num_new_tokens == 1 and not cached_blocks and self.held_table(seq_id, num_computed_tokens) is not None:
            return True  # a decode step into a block it holds alone: no new block, no copy
        table, num_new, cow, needed = self._plan(seq_id, num_computed_tokens, num_new_tokens, cached_blocks)
        pool = self.pool
        if needed > pool.num_free:
            return False
        if seq_id not in self._tables:
            skipped = _leading(table, self.null_block)
            pool.touch(table[skipped:])
            self._tables[seq_id] = table
            # a hit past a hole: cache_full_blocks rebuilds the chain from the tokens
            self._hashes[seq_id] = [] if skipped else [pool.blocks[b].block_hash for b in table]
            if self.window is not None:
                self._skipped[seq_id] = skipped
        if cow:
            fresh = pool.take_new(len(cow))
            src = [table[i] for i in cow]
            for i, dst in zip(cow, fresh):
                self._copy_pairs.append((table[i], dst))
                table[i] = dst
            pool.release(src)  # each had ref > 1: stays held by the other seqs
        if num_new:
            table.extend(pool.take_new(num_new))
        return True

    def free_skipped(self, seq_id: SeqId, num_computed_tokens: int) -> bool:
        """Window: give back the seq's blocks no query at position >= num_computed_tokens reads (oldest first, to
        the free queue's tail, still cached), leaving ``null_block`` in their entries; True if its table changed."""
        if self.window is None:
            return False
        done = self._skipped.get(seq_id)
        skip = self.skipped_blocks(num_computed_tokens)
        if done is None or skip <= done:
            return False
        table = self._tables[seq_id]
        skip = min(skip, len(table))
        freed = table[done:skip]
        table[done:skip] = [self.null_block] * len(freed)
        self._skipped[seq_id] = skip
        self.pool.release(freed)
        self.num_freed_by_window += len(freed)
        return bool(freed)

    def resume(self, seq_id: SeqId, num_computed_tokens: int) -> list[int]:
        """A swapped-out seq's table again: null entries for the blocks out of its window, fresh blocks for the
        live ones, which are returned in order (the swap-in destinations); all or nothing (ValueError)."""
        if seq_id in self._tables:
            raise ValueError(f"seq {seq_id!r} already has blocks")
        skip = self.skipped_blocks(num_computed_tokens)
        fresh = self.pool.take_new(-(-num_computed_tokens // self.block_size) - skip)
        self._tables[seq_id] = [self.null_block] * skip + fresh
        self._hashes[seq_id] = []  # rebuilt from the tokens by cache_full_blocks
        if self.window is not None:
            self._skipped[seq_id] = skip
        return list(fresh)

    def held_table(self, seq_id: SeqId, position: int) -> list[int] | None:
        """The seq's table (live) if the block for token `position` is there and not shared, else None.

        Then a decode token at `position` needs nothing from ``allocate``: no new block, no copy.
        """
        table = self._tables.get(seq_id)
        if table is not None:
            i = position // self.block_size
            if i < len(table) and self.pool.blocks[table[i]].ref_count <= 1:
                return table
        return None

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Child shares every block of parent (partly filled last one included) and its hash chain."""
        if child_id in self._tables:
            raise ValueError(f"seq {child_id!r} already has blocks")
        table = self._tables[parent_id]
        skipped = self._skipped.get(parent_id, 0)
        self.pool.touch(table[skipped:] if skipped else table)
        self._tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes[parent_id])
        if self.window is not None:
            self._skipped[child_id] = skipped

    def take_copy_pairs(self) -> list[tuple[int, int]]:
        """Pending copy-on-write (src, dst) pairs since the last call; clears them."""
        pairs, self._copy_pairs = self._copy_pairs, []
        return pairs

    def free(self, seq_id: SeqId) -> None:
        """Release the seq's blocks, tail first (evicted before a shared prefix); an unknown seq is a no-op.

        Pending copy-on-write pairs into its blocks are dropped: nobody will read them.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._hashes[seq_id]
        skipped = self._skipped.pop(seq_id, 0)
        if self._copy_pairs:
            mine = set(table)
            self._copy_pairs = [p for p in self._copy_pairs if p[1] not in mine]
        self.pool.release(reversed(table[skipped:] if skipped else table))

    def source_blocks(self, seq_id: SeqId, num_tokens: int) -> list[int]:
        """Blocks holding the seq's first num_tokens tokens as they are before pending copies run; with a window
        only those a query at position num_tokens or later reads (from ``skipped_blocks(num_tokens)`` on).

        A block that is the destination of a pending copy-on-write pair (its content not
        copied yet) reads as that pair's source. Used to swap a sequence out in the same
        step that allocated for it.
        """
        table = self._tables[seq_id][self.skipped_blocks(num_tokens): -(-num_tokens // self.block_size)]
        if not self._copy_pairs:
            return list(table)
        src_of = {dst: src for src, dst in self._copy_pairs}
        return [src_of.get(b, b) for b in table]

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if ownership, ref counts, the free queue or the cache map are inconsistent."""
        pool, null = self.pool, self.null_block
        refs = [0] * self.num_blocks
        if null is not None:
            refs[null] = 1  # held for good by the manager
            assert pool.blocks[null].block_hash is None, "the null block is cached"
            assert self._tables.keys() == self._skipped.keys()
        else:
            assert not self._skipped
        for seq_id, table in self._tables.items():
            skipped = self._skipped.get(seq_id, 0)
            assert table[:skipped] == [null] * skipped, f"seq {seq_id!r}: a freed entry is not the null block"
            live = table[skipped:]
            assert null not in live, f"seq {seq_id!r} has the null block among its live blocks: {table}"
            assert len(set(live)) == len(live), f"seq {seq_id!r} holds a block twice: {table}"
            assert len(self._hashes[seq_id]) <= len(table), f"seq {seq_id!r} hash chain longer than table"
            for bid in live:
                refs[bid] += 1
        assert self._tables.keys() == self._hashes.keys()
        queued = set(pool.free_queue.check())
        cached_free = 0
        for block in pool.blocks:
            bid = block.block_id
            assert block.ref_count == refs[bid], f"block {bid}: ref_count {block.ref_count} != {refs[bid]} held"
            assert (bid in queued) == (block.ref_count == 0), f"block {bid}: queued iff free violated"
            if block.block_hash is not None:
                assert pool.cached.get(block.block_hash) is block, f"block {bid} hash not in map"
                assert len(block.token_ids) == self.block_size, f"block {bid} cached but not full"
                cached_free += block.ref_count == 0
            else:
                assert block.token_ids == (), f"block {bid} keeps tokens without a hash"
        for h, block in pool.cached.items():
            assert block.block_hash == h, f"map entry for block {block.block_id} has a stale hash"
        assert cached_free == pool.num_cached_free, "cached-free counter wrong"
        used = sum(1 for r in refs if r > 0)
        assert len(queued) + used == self.num_blocks, "free + used != total"


def _leading(table: list[int], null: int | None) -> int:
    """How many entries at the start of table are the null block."""
    if null is None:
        return 0
    n = 0
    while n < len(table) and table[n] == null:
        n += 1
    return n
