"""Per-tenant request quotas checked when a request arrives: max_queued_requests, tokens_per_minute, the queue share.

Each refuses at once with UNAVAILABLE, naming the quota; nothing is queued and nothing is
counted. (``max_concurrent_requests`` is not a refusal: the scheduler keeps such requests
queued.) A request counts as queued from acceptance until it is first admitted or ends.

``tokens_per_minute`` bounds what a request *may* cost: accepting one reserves its prompt plus
``n × max_tokens``. Served tokens (the prompt at acceptance, each generated token as it is
produced) go into a sliding 60 s window of 1 s buckets; the generated tokens a request has
not produced yet stay *outstanding* until it ends, however it ends (``ended``), when the rest
is given back. A request is accepted while window + outstanding + its cost stays within the
quota; one that could never fit (its cost alone is over the quota) is refused as invalid.

State exists only for tenants with a quota and, for queues, only while they hold requests,
so it stays bounded whatever names clients invent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from loraplex.exceptions import InvalidRequest, QuotaExceeded
from loraplex.tenancy.queue_share import QueueShare
from loraplex.engine.request import Request

WINDOW_SECONDS = 60


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
    """Counts queued requests, served and reserved tokens per tenant; refuses what a quota forbids (thread-safe)."""

    def __init__(self, max_waiting_requests: int = 1 << 62, tenant_queue_share: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self.share = QueueShare(max_waiting_requests, tenant_queue_share)
        self._tokens: dict[str, TokenWindow] = {}
        self._outstanding: dict[str, int] = {}  # tenant -> generated tokens reserved and not served yet

    def accept(self, request: Request) -> None:
        """Count a new request as queued and reserve its tokens; raises QuotaExceeded, QueueFull, EngineOverloaded
        or InvalidRequest (a cost over tokens_per_minute), counting nothing."""
        limits, tenant = request.limits, request.tenant
        with self._lock:
            queued = self.share.waiting.get(tenant, 0)
            if limits is not None and limits.max_queued_requests and queued >= limits.max_queued_requests:
                raise QuotaExceeded(f"tenant quota exceeded: max_queued_requests={limits.max_queued_requests} "
                                    f"({queued} requests of this tenant are waiting); retry later")
            tpm = limits.tokens_per_minute if limits is not None else 0
            if tpm:
                prompt, generated = self._check_tokens(request, tpm)
            self.share.admit(request)
            if tpm:
                self._tokens[tenant].add(prompt, self.clock())
                self._outstanding[tenant] = self._outstanding.get(tenant, 0) + generated
                request.reserved_tokens = generated
            request.queued = True

    def _check_tokens(self, request: Request, tpm: int) -> tuple[int, int]:
        """(prompt, generated tokens to reserve) if the request fits the tenant's tokens_per_minute; else raises."""
        params = request.params
        prompt, generated = len(request.prompt_token_ids), params.n * params.max_tokens
        cost = prompt + generated
        if cost > tpm:
            raise InvalidRequest(f"the request may use {cost} tokens (prompt {prompt} + n {params.n} x max_tokens "
                                 f"{params.max_tokens}), more than the tenant's tokens_per_minute={tpm}; "
                                 "lower max_tokens or n")
        window = self._tokens.setdefault(request.tenant, TokenWindow())
        used = window.used(self.clock()) + self._outstanding.get(request.tenant, 0)
        if used + cost > tpm:
            raise QuotaExceeded(f"tenant quota exceeded: tokens_per_minute={tpm} ({used} tokens served or "
                                f"reserved in the last {WINDOW_SECONDS} s, this request may use {cost}); retry later")
        return prompt, generated

    def started(self, request: Request) -> None:
        """The request was admitted for the first time (or ended before): it no longer counts as queued."""
        if not request.queued:
            return
        request.queued = False
        with self._lock:
            self.share.release(request)

    def served(self, request: Request, tokens: int) -> None:
        """Generated tokens of a request of a tenant with tokens_per_minute: from its reservation into the window
        (a sample's last token may come after its request ended and gave back its reservation)."""
        with self._lock:
            self._tokens[request.tenant].add(tokens, self.clock())
            taken = min(tokens, request.reserved_tokens)
            if taken <= 0:
                return
            request.reserved_tokens -= taken
            self._unreserve(request.tenant, taken)

    def ended(self, request: Request) -> None:
        """The request ended, however: free its queue place and give back the tokens it did not use."""
        self.started(request)
        if not request.reserved_tokens:
            return
        with self._lock:
            unused, request.reserved_tokens = request.reserved_tokens, 0
            self._unreserve(request.tenant, unused)

    def _unreserve(self, tenant: str, tokens: int) -> None:
        """Take reserved tokens off the tenant's outstanding count (the caller holds the lock; no entry at 0)."""
        left = self._outstanding[tenant] - tokens
        if left:
            self._outstanding[tenant] = left
        else:
            del self._outstanding[tenant]

    def queued(self, tenant: str) -> int:
        """Requests of this tenant accepted and not yet started."""
        return self.share.waiting.get(tenant, 0)

    def outstanding(self, tenant: str) -> int:
        """Generated tokens this tenant's requests reserved and have not produced yet."""
        return self._outstanding.get(tenant, 0)

    def used(self, tenant: str) -> int:
        """Tokens served to the tenant over the window plus those outstanding (what tokens_per_minute compares)."""
        with self._lock:
            window = self._tokens.get(tenant)
            return (window.used(self.clock()) if window else 0) + self._outstanding.get(tenant, 0)

    def tracked_tenants(self) -> int:
        """Tenants with state here (for bound checks)."""
        return len(self.share.waiting.keys() | self._tokens.keys() | self._outstanding.keys())
