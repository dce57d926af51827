"""Structured outputs in the step: each constrained row's allowed next tokens, as xgrammar's bitmask, set on
its logits before sampling; then each row's matcher advances by the token it sampled, within its budget.

The rows' bitmasks are filled on fill threads, started before the forward pass: a mask depends only on its
matcher's state after the previous step's accept, and xgrammar's fill releases the GIL, so the fills run
while the model does. Each row's fill is one native call timed by its thread's CPU clock; the bits are
unpacked and applied by a few torch ops over all constrained rows at once, on the device the logits are on
(CPU or CUDA alike). The accept runs on the loop thread, timed the same way; a row over its budget
(grammar_budget.GrammarBudget) fails its request.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loraplex.exceptions import InvalidRequest
from loraplex.worker.grammar_budget import GrammarBudget, RowMatcher

BITS = 32  # xgrammar's bitmask: int32 words, bit j of word w allows token 32 * w + j
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # as vLLM's structured-output fill pool


class Filling:
    """The fills of one step's bitmask rows, running on the fill threads."""

    __slots__ = ("bitmask", "futures")

    def __init__(self, bitmask: torch.Tensor, futures: list[Future]):
        self.bitmask, self.futures = bitmask, futures

    def wait(self) -> torch.Tensor:
        """The filled host bitmask, once every row's fill is done (a fill's exception is raised here)."""
        for future in self.futures:
            future.result()
        return self.bitmask

    def settle(self) -> None:
        """Wait for every fill to end, raising nothing (the step failed: no fill may outlive it)."""
        for future in self.futures:
            future.exception()


class GrammarMask:
    """The host bitmask buffer (reused step after step), the fill threads and the bit shifts, for logits
    [rows, vocab_size]; ``seconds`` counts each tenant label's matching CPU time."""

    def __init__(self, vocab_size: int, device, budget: GrammarBudget | None = None, threads: int = FILL_THREADS,
                 seconds: dict[str, float] | None = None):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.budget = budget or GrammarBudget()
        self.seconds = {} if seconds is None else seconds
        self.words = -(-vocab_size // BITS)
        self._host = torch.zeros(0, self.words, dtype=torch.int32)
        self._shifts = torch.arange(BITS, dtype=torch.int32, device=self.device)
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def fill(self, rows: list[tuple[int, RowMatcher]]) -> Filling:
        """Start filling bitmask row i from rows[i]'s matcher, the rows split over the fill threads."""
        n = len(rows)
        if len(self._host) < n:
            self._host = torch.zeros(n, self.words, dtype=torch.int32)
        bitmask = self._host[:n]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="loraplex-grammar-fill")
        parts = min(self._threads, n)
        clock = self.budget.clock
        futures = [self._pool.submit(_fill_rows, bitmask, [(i, rows[i][1]) for i in range(k, n, parts)], clock)
                   for k in range(parts)]
        return Filling(bitmask, futures)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, RowMatcher]], filling: Filling | None = None) -> None:
        """Each (row, matcher): logits[row, t] = -inf for every token t its grammar does not allow next
        (``filling``: this step's fill of these rows, started earlier; else filled now)."""
        n = len(rows)
        words = (filling or self.fill(rows)).wait().to(self.device)
        allowed = ((words.unsqueeze(-1) >> self._shifts) & 1).view(n, -1)[:, : logits.shape[1]].bool()
        index = torch.tensor([row for row, _ in rows], dtype=torch.int64, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))

    def advance(self, rows: list[tuple[int, RowMatcher]], tokens: list[int], sample_seqs: list[int],
                errors: dict[int, Exception]) -> None:
        """Each constrained row's matcher takes the token it sampled, and the row is charged its step's fill and
        accept. A row over its budget, or whose grammar refuses its token (never expected: the mask allowed only
        grammar tokens), fails its request."""
        budget, clock, seconds = self.budget, self.budget.clock, self.seconds
        token_s = budget.token_ms / 1000 if budget.token_ms else float("inf")
        for row, matcher in rows:
            spent = matcher.fill_seconds
            accepted = True
            if spent <= token_s:  # over already: the row ends, its matcher need not move
                start = clock()
                accepted = matcher.matcher.accept_token(tokens[row])
                spent += clock() - start
            seconds[matcher.label] = seconds.get(matcher.label, 0.0) + spent
            over = budget.charge(matcher, spent)
            if over is not None:
                errors[sample_seqs[row]] = over
            elif not accepted:
                errors[sample_seqs[row]] = InvalidRequest(
                    "structured_outputs: the sampled token does not fit the request's grammar")


def _fill_rows(bitmask: torch.Tensor, rows: list[tuple[int, RowMatcher]], clock) -> None:
    """On a fill thread: bitmask[i] from each (i, matcher), each fill timed by this thread's clock."""
    for i, matcher in rows:
        start = clock()
        matcher.matcher.fill_next_token_bitmask(bitmask, i)
        matcher.fill_seconds = clock() - start
