"""Admission off Triton's execute() thread: worker threads tokenize and queue requests, tenants in turn.

execute() only parses a request (bounded: the prompt's byte bound is checked there) and hands
it here; it never tokenizes. Each tenant's requests wait in their own FIFO; workers take the
tenants with work in round-robin order, one request per turn, and a tenant occupies at most
``workers - 1`` workers at once (1 when there is one worker), so with two or more workers a
tenant flooding max-size prompts leaves a worker free for everyone else and delays only
itself. (The tokenizers release the GIL while they work.) A tenant's requests are admitted
in arrival order while it may use one worker.

The backlog is bounded in prompt characters: per tenant ``TENANT_BACKLOG_CHARS`` (a tenant
with nothing waiting always gets one request in), and across tenants ``max_backlog_chars``
(development mode: client-named tenants are unbounded in number). Over either, the request
is refused at once with UNAVAILABLE. Every job ends exactly once: run by a worker, or failed
by ``close``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from loraplex.exceptions import EngineOverloaded, EngineShuttingDown, QuotaExceeded

log = logging.getLogger("loraplex.admission")

TENANT_BACKLOG_CHARS = 8 << 20  # prompt characters one tenant may have waiting for a worker
DEVELOPMENT_BACKLOG_CHARS = 64 << 20  # all tenants together, without a tenants file


@dataclass(slots=True)
class Job:
    """One request to admit: run() on a worker, or fail(exc) if the pool closes first."""

    tenant: str
    size: int  # prompt characters (the backlog's unit)
    run: Callable[[], None]
    fail: Callable[[Exception], None]


class AdmissionPool:
    """Worker threads that run admission jobs, tenants in round-robin turn (thread-safe)."""

    def __init__(self, workers: int, max_backlog_chars: int | None = None,
                 tenant_backlog_chars: int = TENANT_BACKLOG_CHARS):
        self.per_tenant = max(1, workers - 1)
        self.max_backlog_chars, self.tenant_backlog_chars = max_backlog_chars, tenant_backlog_chars
        self._cond = threading.Condition()
        self._jobs: dict[str, deque[Job]] = {}  # tenant -> jobs waiting for a worker (no entry when none)
        self._chars: dict[str, int] = {}  # tenant -> their prompt characters
        self._total_chars = 0
        self._running: dict[str, int] = {}  # tenant -> jobs on a worker now (no entry at 0)
        self._turns: deque[str] = deque()  # tenants with a job they may start now, in turn order
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"loraplex-admission-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job behind its tenant's; raises QuotaExceeded or EngineOverloaded (backlog full) or
        EngineShuttingDown (closed), and then the job is not kept."""
        tenant = job.tenant
        with self._cond:
            if self._closed:
                raise EngineShuttingDown("the model is shutting down; retry on another replica")
            chars = self._chars.get(tenant, 0)
            if chars and chars + job.size > self.tenant_backlog_chars:
                raise QuotaExceeded(f"tenant quota exceeded: {len(self._jobs[tenant])} requests of this tenant "
                                    f"({chars} characters) are waiting to be tokenized; retry later")
            if self.max_backlog_chars is not None and self._total_chars \
                    and self._total_chars + job.size > self.max_backlog_chars:
                raise EngineOverloaded(f"server overloaded: {self._total_chars} characters of prompts are waiting "
                                       "to be tokenized; retry later")
            jobs = self._jobs.get(tenant)
            if jobs is None:
                jobs = self._jobs[tenant] = deque()
                if self._running.get(tenant, 0) < self.per_tenant:
                    self._turns.append(tenant)
            jobs.append(job)
            self._chars[tenant] = chars + job.size
            self._total_chars += job.size
            self._cond.notify()

    def backlog(self, tenant: str) -> int:
        """Jobs of this tenant waiting for a worker."""
        with self._cond:
            return len(self._jobs.get(tenant, ()))

    def close(self) -> None:
        """Refuse new jobs, fail those not started (EngineShuttingDown), and let the workers end."""
        with self._cond:
            self._closed = True
            pending = [job for jobs in self._jobs.values() for job in jobs]
            self._jobs.clear()
            self._chars.clear()
            self._turns.clear()
            self._total_chars = 0
            self._cond.notify_all()
        error = EngineShuttingDown("the model is shutting down; the request did not start")
        for job in pending:
            self._end(job, job.fail, error)

    def _take(self) -> Job | None:
        """The next tenant's oldest job (None: closed), counted as running."""
        with self._cond:
            while not self._turns:
                if self._closed:
                    return None
                self._cond.wait()
            tenant = self._turns.popleft()
            jobs = self._jobs[tenant]
            job = jobs.popleft()
            if not jobs:
                del self._jobs[tenant], self._chars[tenant]
            else:
                self._chars[tenant] -= job.size
            self._total_chars -= job.size
            running = self._running[tenant] = self._running.get(tenant, 0) + 1
            if jobs and running < self.per_tenant:
                self._turns.append(tenant)  # its next job waits for the other tenants' turns
            return job

    def _done(self, tenant: str) -> None:
        with self._cond:
            running = self._running[tenant] - 1
            if running:
                self._running[tenant] = running
            else:
                del self._running[tenant]
            if tenant in self._jobs and running == self.per_tenant - 1 and not self._closed:
                self._turns.append(tenant)  # it was held back at its limit: its turn comes again
                self._cond.notify()

    def _work(self) -> None:
        while (job := self._take()) is not None:
            try:
                self._end(job, job.run)
            finally:
                self._done(job.tenant)

    @staticmethod
    def _end(job: Job, action, *args) -> None:
        try:
            action(*args)
        except Exception:  # a worker must never die; the job answers its own errors
            log.exception("admission of a request of tenant %s failed", job.tenant)
