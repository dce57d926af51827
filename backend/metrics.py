"""Engine counters -> Triton custom metrics (prefix `loraplex_`, on Triton's metrics port)."""

from __future__ import annotations

import threading

OTHER_TENANTS = "other"

# Every metric family the lora_llm model exports on Triton's metrics port, by the name Prometheus
# sees (a histogram by its base name; the port shows it as _bucket, _sum and _count). The Grafana
# dashboard and the alert rules in deploy/ may query only these (tests/deploy checks it).
EXPORTED_METRICS = frozenset(f"loraplex_{name}" for name in (
    "requests_running", "requests_waiting",
    "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "request_failure_total", "request_finished_total",
    "time_to_first_token_seconds", "time_per_output_token_seconds",
    "e2e_request_latency_seconds", "queue_time_seconds",
    "kv_cache_blocks", "prefix_cache_query_tokens_total", "prefix_cache_hit_tokens_total",
    "adapters_resident", "adapter_loads_total", "adapter_evictions_total", "adapter_uploads_total",
    "adapter_pins", "preemptions_total", "admission_cap", "num_sequences",
    "batch_sequences", "batch_tokens", "step_host_seconds",
))


class TenantLabels:
    """Bounded tenant label values: authenticated tenants (a tenants file) keep their names; in
    development mode the first `max_distinct` names clients send do, and the rest count as "other"."""

    def __init__(self, max_distinct: int):
        self.max_distinct = max_distinct
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant: str, authenticated: bool) -> str:
        if authenticated or tenant in self._seen:
            return tenant
        with self._lock:
            if len(self._seen) < self.max_distinct:
                self._seen.add(tenant)
                return tenant
        return OTHER_TENANTS


class TritonMetrics:
    """Publishes engine state once per step through pb_utils.MetricFamily."""

    def __init__(self, pb_utils):
        family = pb_utils.MetricFamily

        def make(name: str, kind, description: str):
            return family(name=f"loraplex_{name}", description=description, kind=kind)

        gauge, counter = family.GAUGE, family.COUNTER
        self._blocks = make("kv_cache_blocks", gauge,
                            "KV cache blocks by state (cached = evictable blocks holding a prefix; free includes cached)")
        self._queries = make("prefix_cache_query_tokens_total", counter, "Prompt tokens looked up in the prefix cache, per tenant")
        self._hits = make("prefix_cache_hit_tokens_total", counter, "Prompt tokens served from the prefix cache, per tenant")
        self._seqs = make("num_sequences", gauge, "Sequences by state")
        self._preemptions = make("preemptions_total", counter, "Sequences preempted")
        self._cap = make("admission_cap", gauge,
                         "Running sequences the scheduler admits up to (lowered under sustained preemption)")
        self._generated = make("generation_tokens_total", counter, "Tokens generated, per tenant")
        self._finished = make("request_finished_total", counter,
                              "Requests ended, per tenant and finish reason (stop, length, timeout, abort, error)")
        self._pins = make("adapter_pins", gauge, "Adapter pins held by running sequences (device slots in use)")
        self._block_gauges = {s: self._blocks.Metric(labels={"state": s}) for s in ("used", "cached", "free")}
        self._seq_gauges = {s: self._seqs.Metric(labels={"state": s}) for s in ("running", "waiting", "swapped")}
        self._preempt_counter = self._preemptions.Metric(labels={})
        self._cap_gauge = self._cap.Metric(labels={})
        self._pins_gauge = self._pins.Metric(labels={})
        self._counters: dict[tuple, object] = {}
        self._reported: dict[object, float] = {}

    def update(self, engine) -> None:
        """Publish what changed since the last call (counters grow by their delta)."""
        for state, value in engine.kv_manager.usage().items():
            self._set(self._block_gauges[state], value)
        sched = engine.scheduler
        self._set(self._seq_gauges["running"], len(sched.running))
        self._set(self._seq_gauges["waiting"], len(sched.waiting))
        self._set(self._seq_gauges["swapped"], len(sched.swapped))
        self._set(self._cap_gauge, min(sched.cap.value, engine.config.max_num_seqs))
        self._set(self._pins_gauge, engine.adapters.total_pins())
        self._grow(self._preempt_counter, sched.num_preemptions)
        for family, names, totals in (
            (self._queries, ("tenant",), sched.prefix_query_tokens),
            (self._hits, ("tenant",), sched.prefix_hit_tokens),
            (self._generated, ("tenant",), engine.generated_tokens),
            (self._finished, ("tenant", "finish_reason"), engine.finished_requests),
        ):
            for key, total in totals.items():
                self._grow(self._labeled(family, names, key if isinstance(key, tuple) else (key,)), total)

    def _labeled(self, family, names: tuple, values: tuple):
        metric = self._counters.get((family, values))
        if metric is None:
            metric = self._counters[(family, values)] = family.Metric(labels=dict(zip(names, values)))
        return metric

    def _set(self, gauge, value: float) -> None:
        if self._reported.get(gauge) != value:
            gauge.set(value)
            self._reported[gauge] = value

    def _grow(self, counter, total: float) -> None:
        delta = total - self._reported.get(counter, 0)
        if delta:
            counter.increment(delta)
            self._reported[counter] = total
