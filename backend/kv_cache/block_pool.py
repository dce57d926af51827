"""Block pool: fixed set of KV blocks, an O(1) LRU free queue, and the hash -> block map.

A block with ``ref_count == 0`` sits in the free queue. If it also holds a hash it is a
*cached* free block: still findable by hash until it is popped for reuse, which is when
its hash is dropped (lazy eviction). A hit on a cached free block unlinks it from the
queue in O(1). Freed blocks go to the tail, reuse takes from the head (LRU).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    """One KV block: its id, how many sequences hold it, and its prefix-cache identity."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: popleft, append and remove in O(1)."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next

    def popleft(self) -> Block:
        """Remove and return the least recently freed block."""
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        """Put a block at the tail (most recently freed)."""
        assert block.prev is None and block.next is None, f"block {block.block_id} already queued"
        last = self._tail.prev
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._len += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} not queued"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def check(self) -> list[int]:
        """Assert the links are consistent both ways; return the queued ids, head first."""
        ids = []
        prev = self._head
        for block in self:
            assert block.prev is prev, f"free queue link broken at block {block.block_id}"
            ids.append(block.block_id)
            prev = block
        assert self._tail.prev is prev, "free queue tail link broken"
        assert len(ids) == self._len == len(set(ids)), "free queue length wrong or a block queued twice"
        return ids

    def ids(self) -> list[int]:
        """Block ids from head (next evicted) to tail."""
        return [b.block_id for b in self]


class BlockPool:
    """All blocks, the free queue and the prefix-cache map (one block per hash)."""

    __slots__ = ("num_blocks", "blocks", "free_queue", "cached", "num_cached_free")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_cached_free = 0  # ref_count == 0 and holding a hash

    @property
    def num_free(self) -> int:
        """Blocks with ref_count 0 (cached ones included)."""
        return len(self.free_queue)

    def take_new(self, n: int) -> list[int]:
        """Pop n blocks from the head of the free queue, evicting their hashes; each gets ref 1."""
        if n > len(self.free_queue):
            raise ValueError(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._drop_hash(block)
                self.num_cached_free -= 1
            block.ref_count = 1
            out.append(block.block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block, unlinking it from the free queue if it was free."""
        blocks = self.blocks
        for bid in block_ids:
            block = blocks[bid]
            if block.ref_count == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching 0 go to the queue tail."""
        blocks = self.blocks
        for bid in block_ids:
            block = blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} released too often"
            if block.ref_count == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a full, held block under its hash; keep an existing entry for the hash (no double registration)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return False
        assert block.ref_count > 0, "only held blocks are registered"
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        return True

    def reset_cache(self) -> None:
        """Forget every hash (free blocks become plain free blocks, held blocks stay held)."""
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = ()
        self.cached.clear()
        self.num_cached_free = 0

    def _drop_hash(self, block: Block) -> None:
        """Remove a block from the hash map (eviction)."""
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
