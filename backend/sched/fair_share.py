"""Per-tenant admission state: fair-share virtual token counters and concurrent-request counts.

``VirtualTokenCounter`` is the Virtual Token Counter of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024): a tenant's counter grows by the tokens it is served
(prompt at first admission, each generated token) divided by its weight; admission serves
the backlogged tenant with the least counter (the waiting queue asks ``counter``); a
tenant that had nothing waiting starts again at no less than the lift level (``lift``), so
time spent idle or under its share banks no credit. An idle tenant's counter is dropped
once it is at or below the lift level (lifting would restore it anyway); at most
``max_idle`` idle counters are kept above it, the lowest dropped first, so millions of
one-shot tenant names cannot grow the state.

``ActiveRequests`` counts, per tenant, the sequences (samples: a request of ``n`` counts
``n``) of requests from their first admission until each sample ends (running, swapped out,
preempted or not yet forked included): ``max_concurrent_requests``.
"""

from __future__ import annotations

import heapq
import itertools

MAX_IDLE_TENANTS = 4096  # idle counters kept above the lift level


class VirtualTokenCounter:
    """Weighted served tokens per tenant; lifted on return, pruned when idle."""

    __slots__ = ("counters", "max_idle", "_last", "_last_value", "_idle", "_idle_heap", "_tie")

    def __init__(self, max_idle: int = MAX_IDLE_TENANTS) -> None:
        self.counters: dict[str, float] = {}
        self.max_idle = max_idle
        self._last: str | None = None  # the tenant most recently admitted
        self._last_value = 0.0  # its counter, if that was pruned
        self._idle: dict[str, int] = {}  # idle tenant -> tie of its live entry in _idle_heap
        self._idle_heap: list[tuple[float, int, str]] = []
        self._tie = itertools.count()

    def counter(self, tenant: str) -> float:
        """A tenant's counter (0 for one never seen or pruned)."""
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        """Add served tokens, divided by the tenant's weight."""
        counters = self.counters
        counters[tenant] = counters.get(tenant, 0.0) + tokens / weight

    def admit(self, tenant: str, prompt_tokens: int, weight: float) -> None:
        """Charge a request's prompt at its first admission; its tenant becomes the most recently admitted."""
        self.charge(tenant, prompt_tokens, weight)
        self._last = tenant

    def floor(self) -> float:
        """The lift level when no tenant is backlogged: the counter of the tenant most recently admitted."""
        if self._last is None:
            return 0.0
        return self.counters.get(self._last, self._last_value)

    def lift(self, tenant: str, level: float) -> None:
        """A tenant that had nothing waiting gets a new request: its counter becomes max(counter, level)."""
        self._idle.pop(tenant, None)
        if self.counters.get(tenant, 0.0) < level:
            self.counters[tenant] = level
        else:
            self.counters.setdefault(tenant, 0.0)
        self.sweep(level)

    def retire(self, tenant: str, level: float) -> None:
        """A tenant went idle (nothing waiting or running): drop its counter now, or once the level passes it."""
        value = self.counters.get(tenant)
        if value is None or tenant in self._idle:
            return
        if value <= level:
            self._drop(tenant)
        else:
            tie = next(self._tie)
            self._idle[tenant] = tie
            heapq.heappush(self._idle_heap, (value, tie, tenant))
            if len(self._idle_heap) > 64 and len(self._idle_heap) > 2 * len(self._idle):  # drop stale entries
                self._idle_heap = [e for e in self._idle_heap if self._idle.get(e[2]) == e[1]]
                heapq.heapify(self._idle_heap)
        self.sweep(level)

    def sweep(self, level: float) -> None:
        """Drop idle counters at or below `level`, and the lowest ones beyond `max_idle`."""
        heap, idle = self._idle_heap, self._idle
        while heap and (heap[0][0] <= level or len(idle) > self.max_idle):
            _, tie, tenant = heapq.heappop(heap)
            if idle.get(tenant) == tie:  # else it came back since (stale entry)
                del idle[tenant]
                self._drop(tenant)

    def is_idle(self, tenant: str) -> bool:
        """Retired and not back yet (its counter is kept because it is above the lift level)."""
        return tenant in self._idle

    def _drop(self, tenant: str) -> None:
        if tenant == self._last:
            self._last_value = self.counters[tenant]
        del self.counters[tenant]


class ActiveRequests:
    """Sequences each tenant has started and not finished (a request counts its n samples), for max_concurrent_requests."""

    __slots__ = ("counts", "_samples")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}  # tenant -> active sequences (no entry at 0)
        self._samples: dict[int, list] = {}  # id(request) -> [request, samples not finished]

    def start(self, request, samples: int) -> int:
        """Count a request's n samples from its first admission; returns its tenant's count."""
        self._samples[id(request)] = [request, samples]
        count = self.counts[request.tenant] = self.counts.get(request.tenant, 0) + samples
        return count

    def finish(self, request, samples: int) -> int | None:
        """Samples of a started request ended: returns its tenant's remaining count (None: never started)."""
        record = self._samples.get(id(request))
        if record is None:  # never started (ended while queued)
            return None
        record[1] -= samples
        if record[1] <= 0:
            del self._samples[id(request)]
        return self._drop(request.tenant, samples)

    def cancel(self, request) -> int:
        """Stop counting a started request (every sample it still has); returns its tenant's remaining count."""
        _, samples = self._samples.pop(id(request))
        return self._drop(request.tenant, samples)

    def _drop(self, tenant: str, samples: int) -> int:
        count = self.counts[tenant] - samples
        if count > 0:
            self.counts[tenant] = count
        else:
            del self.counts[tenant]
        return max(count, 0)

    def is_started(self, request) -> bool:
        """Counted (admitted once and some sample not finished)."""
        return id(request) in self._samples

    def check(self, samples: dict[int, list]) -> None:
        """Raise unless the counts equal `samples` (id(request) -> [request, live samples]), recomputed from scratch."""
        got = {key: (rec[0].request_id, rec[1]) for key, rec in self._samples.items()}
        want = {key: (rec[0].request_id, rec[1]) for key, rec in samples.items()}
        if got != want:
            raise AssertionError(f"active requests {got} != recomputed {want}")
        counts: dict[str, int] = {}
        for request, live in samples.values():
            counts[request.tenant] = counts.get(request.tenant, 0) + live
        if counts != self.counts:
            raise AssertionError(f"active counts per tenant {self.counts} != recomputed {counts}")
