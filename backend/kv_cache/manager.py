"""KVCacheManager: per-sequence block tables over a BlockPool, prefix caching, copy-on-write.

Usage per sequence (the scheduler's side):

    blocks, covered = kv.find_cached_prefix(tokens, ns)          # no references taken
    if kv.allocate(seq, covered, len(tokens) - covered, blocks):  # takes them; all or nothing
        ...run the step, copying kv.take_copy_pairs() first...
        kv.cache_full_blocks(seq, tokens, covered + n, ns)
    kv.free(seq)                                                  # when it ends or is preempted

Call ``allocate`` right after ``find_cached_prefix`` for the same sequence (no other
allocation in between), as vLLM does: another allocation may evict the found blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from loraplex.kv_cache.block_pool import BlockPool
from loraplex.kv_cache.hashing import hash_block

SeqId = Hashable


class KVCacheManager:
    """Paged KV block allocator with prefix caching and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[SeqId, list[int]] = {}
        self._hashes: dict[SeqId, list[bytes]] = {}  # hash chain of the seq's full blocks
        self._copy_pairs: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0 (cached ones included: they are evictable)."""
        return self.pool.num_free

    def usage(self) -> dict[str, int]:
        """Block counts: used (ref>0), cached (free and holding a prefix hash), free (ref==0, cached included)."""
        free = self.pool.num_free
        return {"used": self.num_blocks - free, "cached": self.pool.num_cached_free, "free": free}

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The seq's block ids in order (the live list: do not mutate); [] for an unknown seq."""
        return self._tables.get(seq_id, [])

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks can be taken from the free supply now."""
        return num_blocks <= self.pool.num_free

    # ------------------------------------------------------------ prefix cache

    def find_cached_prefix(self, token_ids: Sequence[int], namespace: bytes) -> tuple[list[int], int]:
        """Longest run of cached full blocks for this prompt -> (block ids, tokens covered); never covers the last token."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs if token_ids else 0
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
        pool = self.pool
        for i in range(len(hashes), num_full):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(hashes[i - 1], chunk) if i else hash_block(None, chunk, namespace)
            hashes.append(h)
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
            for bid in table:
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
            pool.touch(table)
            self._tables[seq_id] = table
            self._hashes[seq_id] = [pool.blocks[b].block_hash for b in table]
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
        self.pool.touch(table)
        self._tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes[parent_id])

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
        if self._copy_pairs:
            mine = set(table)
            self._copy_pairs = [p for p in self._copy_pairs if p[1] not in mine]
        self.pool.release(reversed(table))

    def source_blocks(self, seq_id: SeqId, num_tokens: int) -> list[int]:
        """Blocks holding the seq's first num_tokens tokens as they are before pending copies run.

        A block that is the destination of a pending copy-on-write pair (its content not
        copied yet) reads as that pair's source. Used to swap a sequence out in the same
        step that allocated for it.
        """
        table = self._tables[seq_id][: -(-num_tokens // self.block_size)]
        if not self._copy_pairs:
            return list(table)
        src_of = {dst: src for src, dst in self._copy_pairs}
        return [src_of.get(b, b) for b in table]

    # -------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if ownership, ref counts, the free queue or the cache map are inconsistent."""
        pool = self.pool
        refs = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id!r} holds a block twice: {table}"
            assert len(self._hashes[seq_id]) <= len(table), f"seq {seq_id!r} hash chain longer than table"
            for bid in table:
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
