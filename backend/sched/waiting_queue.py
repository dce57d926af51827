"""The waiting queue: preempted sequences first, then new ones, one policy-ordered heap per tenant.

Preempted sequences (recompute mode) wait in a front deque, most recent victim first: they
have already streamed tokens (and their tenant was charged), so they resume before anything
new is admitted, whatever their tenant. New sequences wait in their tenant's heap, ordered
by the admission policy's key. A heap of tenants picks whose head goes next: with fair
share (a ``VirtualTokenCounter``) the tenant with the least counter; without, the tenant
whose head has the smallest key, which merges the tenant heaps into exactly the one global
policy order. A blocked tenant (at its concurrency limit) leaves the tenant heap; its
sequences stay queued.

Tenant entries are lazy. An entry's stored rank never exceeds its tenant's true rank:
counters only grow, a head only moves later, and a push that becomes a tenant's new head
(a smaller key) re-enters the tenant. So ``take`` refreshes a stale top and the first
current top is the true minimum; a tenant is refreshed at most once per change of its rank.
Removal (abort, timeout) is lazy too. push, take, remove: O(log n + log T) for n waiting
sequences of T tenants.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from loraplex.sched.fair_share import VirtualTokenCounter
from loraplex.sched.policies import AdmissionKey
from loraplex.engine.request import Sequence


class _Tenant:
    """One tenant's waiting new sequences: a heap of [key, tie, seq or None (removed)]."""

    __slots__ = ("name", "heap", "live", "entry")

    def __init__(self, name: str) -> None:
        self.name = name
        self.heap: list[list] = []
        self.live = 0
        self.entry: list | None = None  # its [rank, tie, self] in the tenant heap (None: out of it)


class WaitingQueue:
    """Front deque of resumed sequences + per-tenant keyed heaps of new ones; take() gives the next to admit."""

    __slots__ = ("_key", "_vtc", "_front", "_tenants", "_order", "_entered", "_entries", "_blocked", "_counter")

    def __init__(self, key: AdmissionKey, vtc: VirtualTokenCounter | None = None) -> None:
        self._key = key
        self._vtc = vtc
        self._front: deque[Sequence] = deque()
        self._tenants: dict[str, _Tenant] = {}  # tenants with new sequences waiting
        self._order: list[list] = []  # tenant heap: [rank, tie, _Tenant or None (stale)]
        self._entered = 0  # tenants with a live entry in _order
        self._entries: dict[int, list] = {}  # seq_id -> its entry in its tenant's heap
        self._blocked: set[str] = set()
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._front) + len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        """Admission order as things stand (tests and introspection; with fair share, counters will move)."""
        yield from self._front
        if self._vtc is None:
            yield from (e[2] for e in sorted(self._entries.values(), key=lambda e: (e[0], e[1])))
            return
        ranked = sorted(self._tenants.values(), key=lambda t: (t.name in self._blocked, self._vtc.counter(t.name)))
        for tenant in ranked:
            yield from (e[2] for e in sorted(tenant.heap, key=lambda e: (e[0], e[1])) if e[2] is not None)

    def sequences(self) -> Iterator[Sequence]:
        """Every waiting sequence, in no order (metrics: O(n), no sorting)."""
        yield from self._front
        yield from (e[2] for e in self._entries.values())

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._entries or seq in self._front

    def push(self, seq: Sequence) -> None:
        """Queue a newly arrived sequence in policy order; with fair share, lift its tenant if it had none waiting."""
        if self._vtc is not None and seq.request.tenant not in self._tenants:
            self._vtc.lift(seq.request.tenant, self.level())
        self._insert(seq)

    def push_front(self, seq: Sequence) -> None:
        """Queue a preempted sequence ahead of everything."""
        self._front.appendleft(seq)

    def take(self) -> Sequence | None:
        """Remove and return the next sequence to admit (None: nothing admissible, e.g. every tenant blocked)."""
        if self._front:
            return self._front.popleft()
        tenant = self._top()
        if tenant is None:
            return None
        heap = tenant.heap
        seq = heapq.heappop(heap)[2]
        while seq is None:  # removed entries
            seq = heapq.heappop(heap)[2]
        del self._entries[seq.seq_id]
        tenant.live -= 1
        if not tenant.live:
            self._drop(tenant)
        return seq

    def pop(self) -> Sequence:
        """take(), raising IndexError when nothing is admissible."""
        seq = self.take()
        if seq is None:
            raise IndexError("pop from an empty WaitingQueue")
        return seq

    def unpop(self, seqs: list[Sequence]) -> None:
        """Put back sequences popped (in this order) but not admitted, where they were (no lift)."""
        for seq in reversed(seqs):
            if seq.num_preemptions:
                self._front.appendleft(seq)
            else:
                self._insert(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (abort, timeout)."""
        entry = self._entries.pop(seq.seq_id, None)
        if entry is None:
            self._front.remove(seq)
            return
        entry[2] = None
        tenant = self._tenants[seq.request.tenant]
        tenant.live -= 1
        if not tenant.live:
            self._drop(tenant)
        elif len(tenant.heap) > 64 and len(tenant.heap) > 2 * tenant.live:  # keep the heap compact
            tenant.heap = [e for e in tenant.heap if e[2] is not None]
            heapq.heapify(tenant.heap)

    # ---- tenants ---------------------------------------------------------------------
    def has_tenant(self, name: str) -> bool:
        """The tenant has new sequences waiting (blocked or not)."""
        return name in self._tenants

    def block(self, name: str) -> None:
        """Hold a tenant's new sequences back (at its concurrency limit); they stay queued."""
        if name in self._blocked:
            return
        self._blocked.add(name)
        tenant = self._tenants.get(name)
        if tenant is not None and tenant.entry is not None:
            self._leave(tenant)

    def unblock(self, name: str) -> None:
        """Let a blocked tenant's sequences be admitted again."""
        if name not in self._blocked:
            return
        self._blocked.discard(name)
        tenant = self._tenants.get(name)
        if tenant is not None:
            self._enter(tenant)

    def level(self) -> float:
        """Fair share's lift level: the least counter among backlogged tenants, else the last admitted one's."""
        tenant = self._top()
        return self._vtc.counter(tenant.name) if tenant is not None else self._vtc.floor()

    def check(self) -> None:
        """Raise unless the heaps, entries, tenant entries and blocks agree (tests)."""
        live = 0
        for name, tenant in self._tenants.items():
            entries = [e for e in tenant.heap if e[2] is not None]
            assert tenant.live == len(entries) > 0, (name, tenant.live, len(entries))
            assert all(self._entries[e[2].seq_id] is e and e[2].request.tenant == name for e in entries), name
            assert (tenant.entry is None) == (name in self._blocked), name
            if tenant.entry is not None:
                assert tenant.entry[2] is tenant and tenant.entry[0] <= self._rank(tenant), name
            live += len(entries)
        assert live == len(self._entries)
        entered = [e for e in self._order if e[2] is not None]
        assert len(entered) == self._entered and all(e[2].entry is e for e in entered)
        assert all(s.num_preemptions for s in self._front)

    def _insert(self, seq: Sequence) -> None:
        name = seq.request.tenant
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(name)
        entry = [self._key(seq), next(self._counter), seq]
        self._entries[seq.seq_id] = entry
        heapq.heappush(tenant.heap, entry)
        tenant.live += 1
        if name in self._blocked:
            return
        if tenant.entry is None or (self._vtc is None and (entry[0], entry[1]) < tenant.entry[0]):
            self._enter(tenant)  # new to the tenant heap, or (by key) its new head ranks earlier

    def _rank(self, tenant: _Tenant):
        """Fair share: the tenant's counter; else its head's (key, tie)."""
        if self._vtc is not None:
            return self._vtc.counter(tenant.name)
        heap = tenant.heap
        while heap[0][2] is None:
            heapq.heappop(heap)
        return (heap[0][0], heap[0][1])

    def _top(self) -> _Tenant | None:
        """The tenant whose sequence goes next, refreshing stale entries on the way."""
        order = self._order
        while order:
            entry = order[0]
            tenant = entry[2]
            if tenant is None:
                heapq.heappop(order)
                continue
            rank = self._rank(tenant)
            if rank == entry[0]:
                return tenant
            entry[2] = None  # stale (its rank grew): replace it
            tenant.entry = fresh = [rank, next(self._counter), tenant]
            heapq.heapreplace(order, fresh)
        return None

    def _enter(self, tenant: _Tenant) -> None:
        if tenant.entry is not None:
            tenant.entry[2] = None
        else:
            self._entered += 1
        tenant.entry = [self._rank(tenant), next(self._counter), tenant]
        heapq.heappush(self._order, tenant.entry)
        if len(self._order) > 64 and len(self._order) > 2 * self._entered:  # drop stale entries
            self._order = [e for e in self._order if e[2] is not None]
            heapq.heapify(self._order)

    def _leave(self, tenant: _Tenant) -> None:
        tenant.entry[2] = None
        tenant.entry = None
        self._entered -= 1

    def _drop(self, tenant: _Tenant) -> None:
        """A tenant with nothing left waiting."""
        if tenant.entry is not None:
            self._leave(tenant)
        del self._tenants[tenant.name]
