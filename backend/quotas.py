"""Per-tenant request quotas checked when a request arrives: max_queued_requests and tokens_per_minute.

Both refuse at once with UNAVAILABLE (`QuotaExceeded`), naming the quota; nothing is
queued. (`max_concurrent_requests` is not a refusal: the scheduler keeps such requests
queued.) A request counts as queued from acceptance until it is first admitted or ends.
Tokens are counted as they are served (a request's prompt when it is accepted, each
generated token when it is produced) over a sliding 60 s window of 1 s buckets; a tenant
whose window holds `tokens_per_minute` or more gets new requests refused until it drains,
so the request that crosses the limit is still served, and no prompt is refused forever.

State exists only for tenants with a quota and, for queues, only while they hold
requests, so it stays bounded whatever names clients invent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from .request import EngineOverloaded, Request

WINDOW_SECONDS = 60


class QuotaExceeded(EngineOverloaded):
    """A tenant's quota refuses a request (UNAVAILABLE: retry later)."""


class TokenWindow:
    """Tokens served over the last WINDOW_SECONDS, in 1 s buckets."""

    __slots__ = ("_buckets", "_total")

    def __init__(self) -> None:
        self._buckets: deque[list] = deque()  # [second, tokens]
        self._total = 0

    def add(self, tokens: int, now: float) -> None:
        second = int(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([second, tokens])
        self._total += tokens

    def used(self, now: float) -> int:
        oldest = int(now) - WINDOW_SECONDS
        while self._buckets and self._buckets[0][0] <= oldest:
            self._total -= self._buckets.popleft()[1]
        return self._total


class TenantQuotas:
    """Counts queued requests and served tokens per tenant and refuses what a quota forbids (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._queued: dict[str, int] = {}
        self._tokens: dict[str, TokenWindow] = {}

    def accept(self, request: Request) -> None:
        """Count a new request as queued and its prompt as served; raises QuotaExceeded (counting nothing)."""
        limits, tenant = request.limits, request.tenant
        with self._lock:
            queued = self._queued.get(tenant, 0)
            if limits is not None and limits.max_queued_requests and queued >= limits.max_queued_requests:
                raise QuotaExceeded(f"tenant quota exceeded: max_queued_requests={limits.max_queued_requests} "
                                    f"({queued} requests of this tenant are waiting); retry later")
            tpm = limits.tokens_per_minute if limits is not None else 0
            if tpm:
                window = self._tokens.setdefault(tenant, TokenWindow())
                used = window.used(self.clock())
                if used >= tpm:
                    raise QuotaExceeded(f"tenant quota exceeded: tokens_per_minute={tpm} "
                                        f"({used} tokens served in the last {WINDOW_SECONDS} s); retry later")
                window.add(len(request.prompt_token_ids), self.clock())
            self._queued[tenant] = queued + 1
            request.queued = True

    def started(self, request: Request) -> None:
        """The request was admitted for the first time (or ended before): it no longer counts as queued."""
        if not request.queued:
            return
        request.queued = False
        with self._lock:
            left = self._queued.get(request.tenant, 0) - 1
            if left > 0:
                self._queued[request.tenant] = left
            else:
                self._queued.pop(request.tenant, None)

    def served(self, request: Request, tokens: int) -> None:
        """Generated tokens of a tenant with a tokens_per_minute quota."""
        if tokens and request.limits is not None and request.limits.tokens_per_minute:
            with self._lock:
                self._tokens.setdefault(request.tenant, TokenWindow()).add(tokens, self.clock())

    def queued(self, tenant: str) -> int:
        """Requests of this tenant accepted and not yet started."""
        return self._queued.get(tenant, 0)

    def tracked_tenants(self) -> int:
        """Tenants with state here (for bound checks)."""
        return len(self._queued.keys() | self._tokens.keys())
