"""What the engine records for metrics: plain counters and histogram observations, no IPC.

The engine's threads write here (the loop, and Triton's thread for acceptances and
refusals); the metrics publisher (backend/triton/metrics_publisher.py) reads snapshots and
drains the observations on its own thread. Every count is per tenant *label*
(`Request.metric_label`, bounded by `TenantLabels`).
"""

from __future__ import annotations

import threading
from collections import deque

from loraplex.exceptions import (AdapterError, AdapterNotFound, AdapterStoreError, EngineOverloaded, EngineShuttingDown, InvalidApiKey, InvalidRequest, RequestCancelled)
from loraplex.engine.request import Request

# histograms observed per request (per tenant) and per step (no tenant)
TTFT, TPOT, E2E, QUEUE = "time_to_first_token_seconds", "time_per_output_token_seconds", \
    "e2e_request_latency_seconds", "queue_time_seconds"
BATCH_SEQUENCES, BATCH_TOKENS, STEP_HOST = "batch_sequences", "batch_tokens", "step_host_seconds"
STEP_SECONDS, ADAPTER_LOAD = "step_seconds", "adapter_load_seconds"

MAX_PENDING_OBSERVATIONS = 100_000  # unpublished observations kept at most (the oldest go first)

FAILURE_REASONS = ("invalid", "not_found", "unauthenticated", "quota", "cancelled", "timeout", "internal")
SUCCESS_FINISH_REASONS = frozenset(("stop", "length"))

_REASON_OF_ERROR = (  # first match wins: subclasses before their bases
    (InvalidApiKey, "unauthenticated"),
    (InvalidRequest, "invalid"),
    (AdapterError, "invalid"),
    (AdapterStoreError, "invalid"),
    (AdapterNotFound, "not_found"),
    (EngineShuttingDown, "cancelled"),
    (EngineOverloaded, "quota"),  # a tenant's quota (QuotaExceeded) or the server's max_waiting_requests
    (RequestCancelled, "cancelled"),
)


def failure_reason(exc: BaseException | None) -> str:
    """The `reason` label of a request that failed with this exception."""
    for kind, reason in _REASON_OF_ERROR:
        if isinstance(exc, kind):
            return reason
    return "internal"


def _add(counts: dict, key, amount: int = 1) -> None:
    counts[key] = counts.get(key, 0) + amount


class EngineStats:
    """Monotonic counters per tenant label, and a queue of histogram observations (name, label, value)."""

    def __init__(self) -> None:
        # appended by the engine, popped by the publisher (a deque's ends are thread-safe)
        self.observations: deque = deque(maxlen=MAX_PENDING_OBSERVATIONS)
        self.accepted: dict[str, int] = {}  # written under the engine's accept lock (Triton's thread)
        self.started: dict[str, int] = {}  # first scheduled
        self.ended_started: dict[str, int] = {}
        self.ended_unstarted: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.succeeded: dict[str, int] = {}
        self.failed: dict[tuple[str, str], int] = {}  # (label, reason), ended by the engine
        self.refused: dict[tuple[str, str], int] = {}  # (label, reason), refused before reaching the engine
        self._refused_lock = threading.Lock()
        self.tenants_file_reload_failures = 0  # checks that found the tenants file unloadable (set by the model)

    def discard_observations(self) -> None:
        """No publisher will drain them (custom metrics off): record none."""
        self.observations = deque(maxlen=0)

    # ---- Triton's thread -------------------------------------------------------------
    def accept(self, request: Request) -> None:
        """The engine queued the request (call under the engine's accept lock)."""
        _add(self.accepted, request.metric_label)

    def refuse(self, label: str, exc: BaseException) -> None:
        """A request ended before the engine held it (bad input, unknown adapter, over quota...)."""
        with self._refused_lock:
            _add(self.refused, (label, failure_reason(exc)))

    # ---- the loop thread -------------------------------------------------------------
    def start(self, request: Request, now: float) -> None:
        """The request's first admission: it leaves the queue (queue time) and its prompt is processed."""
        request.scheduled_time = now
        label = request.metric_label
        _add(self.started, label)
        _add(self.prompt_tokens, label, len(request.prompt_token_ids))
        self.observations.append((QUEUE, label, now - request.arrival_time))

    def first_token(self, request: Request, now: float) -> None:
        """The request's first generated token (any sample)."""
        request.first_token_time = now
        self.observations.append((TTFT, request.metric_label, now - request.arrival_time))

    def end(self, request: Request, finish_reason: str, exc: BaseException | None, now: float) -> None:
        """Once per request the engine held, however it ended."""
        label = request.metric_label
        _add(self.ended_started if request.scheduled_time is not None else self.ended_unstarted, label)
        if finish_reason in SUCCESS_FINISH_REASONS and exc is None:
            _add(self.succeeded, label)
        else:
            reason = "timeout" if finish_reason == "timeout" else "cancelled" if finish_reason == "abort" \
                else failure_reason(exc)
            _add(self.failed, (label, reason))
        observe = self.observations.append
        observe((E2E, label, now - request.arrival_time))
        if request.token_steps >= 2:
            observe((TPOT, label, (request.last_token_time - request.first_token_time) / (request.token_steps - 1)))

    def step(self, num_sequences: int, num_tokens: int, host_seconds: float) -> None:
        """One step that ran the model: its batch and the host time outside runner.execute."""
        observe = self.observations.append
        observe((BATCH_SEQUENCES, None, num_sequences))
        observe((BATCH_TOKENS, None, num_tokens))
        observe((STEP_HOST, None, host_seconds))

    # ---- any thread (the publisher) --------------------------------------------------
    def step_time(self, seconds: float, loading: bool) -> None:
        """A step's wall time; ``loading``: an adapter was read from disk or copied into a slot meanwhile."""
        self.observations.append((STEP_SECONDS, "true" if loading else "false", seconds))

    def adapter_load(self, stage: str, seconds: float) -> None:
        """One adapter load's latency: stage "disk_read" (the preloader's thread or the loop) or "host_to_device"."""
        self.observations.append((ADAPTER_LOAD, stage, seconds))

    def requests_by_state(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting) requests per label: started and not ended; accepted and not started."""
        accepted, started = dict(self.accepted), dict(self.started)
        ended_started, ended_unstarted = dict(self.ended_started), dict(self.ended_unstarted)
        running = {label: n - ended_started.get(label, 0) for label, n in started.items()}
        waiting = {label: n - started.get(label, 0) - ended_unstarted.get(label, 0) for label, n in accepted.items()}
        return running, waiting

    def failures(self) -> dict[tuple[str, str], int]:
        """Failed requests per (label, reason), the engine's and the refusals before it."""
        with self._refused_lock:
            total = dict(self.refused)
        for key, n in dict(self.failed).items():
            total[key] = total.get(key, 0) + n
        return total

    def drain(self) -> list:
        """Every observation recorded since the last drain, oldest first."""
        observations, pop = [], self.observations.popleft
        try:
            while True:
                observations.append(pop())
        except IndexError:
            return observations
