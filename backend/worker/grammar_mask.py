"""Structured outputs in the step: each constrained row's allowed next tokens, as xgrammar's bitmask, set on
its logits before sampling; then each row's matcher advances by the token it sampled, within its budget.

The rows' bitmasks are filled on fill threads, started before the forward pass: a mask depends only on its
matcher's state after the previous step's accept, and xgrammar's fill releases the GIL, so the fills run
while the model does. Each row's fill is one native call timed by its thread's CPU clock; the bits become
additive penalties (0 or -inf, a byte at a time from a 256-entry table) applied by two torch ops over all
constrained rows at once, on the device the logits are on (CPU or CUDA alike). The accept runs on the loop
thread, timed the same way; a row over its budget (grammar_budget.GrammarBudget) fails its request.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loraplex.exceptions import InvalidRequest
from loraplex.launch.cpus import usable_cpus
from loraplex.worker.grammar_budget import GrammarBudget, RowMatcher

BITS = 32  # xgrammar's bitmask: int32 words, bit j of word w allows token 32 * w + j
FILL_THREADS = max(1, min(8, usable_cpus() // 2))  # as vLLM's structured-output fill pool (half the CPUs)
# byte value b -> the penalties of its 8 tokens: 0 where bit k of b is set (allowed), -inf where it is not
_BYTE_PENALTY = torch.where((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))


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
        """Wait for every fill to end, raising nothing (on leaving a step, failed or not: no fill outlives it)."""
        for future in self.futures:
            future.exception()


class GrammarMask:
    """The host bitmask buffer (reused step after step), the fill threads and the penalty tables, for logits
    [rows, vocab_size]; ``seconds`` counts each tenant label's matching CPU time."""

    def __init__(self, vocab_size: int, device, budget: GrammarBudget | None = None, threads: int = FILL_THREADS,
                 seconds: dict[str, float] | None = None):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.budget = budget or GrammarBudget()
        self.seconds = {} if seconds is None else seconds
        self.words = -(-vocab_size // BITS)
        self._host = torch.zeros(0, self.words, dtype=torch.int32)
        self._penalties: dict[torch.dtype, torch.Tensor] = {}  # per logits dtype: _BYTE_PENALTY on the device
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
        table = self._penalties.get(logits.dtype)
        if table is None:
            table = self._penalties[logits.dtype] = _BYTE_PENALTY.to(self.device, logits.dtype)
        # each bitmask byte (little-endian words: byte k of word w holds tokens 32w + 8k ... + 7) looked up as its
        # 8 tokens' penalties; adding 0 leaves a logit as it is, adding -inf masks it (logits are finite here)
        penalty = torch.nn.functional.embedding(words.view(torch.uint8).long(), table).view(n, -1)
        index = torch.tensor([row for row, _ in rows], dtype=torch.int64, device=logits.device)
        logits.index_add_(0, index, penalty[:, : logits.shape[1]])

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
