"""A constrained sample's matching budget: the CPU time its grammar's matcher spends on each token (the mask
fill plus the accept), capped per token and on average, so one request's grammar cannot stretch every row's
step. A sample over its budget fails its request with an error naming ``structured_outputs``.

The average is kept as an allowance: a sample starts with ``BURST_TOKENS`` tokens' worth of the per-token cap,
each token adds the mean budget (never above that burst) and takes what its matching cost; an allowance below
zero is over budget. Times are the matching thread's CPU time, so a busy machine never pushes a sample over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from loraplex.exceptions import InvalidRequest

TOKEN_BUDGET_MS = 5.0  # one token's matching (fill + accept) over this ends the sample's request
MEAN_BUDGET_MS = 1.0  # a sample's matching per token on average, beyond its burst
BURST_TOKENS = 10  # the allowance holds this many tokens at the per-token cap


class RowMatcher:
    """One constrained sample's xgrammar matcher, its tenant's metric label and the matching time it spent."""

    __slots__ = ("matcher", "label", "seconds", "tokens", "allowance", "fill_seconds")

    def __init__(self, matcher, label: str = "default"):
        self.matcher, self.label = matcher, label
        self.seconds = 0.0  # CPU seconds of its fills and accepts so far
        self.tokens = 0  # tokens charged
        self.allowance: float | None = None  # seconds left of its mean budget (None: nothing charged yet)
        self.fill_seconds = 0.0  # this step's mask fill (written by the fill thread, read after it is done)


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """Per-token and mean matching budgets in milliseconds (0: that cap is off) and the clock they are read by."""

    token_ms: float = TOKEN_BUDGET_MS
    mean_ms: float = MEAN_BUDGET_MS
    clock: Callable[[], float] = time.thread_time

    @property
    def burst_s(self) -> float:
        """The allowance a sample starts with and never exceeds."""
        return BURST_TOKENS * max(self.token_ms, self.mean_ms) / 1000

    def charge(self, row: RowMatcher, seconds: float) -> InvalidRequest | None:
        """Count one token's matching against its sample; the error that ends the sample's request if that
        puts it over either budget, else None."""
        row.seconds += seconds
        row.tokens += 1
        if self.token_ms and seconds * 1000 > self.token_ms:
            return InvalidRequest(f"structured_outputs: matching the grammar took {seconds * 1000:.1f} ms for one "
                                  f"token, over the budget of {self.token_ms:g} ms (grammar_token_budget_ms)")
        if self.mean_ms:
            allowance = self.burst_s if row.allowance is None else row.allowance
            row.allowance = min(self.burst_s, allowance + self.mean_ms / 1000) - seconds
            if row.allowance < 0:
                return InvalidRequest(
                    f"structured_outputs: matching the grammar took {row.seconds * 1000:.0f} ms over {row.tokens} "
                    f"tokens, over the budget of {self.mean_ms:g} ms a token on average (grammar_mean_budget_ms) "
                    f"after the first {self.burst_s * 1000:g} ms")
        return None
