"""Each tenant's share of the global waiting queue (max_waiting_requests): a flood refuses only the flooder.

With a tenants file, ``reserved = floor(W × tenant_queue_share)`` of the W places is divided
among the file's tenants by weight: tenant i's *part* is ``max(1, floor(reserved × weight_i /
Σ weight))``. The other ``W − reserved`` places are *shared*, first come. A request is
accepted into its tenant's part while the tenant has fewer requests waiting than its part;
otherwise it borrows a shared place, if one is free. So

- a tenant below its part is always accepted, whatever the others do;
- the queue never holds more than ``Σ parts + shared ≤ W + tenants`` requests (memory bound);
- a flooding tenant holds at most its part plus the shared places, and is the one refused.

Without a tenants file (development mode) there are no parts: every place is shared, which
is the plain global bound with its "server overloaded" refusal.

A request holds the kind of place it was given (``request.borrowed``) until it first starts
or ends, so the counts stay exact whatever order requests leave in; a tenant's own place
that frees is its own again, even while requests of it still hold shared places.
"""

from __future__ import annotations

from loraplex.exceptions import EngineOverloaded, QueueFull
from loraplex.engine.request import Request


class QueueShare:
    """Waiting requests per tenant, and which of them borrow a shared place (not thread-safe: the caller locks)."""

    __slots__ = ("capacity", "reserved", "waiting", "own", "borrowed")

    def __init__(self, capacity: int, reserved_fraction: float) -> None:
        self.capacity = capacity
        self.reserved = int(capacity * reserved_fraction)
        self.waiting: dict[str, int] = {}  # tenant -> requests accepted and not started (no entry at 0)
        self.own: dict[str, int] = {}  # tenant -> of those, the ones in its own part (no entry at 0)
        self.borrowed = 0  # of those, the ones in shared places

    def part(self, request: Request) -> int:
        """The places kept for the request's tenant (0 in development mode)."""
        limits = request.limits
        if limits is None or not limits.authenticated or not limits.queue_fraction:
            return 0
        return max(1, int(self.reserved * limits.queue_fraction))

    def shared(self, request: Request) -> int:
        """Places anyone may borrow: what the tenants' parts leave (all of them in development mode)."""
        authenticated = request.limits is not None and request.limits.authenticated
        return self.capacity - self.reserved if authenticated else self.capacity

    def admit(self, request: Request) -> None:
        """Count a request as waiting in its tenant's part or a shared place; raises EngineOverloaded or QueueFull."""
        tenant = request.tenant
        waiting, part = self.waiting.get(tenant, 0), self.part(request)
        own = self.own.get(tenant, 0)
        borrow = own >= part
        if borrow and self.borrowed >= self.shared(request):
            if not part:
                total = sum(self.waiting.values())
                raise EngineOverloaded(f"server overloaded: {total} requests are waiting "
                                       f"(max_waiting_requests={self.capacity}); retry later")
            raise QueueFull(f"tenant quota exceeded: {waiting} requests of this tenant are waiting, its share of "
                            f"the queue is {part} (max_waiting_requests={self.capacity}) and the shared part is "
                            f"full; retry later")
        self.waiting[tenant] = waiting + 1
        if borrow:
            self.borrowed += 1
        else:
            self.own[tenant] = own + 1
        request.borrowed = borrow

    def release(self, request: Request) -> None:
        """A counted request started or ended: its place is free."""
        tenant = request.tenant
        left = self.waiting[tenant] - 1
        if left:
            self.waiting[tenant] = left
        else:
            del self.waiting[tenant]
        if request.borrowed:
            request.borrowed = False
            self.borrowed -= 1
            return
        own = self.own[tenant] - 1
        if own:
            self.own[tenant] = own
        else:
            del self.own[tenant]

    def total(self) -> int:
        """Requests waiting, every tenant."""
        return sum(self.waiting.values())
