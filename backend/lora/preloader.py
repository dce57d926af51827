"""Reads cold adapters from disk on a worker thread, so that loading one never stalls the engine loop.

A request whose adapter is neither in host memory nor in a device slot waits here, not in
the engine's inbox: the worker reads and validates the folder (``AdapterManager.read``),
then hands the request on with the result; the loop thread only adopts the validated copy
into its host tier (``AdapterManager.adopt``). A read that fails hands the request on with
nothing: the loop reads it again and fails that request alone with the adapter's error.

The worker is shared by every tenant, and a read is not free (a DoRA adapter's norms, decision 060),
so the reads wait in one lane per tenant and the worker serves the lanes by start-time fair queuing:
each read's seconds are charged to its lane, and the next read comes from the backlogged lane charged
least (a lane that was idle starts level with the one being served: idle time banks no credit). A
tenant that queues many expensive reads delays another tenant's cold load by at most the one read in
progress. Requests of one lane for an adapter already queued there share its read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from typing import Callable

log = logging.getLogger("loraplex.lora")


def lane_of(request, name: str) -> str:
    """The tenant a read is charged to: the request's, else the owner in the adapter key (``<tenant>/...``)."""
    tenant = getattr(request, "tenant", None)
    if isinstance(tenant, str):
        return tenant
    return name.split("/", 1)[0] if "/" in name else ""


class _Read:
    __slots__ = ("name", "folder", "lane", "requests")

    def __init__(self, name: str, folder: str, lane: str, request) -> None:
        self.name, self.folder, self.lane, self.requests = name, folder, lane, [request]


class AdapterPreloader:
    """One daemon worker thread, started on first use; ``deliver(request, preloaded_or_None)`` runs on it."""

    def __init__(self, read: Callable, deliver: Callable, clock: Callable[[], float] = time.perf_counter) -> None:
        self._read, self._deliver, self._clock = read, deliver, clock
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pending: Counter = Counter()  # adapter name -> requests submitted and not delivered yet
        self._lanes: dict[str, deque[_Read]] = {}  # backlogged lanes only, in the order they became so
        self._queued: dict[tuple[str, str, str], _Read] = {}  # (lane, name, folder) -> read not started yet
        self._charged: dict[str, float] = {}  # lane -> its start tag: seconds of reads charged (fair queuing)
        self._now = 0.0  # the start tag of the read in progress (virtual time)

    def loading(self) -> int:
        """Distinct adapters being read (submitted, not delivered yet): the host tier's loading gauge."""
        with self._cond:
            return len(self._pending)

    def charged(self) -> dict[str, float]:
        """Seconds of reads charged per lane (tenant) that the fair queue still remembers."""
        with self._cond:
            return dict(self._charged)

    def submit(self, request, name: str, folder: str) -> None:
        """Read adapter ``name`` from ``folder`` for ``request``, then deliver it."""
        lane = lane_of(request, name)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="loraplex-adapter-load", daemon=True)
                self._thread.start()
            self._pending[name] += 1
            queued = self._queued.get((lane, name, folder))
            if queued is not None:
                queued.requests.append(request)
                return
            job = self._queued[(lane, name, folder)] = _Read(name, folder, lane, request)
            if lane not in self._lanes:
                self._lanes[lane] = deque()
                self._charged[lane] = max(self._charged.get(lane, 0.0), self._now)
            self._lanes[lane].append(job)
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the reads already submitted (their requests are delivered), then stop the worker."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)

    def _next(self) -> _Read | None:
        """The next read: the backlogged lane charged least (the earliest backlogged on a tie); None to stop."""
        while not self._lanes:
            if self._thread is not threading.current_thread():
                return None
            self._cond.wait()
        lane = min(self._lanes, key=self._charged.__getitem__)
        jobs = self._lanes[lane]
        job = jobs.popleft()
        if not jobs:
            del self._lanes[lane]
        del self._queued[(lane, job.name, job.folder)]
        self._now = self._charged[lane]
        for idle in [k for k, v in self._charged.items() if k not in self._lanes and k != lane and v <= self._now]:
            del self._charged[idle]  # it would start level with the served lane anyway
        return job

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            start = self._clock()
            try:
                preloaded = self._read(job.name, job.folder)
            except Exception:  # the loop thread reads it again and fails that request alone
                log.debug("preloading adapter %r failed; the engine loop will report it", job.name, exc_info=True)
                preloaded = None
            with self._cond:
                self._charged[job.lane] = self._charged.get(job.lane, self._now) + (self._clock() - start)
                self._pending[job.name] -= len(job.requests)
                if self._pending[job.name] <= 0:
                    del self._pending[job.name]
            for request in job.requests:
                try:
                    self._deliver(request, preloaded)
                except Exception:  # the worker must never die
                    log.exception("handing request %s on after its adapter load failed",
                                  getattr(request, "request_id", request))
