"""The model's metrics: every family (name, kind, labels, buckets), bounded tenant labels, and the
snapshot of engine state the loop hands to the publisher (backend/triton/metrics_publisher.py).

Every family carries the labels `model` and `version` besides its own. Names are what
Prometheus sees, prefix `loraplex_`; a histogram by its base name (the port shows it as
`_bucket`, `_sum` and `_count`). docs/metrics.md describes each one.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass


PREFIX = "loraplex_"
OTHER_TENANTS = "other"
GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
INFO = "info"  # a gauge whose labels carry the state: one current label set, its value the unix time it became current
MAX_WAITING_ADAPTER_NAMES = 64  # names waiting_lora_adapters lists at most (never fewer than max_loras)
MAX_HASHED_ADAPTERS = 4096  # hashed adapter names kept for reuse (the cache is emptied when full)

# bucket upper bounds (seconds, or counts); vLLM's where vllm_backend has the same metric
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1) + REQUEST_BUCKETS
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                        2.5, 5.0)
HOST_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: its name without the prefix, kind, own labels, help text, histogram buckets."""

    name: str
    kind: str
    labels: tuple[str, ...]
    description: str
    buckets: tuple[float, ...] = ()


T, S = ("tenant",), ("state",)
FAMILIES = (  # lora_llm's, all published by the metrics thread
    Family("requests_running", GAUGE, T, "Requests started and not ended, per tenant"),
    Family("requests_waiting", GAUGE, T, "Requests accepted and not started yet, per tenant"),
    Family("num_sequences", GAUGE, S, "Sequences by state (running, waiting, swapped)"),
    Family("admission_cap", GAUGE, (), "Running sequences the scheduler admits up to (lowered under sustained preemption)"),
    Family("kv_cache_blocks", GAUGE, S,
           "KV cache blocks by state (used; cached = evictable blocks holding a prefix; free includes cached)"),
    Family("adapters_resident", GAUGE, ("tier",),
           "Adapters held in device slots (device), in host memory (host), servable from disk (disk: registered)"),
    Family("adapters_loading", GAUGE, ("tier",), "Adapters being read from disk into host memory (host)"),
    Family("adapters_waiting", GAUGE, ("tier",),
           "Adapters waiting requests need that no device slot holds, by where they are (host, disk)"),
    Family("adapter_pins", GAUGE, (), "Adapter pins held by running sequences"),
    Family("prompt_tokens_total", COUNTER, T, "Prompt tokens of started requests, per tenant"),
    Family("generation_tokens_total", COUNTER, T, "Tokens generated, per tenant"),
    Family("request_success_total", COUNTER, T, "Requests that ended with finish reason stop or length, per tenant"),
    Family("request_failure_total", COUNTER, ("tenant", "reason"),
           "Requests that failed, per tenant and reason (invalid, not_found, unauthenticated, quota, cancelled, "
           "timeout, internal)"),
    Family("request_finished_total", COUNTER, ("tenant", "finish_reason"),
           "Requests the engine ended, per tenant and finish reason (stop, length, timeout, abort, error)"),
    Family("prefix_cache_query_tokens_total", COUNTER, T, "Prompt tokens looked up in the prefix cache, per tenant"),
    Family("prefix_cache_hit_tokens_total", COUNTER, T, "Prompt tokens served from the prefix cache, per tenant"),
    Family("adapter_loads_total", COUNTER, ("tier",),
           "Adapter loads: read from disk into host memory (host), copied into a device slot (device)"),
    Family("adapter_evictions_total", COUNTER, ("tier",),
           "Adapters evicted from a device slot (device) or from host memory (host)"),
    Family("preemptions_total", COUNTER, (), "Sequences preempted"),
    Family("grammar_match_seconds_total", COUNTER, T,
           "CPU seconds spent matching structured-output grammars (mask fill plus accept, per token), per tenant"),
    Family("tenants_file_reload_failures_total", COUNTER, (),
           "Checks that found the tenants file unreadable, invalid or gone (the last good tenants stay in force)"),
    Family("time_to_first_token_seconds", HISTOGRAM, T, "Arrival to first generated token, per tenant", TTFT_BUCKETS),
    Family("time_per_output_token_seconds", HISTOGRAM, T,
           "Mean time between a request's token-producing steps, per tenant (requests with 2+ tokens)", TPOT_BUCKETS),
    Family("e2e_request_latency_seconds", HISTOGRAM, T, "Arrival to end of requests the engine ended, per tenant",
           REQUEST_BUCKETS),
    Family("queue_time_seconds", HISTOGRAM, T, "Arrival to first scheduling, per tenant", QUEUE_BUCKETS),
    Family("batch_sequences", HISTOGRAM, (), "Sequences in a step's batch", COUNT_BUCKETS),
    Family("batch_tokens", HISTOGRAM, (), "Tokens in a step's batch (decode tokens and prefill chunks)", TOKEN_BUCKETS),
    Family("step_seconds", HISTOGRAM, ("loading",),
           "Wall time of a step that ran the model; loading=true: an adapter was read or copied into a slot meanwhile",
           STEP_SECONDS_BUCKETS),
    Family("adapter_load_seconds", HISTOGRAM, ("stage",),
           "Adapter load latency: disk_read (read and validate into host memory), host_to_device (copy into a slot)",
           LOAD_SECONDS_BUCKETS),
    Family("step_host_seconds", HISTOGRAM, (),
           "Host time of a step outside the model runner (inbox, scheduling, update, detokenization, outputs)",
           HOST_SECONDS_BUCKETS),
    # the model-server protocol of the Gateway API Inference Extension's endpoint picker (decision 076)
    Family("num_requests_waiting", GAUGE, (), "Requests accepted and not started yet, all tenants together"),
    Family("num_requests_running", GAUGE, (), "Requests started and not ended, all tenants together"),
    Family("kv_cache_usage_ratio", GAUGE, (),
           "Fraction of the KV cache's blocks held by sequences, 0 to 1 (blocks that only cache a prefix are free)"),
    Family("lora_requests_info", INFO, ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
           "Adapters of running and of waiting requests (comma-separated) and the device slots (max_lora); "
           "the value is the unix time this label set became current"),
    Family("cache_config_info", GAUGE, ("block_size", "num_gpu_blocks"),
           "The KV cache's block size in tokens and its number of blocks (value 1)"),
    Family("model_info", GAUGE, ("quantization", "checkpoint_format"),
           "The served base model's weights (value 1): quantization none, int8, fp8 or int4; checkpoint_format the "
           "checkpoint's quantization method (none: a full-precision checkpoint; decision 072)"),
)
UPLOADS = Family("adapter_uploads_total", COUNTER, T, "Adapter versions uploaded, per tenant (model lora_adapters)")

# Every metric family the model repository exports on Triton's metrics port, by the name Prometheus
# sees (a histogram by its base name). The Grafana dashboard and the alert rules in deploy/ may query
# only these (tests/deploy checks it; tests/e2e/test_metrics.py checks the port against it).
EXPORTED_METRICS = frozenset(PREFIX + f.name for f in (*FAMILIES, UPLOADS))


def hashed_tenant(name: str, salt: str = "") -> str:
    """A stable label for a tenant that does not show its name: "t" and 12 hex digits of sha256(salt, name)."""
    return "t" + hashlib.sha256(f"{len(salt)}:{salt}:{name}".encode()).hexdigest()[:12]


def hashed_adapter(tenant: str, name: str, salt: str = "") -> str:
    """A stable stand-in for a tenant's own adapter name: "#" and 12 hex digits of sha256(salt, tenant, name)
    ('#' is in no adapter name a client can send, so no request's model matches it)."""
    text = f"adapter:{len(salt)}:{salt}:{len(tenant)}:{tenant}:{name}"
    return "#" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class TenantLabels:
    """Bounded tenant label values: authenticated tenants (a tenants file) keep their names; in
    development mode the first `max_distinct` names clients send do, and the rest count as "other".
    With `hashed`, each kept name is shown as hashed_tenant(name, salt)."""

    def __init__(self, max_distinct: int, hashed: bool = False, salt: str = ""):
        self.max_distinct, self.hashed, self.salt = max_distinct, hashed, salt
        self._seen: set[str] = set()
        self._hashed: dict[tuple[str, str], str] = {}  # (tenant, adapter name) -> hashed_adapter (loop thread only)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config) -> "TenantLabels":
        """The labels an EngineConfig asks for."""
        return cls(config.max_metric_tenants, config.metric_tenant_label == "hash", config.metric_tenant_salt)

    def label(self, tenant: str, authenticated: bool) -> str:
        """The label value for this tenant."""
        if not (authenticated or tenant in self._seen):
            with self._lock:
                if len(self._seen) >= self.max_distinct:
                    return OTHER_TENANTS
                self._seen.add(tenant)
        return hashed_tenant(tenant, self.salt) if self.hashed else tenant

    def adapters(self, requests) -> set[str]:
        """The names the LoRA-info gauge shows for the requests' adapters: the `lora_name` each sent (what the
        endpoint picker matches a request's `model` against); with hashed labels, a tenant's own upload (its
        manager key is catalog.tenant_key's) as hashed_adapter. Requests without an adapter show nothing."""
        if not self.hashed:
            return {r.params.lora_name for r in requests if r.params.lora_name}
        shown = set()
        for tenant, name, key in {(r.tenant, r.params.lora_name, r.adapter_key) for r in requests if r.params.lora_name}:
            if not (key or "").startswith(tenant + "/"):
                shown.add(name)
                continue
            hashed = self._hashed.get((tenant, name))
            if hashed is None:
                if len(self._hashed) >= MAX_HASHED_ADAPTERS:
                    self._hashed.clear()
                hashed = self._hashed[(tenant, name)] = hashed_adapter(tenant, name, self.salt)
            shown.add(hashed)
        return shown


Values = dict[tuple[str, tuple], float]  # (family name, its label values) -> value


def per_label(values: Values, name: str, counts: dict) -> None:
    """One value per label set of a counter dict (a bare label is a one-tuple)."""
    for key, n in counts.items():
        values[(name, key if isinstance(key, tuple) else (key,))] = n


def lora_info(running, waiting, max_loras: int, labels: TenantLabels) -> Values:
    """The LoRA-info gauge's label set: the distinct adapters of the `running` and of the `waiting` requests
    (sorted, comma-separated; waiting ones cut at max(MAX_WAITING_ADAPTER_NAMES, max_loras)) and max_lora."""
    names = sorted(labels.adapters(running))
    queued = sorted(labels.adapters(waiting))[:max(MAX_WAITING_ADAPTER_NAMES, max_loras)]
    return {("lora_requests_info", (str(max_loras), ",".join(names), ",".join(queued))): 0.0}


def kv_values(usage: dict[str, int], usable_blocks: int, block_size: int) -> Values:
    """The KV cache's protocol gauges: the fraction of usable blocks in use, and the cache's shape."""
    return {("kv_cache_usage_ratio", ()): usage["used"] / usable_blocks if usable_blocks else 0.0,
            ("cache_config_info", (str(block_size), str(usable_blocks))): 1}


def model_info(plan) -> Values:
    """The model-info gauge of a models.quant QuantPlan: the served weights and the checkpoint's method."""
    method = plan.checkpoint.quant_method if plan.checkpoint is not None else "none"
    return {("model_info", (plan.served, method)): 1}


def live_values(stats) -> Values:
    """What other threads than the loop change too (acceptances, refusals): read by the publisher itself."""
    values: Values = {}
    running, waiting = stats.requests_by_state()
    per_label(values, "requests_running", running)
    per_label(values, "requests_waiting", waiting)
    values[("num_requests_running", ())] = sum(running.values())
    values[("num_requests_waiting", ())] = sum(waiting.values())
    per_label(values, "request_failure_total", stats.failures())
    values[("tenants_file_reload_failures_total", ())] = stats.tenants_file_reload_failures
    return values
