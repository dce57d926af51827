"""Swap space: ids of the host-memory KV blocks that hold swapped-out sequences.

Only bookkeeping: the runner owns the host tensor and does the copies. Blocks released
while a step is being planned are handed out again only after that step ran
(``release_later`` / ``flush``), so a step never swaps a sequence out into host blocks
that the same step is still swapping in from.
"""

from __future__ import annotations

from collections.abc import Iterable


class SwapSpace:
    """Free list of host KV block ids with deferred release."""

    __slots__ = ("num_blocks", "_free", "_later")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._later: list[int] = []

    @property
    def num_free(self) -> int:
        """Host blocks that can be taken now."""
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """n host block ids (lowest first); raises ValueError if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"need {n} host blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release_later(self, block_ids: Iterable[int]) -> None:
        """Return blocks once the step being planned has run (see flush)."""
        self._later.extend(block_ids)

    def flush(self) -> None:
        """Make blocks released during the previous step available (call before planning a step)."""
        if self._later:
            self._free.extend(self._later)
            self._later.clear()
            self._free.sort(reverse=True)

    def check(self) -> None:
        """Assert no block is free twice and none is lost (when nothing is swapped out, all are free)."""
        ids = self._free + self._later
        assert len(ids) == len(set(ids)), "host block freed twice"
        assert all(0 <= b < self.num_blocks for b in ids), "unknown host block"
