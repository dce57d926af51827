"""One step's model inputs as numpy arrays: built from the scheduler's decisions without a Python loop per token."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, is_, itemgetter

import numpy as np


@dataclass(slots=True)
class StepArrays:
    """One step's model inputs as numpy arrays, built without a Python loop per token."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [B, max blocks], padded with block 0
    context_lens: np.ndarray  # int32 [B]
    cu: np.ndarray  # int32 [B+1]: prefix sums of new tokens
    sample_rows: np.ndarray  # int64: the row of each sequence whose last prompt/output token is in this step
    sample_seqs: np.ndarray  # int64: those sequences' indices in the batch
    is_decode: bool  # one new token per sequence

    @classmethod
    def build(cls, batch, block_size: int) -> "StepArrays":
        """From a SchedulerOutput: each sequence's new tokens start at its num_computed_tokens."""
        seqs, num = batch.seqs, len(batch.seqs)
        if sum(batch.num_new_tokens) == num:
            return cls._build_decode(seqs, batch.block_tables, block_size)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num)
        counts = np.asarray(batch.num_new_tokens, np.int64)
        cu = np.zeros(num + 1, np.int64)
        np.cumsum(counts, out=cu[1:])
        ends, total = starts + counts, int(cu[-1])
        input_ids = np.fromiter(chain.from_iterable(s.token_ids[a:b] for s, a, b in
                                                    zip(seqs, starts.tolist(), ends.tolist())), np.int64, total)
        owner = np.repeat(np.arange(num), counts)  # the sequence of each token
        positions = np.arange(total) - (cu[:-1] - starts)[owner]
        block_tables = _padded(batch.block_tables)
        slot_mapping = block_tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
        done = ends == np.fromiter((len(s.token_ids) for s in seqs), np.int64, num)  # sampled this step
        sample_seqs = np.flatnonzero(done)
        return cls(input_ids, positions, slot_mapping, block_tables, ends.astype(np.int32), cu.astype(np.int32),
                   cu[1:][sample_seqs] - 1, sample_seqs, False)

    @classmethod
    def _build_decode(cls, seqs, tables, block_size: int) -> "StepArrays":
        """One new token per sequence: one pass over the sequences for its token and position."""
        num = len(seqs)
        ids, starts, unsampled = [], [], []
        add_id, add_start = ids.append, starts.append
        for i, s in enumerate(seqs):
            p, tokens = s.num_computed_tokens, s.token_ids
            add_id(tokens[p])
            add_start(p)
            if len(tokens) != p + 1:
                unsampled.append(i)  # not its last token: a one-token prompt chunk
        positions = np.fromiter(starts, np.int64, num)
        block_tables = _padded(tables)
        block, offset = np.divmod(positions, block_size)
        slot_mapping = block_tables[np.arange(num), block].astype(np.int64)
        slot_mapping *= block_size
        slot_mapping += offset
        sample_seqs = np.delete(np.arange(num), unsampled) if unsampled else np.arange(num)
        return cls(np.fromiter(ids, np.int64, num), positions, slot_mapping, block_tables,
                   np.add(positions, 1, dtype=np.int32), np.arange(num + 1, dtype=np.int32), sample_seqs, sample_seqs,
                   True)


def _padded(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int32 [B, longest] array, shorter rows padded with block 0."""
    lens = list(map(len, tables))
    width, total = max(lens), sum(lens)
    flat = np.fromiter(chain.from_iterable(tables), np.int32, total)
    if total == width * len(tables):  # all the same length: no padding
        return flat.reshape(len(tables), width)
    block_tables = np.zeros((len(tables), width), np.int32)
    block_tables[np.arange(width) < np.array(lens)[:, None]] = flat  # row-major, so each row's ids in order
    return block_tables




_computed = attrgetter("num_computed_tokens")
_last = itemgetter(-1)


class RepeatedDecode:
    """A decode batch that repeats, kept between steps (vLLM v1's persistent batch).

    While a decode step runs the same sequences in the same order as the last one, and
    each of them got the token sampled for it, its inputs follow from the last step's in
    a few vector ops: positions + 1, the sampled tokens as input ids, and only the block
    table rows whose length or last block changed (a new block, copy-on-write) read
    again. Any other step rebuilds (``StepArrays.build``) and starts over. The arrays are
    the same as a rebuild's. ``build`` commits nothing: ``sampled`` does, after sampling.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seqs: list | None = None  # the last committed decode step's sequences
        self._step: StepArrays | None = None
        self._tokens: np.ndarray | None = None  # what that step sampled, one per sequence
        self._lens = self._lasts = None  # its block tables' lengths and last blocks
        self._pending: tuple | None = None

    def build(self, batch) -> tuple[StepArrays, bool]:
        """The step's arrays, and whether it repeats the last one (then the caller may reuse per-batch plans)."""
        seqs, num = batch.seqs, len(batch.seqs)
        last, self._pending = self._seqs, None
        if (last is not None and len(last) == num and not batch.forks and sum(batch.num_new_tokens) == num
                and all(map(is_, seqs, last))):
            positions = self._step.positions + 1
            if np.array_equal(np.fromiter(map(_computed, seqs), np.int64, num), positions):
                return self._advance(batch.block_tables, positions), True
        self._seqs = None
        step = StepArrays.build(batch, self.block_size)
        if step.is_decode and not batch.forks and len(step.sample_seqs) == num:
            tables = batch.block_tables
            self._pending = (step, np.fromiter(map(len, tables), np.int64, num),
                             np.fromiter(map(_last, tables), np.int32, num))
        return step, False

    def sampled(self, seqs: list, tokens: np.ndarray) -> None:
        """Commit the step just built: every sequence in ``seqs`` (its batch) sampled its token in ``tokens``."""
        if self._pending is not None:
            self._step, self._lens, self._lasts = self._pending
            self._seqs, self._tokens, self._pending = seqs, tokens, None

    def reset(self) -> None:
        """Forget the last step (the next one rebuilds)."""
        self._seqs = self._pending = None

    def _advance(self, tables: list[list[int]], positions: np.ndarray) -> StepArrays:
        last, num = self._step, len(tables)
        lens = np.fromiter(map(len, tables), np.int64, num)
        lasts = np.fromiter(map(_last, tables), np.int32, num)
        block_tables = last.block_tables
        width = int(lens.max())
        if width > block_tables.shape[1]:
            block_tables = np.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))
        else:
            block_tables = block_tables.copy()  # the last step's stays as it was
        for i in np.flatnonzero((lens != self._lens) | (lasts != self._lasts)).tolist():
            row = tables[i]
            block_tables[i, :len(row)] = row
        block, offset = np.divmod(positions, self.block_size)
        slot_mapping = block_tables[np.arange(num), block].astype(np.int64)
        slot_mapping *= self.block_size
        slot_mapping += offset
        step = StepArrays(self._tokens, positions, slot_mapping, block_tables, np.add(positions, 1, dtype=np.int32),
                          last.cu, last.sample_rows, last.sample_seqs, True)
        self._pending = (step, lens, lasts)
        return step
