"""Engine counters -> Triton custom metrics (prefix `loraplex_`, on Triton's metrics port)."""

from __future__ import annotations


class TritonMetrics:
    """Publishes engine state once per step through pb_utils.MetricFamily."""

    def __init__(self, pb_utils):
        family = pb_utils.MetricFamily
        self._blocks = family(
            name="loraplex_kv_cache_blocks",
            description="KV cache blocks by state (cached = evictable blocks holding a prefix; free includes cached)",
            kind=family.GAUGE,
        )
        self._queries = family(
            name="loraplex_prefix_cache_query_tokens_total",
            description="Prompt tokens looked up in the prefix cache, per tenant",
            kind=family.COUNTER,
        )
        self._hits = family(
            name="loraplex_prefix_cache_hit_tokens_total",
            description="Prompt tokens served from the prefix cache, per tenant",
            kind=family.COUNTER,
        )
        self._seqs = family(
            name="loraplex_num_sequences", description="Sequences by state", kind=family.GAUGE
        )
        self._preemptions = family(
            name="loraplex_preemptions_total", description="Sequences preempted", kind=family.COUNTER
        )
        self._cap = family(
            name="loraplex_admission_cap",
            description="Running sequences the scheduler admits up to (lowered under sustained preemption)",
            kind=family.GAUGE,
        )
        self._generated = family(
            name="loraplex_generation_tokens_total", description="Tokens generated, per tenant", kind=family.COUNTER
        )
        self._finished = family(
            name="loraplex_request_finished_total",
            description="Requests ended, per tenant and finish reason (stop, length, timeout, abort, error)",
            kind=family.COUNTER,
        )
        self._block_gauges = {s: self._blocks.Metric(labels={"state": s}) for s in ("used", "cached", "free")}
        self._seq_gauges = {s: self._seqs.Metric(labels={"state": s}) for s in ("running", "waiting", "swapped")}
        self._preempt_counter = self._preemptions.Metric(labels={})
        self._cap_gauge = self._cap.Metric(labels={})
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
