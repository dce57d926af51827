"""The waiting queue: preempted sequences first (most recent victim first), then new ones by policy key.

New sequences sit in a heap ordered by the admission policy's key; removal (abort,
timeout) is lazy, O(1). Preempted sequences (recompute mode) go to a front deque: they
have already streamed tokens, so they resume before anything new is admitted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from .policies import AdmissionKey
from .request import Sequence


class WaitingQueue:
    """Front deque of resumed sequences + keyed heap of new ones; pop() gives the next to admit."""

    __slots__ = ("_key", "_front", "_heap", "_entries", "_counter")

    def __init__(self, key: AdmissionKey) -> None:
        self._key = key
        self._front: deque[Sequence] = deque()
        self._heap: list[list] = []  # [key, tie, seq or None (removed)]
        self._entries: dict[int, list] = {}
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._front) + len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        """Admission order (for tests and introspection; not used on the hot path)."""
        yield from self._front
        yield from (e[2] for e in sorted(self._entries.values(), key=lambda e: (e[0], e[1])))

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._entries or seq in self._front

    def push(self, seq: Sequence) -> None:
        """Queue a new sequence in policy order."""
        entry = [self._key(seq), next(self._counter), seq]
        self._entries[seq.seq_id] = entry
        heapq.heappush(self._heap, entry)

    def push_front(self, seq: Sequence) -> None:
        """Queue a preempted sequence ahead of everything."""
        self._front.appendleft(seq)

    def pop(self) -> Sequence:
        """Remove and return the next sequence to admit."""
        if self._front:
            return self._front.popleft()
        while self._heap:
            entry = heapq.heappop(self._heap)
            seq = entry[2]
            if seq is not None:
                del self._entries[seq.seq_id]
                return seq
        raise IndexError("pop from an empty WaitingQueue")

    def unpop(self, seqs: list[Sequence]) -> None:
        """Put back sequences popped (in this order) but not admitted, where they were."""
        for seq in reversed(seqs):
            if seq.num_preemptions:
                self._front.appendleft(seq)
            else:
                self.push(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (abort, timeout)."""
        entry = self._entries.pop(seq.seq_id, None)
        if entry is not None:
            entry[2] = None
            if len(self._heap) > 64 and len(self._heap) > 2 * len(self._entries):  # keep the heap compact
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)
        else:
            self._front.remove(seq)
