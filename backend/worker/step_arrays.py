"""One step's model inputs as numpy arrays: built from the scheduler's decisions without a Python loop per token."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import is_

import numpy as np

from loraplex import kernels


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
        positions = np.fromiter(starts, np.int64, num) - 1  # one token back: advance_decode moves them on
        block_tables = _padded(tables)
        slot_mapping, context_lens = np.empty(num, np.int64), np.empty(num, np.int32)
        kernels.advance_decode(positions, slot_mapping, context_lens, block_tables, block_size)
        sample_seqs = np.delete(np.arange(num), unsampled) if unsampled else np.arange(num)
        return cls(np.fromiter(ids, np.int64, num), positions, slot_mapping, block_tables, context_lens,
                   np.arange(num + 1, dtype=np.int32), sample_seqs, sample_seqs, True)


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


class RepeatedDecode:
    """A decode batch that repeats, kept between steps (vLLM v1's persistent batch).

    A decode step repeats the last committed one when it runs the same sequences in the
    same order (identity) and the scheduler applied exactly that step's tokens since
    (``SchedulerOutput.num_updates``). Then its inputs follow from the last step's, in
    place and in one native pass (``kernels.advance_decode``), without touching the
    sequences: positions + 1, the sampled tokens as input ids, and only the block-table
    rows the scheduler allocated for (``SchedulerOutput.allocated``: a new block,
    copy-on-write) read again. Any other step rebuilds (``StepArrays.build``) and starts
    over. The arrays are the same as a
    rebuild's. ``sampled`` commits a step after sampling, with the caller's plans for it
    (the runner's LoRA plan and sampling rows), which ``build`` hands back while the batch
    repeats; a step built and not sampled (its forward raised) leaves nothing to repeat.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seqs: list | None = None  # the last committed decode step's sequences
        self._step: StepArrays | None = None
        self._tokens: np.ndarray | None = None  # what that step sampled, one per sequence
        self._plans = None  # the caller's plans for that batch
        self._num_updates = -1  # the scheduler's update count when that step was scheduled
        self._pending: tuple | None = None

    def build(self, batch) -> tuple[StepArrays, object]:
        """The step's arrays, and the plans committed with the last step when this one repeats it (else None)."""
        seqs, num = batch.seqs, len(batch.seqs)
        last, self._seqs, self._pending = self._seqs, None, None  # until sampled: a step built and not run
        repeats = (last is not None and batch.num_updates == self._num_updates + 1 and len(last) == num
                   and not batch.forks and not batch.num_padding  # a padding row does not advance
                   and sum(batch.num_new_tokens) == num and all(map(is_, seqs, last)))
        if repeats:
            step = self._advance(batch)
        else:
            step = StepArrays.build(batch, self.block_size)
            if not step.is_decode or batch.forks or len(step.sample_seqs) != num:
                return step, None  # the next step cannot repeat this one
        self._pending = (step, seqs, batch.num_updates)
        return step, self._plans if repeats else None

    def sampled(self, tokens: np.ndarray, plans) -> None:
        """Commit the step just built: each of its sequences sampled its token in ``tokens``; plans: the
        caller's for this batch, handed back by ``build`` while it repeats."""
        if self._pending is not None:
            self._step, self._seqs, self._num_updates = self._pending
            self._tokens, self._plans, self._pending = tokens, plans, None

    def _advance(self, batch) -> StepArrays:
        """The last step's arrays moved on one token, in place (a step built from them and not sampled leaves
        nothing to repeat, so they are never read as they were): only allocated block-table rows read again."""
        step, tables = self._step, batch.block_tables
        if batch.allocated:
            width = max(len(tables[i]) for i in batch.allocated)
            if width > step.block_tables.shape[1]:
                step.block_tables = np.pad(step.block_tables, ((0, 0), (0, width - step.block_tables.shape[1])))
            block_tables = step.block_tables
            for i in batch.allocated:
                row = tables[i]
                block_tables[i, :len(row)] = row
        kernels.advance_decode(step.positions, step.slot_mapping, step.context_lens, step.block_tables,
                               self.block_size)
        step.input_ids = self._tokens
        return step
