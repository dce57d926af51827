"""The torch path's LoRA for rows spread over many adapters: one tile per slot, weights read in place.

The rows of each adapter slot fill one tile of a [n, size, H_in] batch, tile i holding slot
lo + i, so A and B are read as views of the slot stacks ([lo:hi]), never copied: the delta of
a projection is two bmms, a scale and one index_add_. The gathered input is kept for the next
projection that reads the same tensor (q/k/v, gate/up).

This relies on LoraSlots' zero padding: entries past a slot's rank, and the modules an adapter
does not target (scale 0), are zero, so each slot runs at the step's largest rank and adds
exactly nothing where it does not adapt. Padding entries (tiles shorter than the longest, slots
in the range that no row uses) read row 0; what they compute is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class SlotTiles:
    """A step's rows on adapters as one tile per slot lo..hi-1 of size rows each."""

    lo: int
    hi: int
    size: int
    rank: int  # the largest rank among the slots in use
    gather: torch.Tensor  # int64 [(hi - lo) * size]: the row each tile entry reads
    picks: torch.Tensor | None  # the entries that are rows (None: all of them)
    dest: torch.Tensor  # int64: the row each picked entry adds to
    _x: torch.Tensor | None = None  # the last input gathered, and its tiles
    _x_tiles: torch.Tensor | None = None

    @classmethod
    def plan(cls, rows: np.ndarray, slots: np.ndarray, slot_ranks: list[int], to_tensor) -> SlotTiles | None:
        """Tiles for rows (int, ascending) on slots (>= 0, one per row), at the largest of the used slots'
        slot_ranks; None when a range of slots would waste too much: more unused slots than used ones,
        or one adapter far above the mean."""
        if rows.size == 0:
            return None
        order = np.argsort(slots, kind="stable")
        rows, slots = rows[order], slots[order]
        lo, hi = int(slots[0]), int(slots[-1]) + 1
        counts = np.bincount(slots - lo, minlength=hi - lo)
        used, size = int(np.count_nonzero(counts)), int(counts.max())
        entries = (hi - lo) * size
        if hi - lo > 2 * used or entries > 2 * rows.size + 16 * used:
            return None
        rank = max(slot_ranks[lo + i] for i in np.flatnonzero(counts).tolist())
        starts = np.cumsum(counts) - counts
        entry = (slots - lo) * size + np.arange(rows.size) - np.repeat(starts, counts)
        gather = np.zeros(entries, np.int64)
        gather[entry] = rows
        if entries == rows.size:  # no padding: entry e is row gather[e]
            return cls(lo, hi, size, rank, to_tensor(gather), None, to_tensor(gather))
        return cls(lo, hi, size, rank, to_tensor(gather), to_tensor(entry), to_tensor(rows))

    def add(self, y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
            scales: torch.Tensor) -> None:
        """y[row] += scale * (x[row] @ A.T) @ B.T of each row's slot, in place.

        a_t [S, H_in, R], b_t [S, R, H_out] and scales [S, 1, 1] are the module's stacks (views).
        """
        if x is not self._x:
            self._x, self._x_tiles = x, x.index_select(0, self.gather).view(self.hi - self.lo, self.size, -1)
        lo, hi, rank = self.lo, self.hi, self.rank
        dtype = x.dtype  # fp16 stacks (lora_dtype) are read as fp32 copies of the slots in use
        v = torch.bmm(self._x_tiles, a_t[lo:hi, :, :rank].to(dtype)).mul_(scales[lo:hi])
        delta = torch.bmm(v, b_t[lo:hi, :rank].to(dtype)).view(-1, y.shape[1])
        if self.picks is not None:
            delta = delta.index_select(0, self.picks)
        y.index_add_(0, self.dest, delta)
