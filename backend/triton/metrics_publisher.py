"""Triton custom metrics (pb_utils.MetricFamily), published from a side thread.

Each pb_utils metric call is an IPC round trip to tritonserver (decision 023), so the
engine loop never makes one: after a step it hands over a snapshot of its gauges and
counters (`metrics.capture`, plain reads), at most every `CAPTURE_SECONDS` and whenever
it goes idle, and histogram observations wait in `EngineStats.observations`. The
publisher thread sends what changed: a gauge when its value moved, a counter by its
delta, one `observe` per observation (Triton 2.51's native HISTOGRAM kind). An info gauge (the
LoRA-info gauge) shows its current label set with the unix time it became current, as vLLM's does;
a series Triton holds lives as long as its family, so the family is made anew past MAX_INFO_SERIES.
"""

from __future__ import annotations

import logging
import threading
import time

from loraplex.engine.metrics import COUNTER, FAMILIES, GAUGE, HISTOGRAM, INFO, PREFIX, Family, Values, live_values

log = logging.getLogger("loraplex.engine.metrics")

CAPTURE_SECONDS = 0.05  # the loop hands over a snapshot at most this often while it has work
REFRESH_SECONDS = 1.0  # the publisher re-reads the values other threads change at least this often
MAX_INFO_SERIES = 16  # label sets an info family keeps before it is made anew (Triton drops a series with its family)


def metrics_enabled(model_config: dict) -> bool:
    """The model parameter REPORT_CUSTOM_METRICS (vllm_backend's name): on unless false/0/no/off."""
    value = model_config.get("parameters", {}).get("REPORT_CUSTOM_METRICS", {}).get("string_value", "true")
    return value.strip().lower() not in ("false", "0", "no", "off")


def make_metrics(pb_utils, model_config: dict, model: str, version: str,
                 families: tuple[Family, ...] = FAMILIES) -> "TritonMetrics | None":
    """A model's metric families; None when REPORT_CUSTOM_METRICS is false or Triton refuses them
    (the model then serves without metrics)."""
    if not metrics_enabled(model_config):
        return None
    try:
        return TritonMetrics(pb_utils, model, version, families)
    except Exception:  # serving without metrics beats not serving
        log.exception("custom metrics are unavailable; serving without them")
        return None


def start_publisher(pb_utils, model_config: dict, model: str, version: str, engine) -> "MetricsPublisher | None":
    """The engine's metrics publisher, started and hooked to its loop; None without metrics (make_metrics),
    and then the engine records no observations."""
    metrics = make_metrics(pb_utils, model_config, model, version)
    publisher = None
    if metrics is not None:
        try:
            publisher = MetricsPublisher(metrics, engine.stats)
            publisher.start(engine)
        except Exception:  # serving without metrics beats not serving
            log.exception("custom metrics are unavailable; serving without them")
            publisher = None
    if publisher is None:
        engine.stats.discard_observations()
    else:
        engine.on_step = publisher.on_step
    return publisher


class TritonMetrics:
    """The pb_utils families of `families` and their metrics; publishes values and observations."""

    def __init__(self, pb_utils, model: str, version: str, families: tuple[Family, ...] = FAMILIES):
        self._pb = pb_utils
        self._base = {"model": model, "version": version}
        self._specs = {f.name: f for f in families}
        self._families = {f.name: self._family(f) for f in families}
        self._metrics: dict[tuple[str, tuple], object] = {}
        self._reported: dict[tuple[str, tuple], float] = {}
        self._info: dict[str, tuple] = {}  # info family -> its current label values
        self._stamp = 0.0  # the last info value set (unix time, strictly increasing)

    def _family(self, spec: Family):
        kinds = {GAUGE: "GAUGE", INFO: "GAUGE", COUNTER: "COUNTER", HISTOGRAM: "HISTOGRAM"}
        kind = getattr(self._pb.MetricFamily, kinds[spec.kind])
        return self._pb.MetricFamily(name=PREFIX + spec.name, description=spec.description, kind=kind)

    def metric(self, name: str, label_values: tuple):
        """The metric of one label combination (created once: creating is an IPC round trip too)."""
        key = (name, label_values)
        metric = self._metrics.get(key)
        if metric is None:
            spec = self._specs[name]
            labels = {**self._base, **dict(zip(spec.labels, label_values))}
            kwargs = {"buckets": list(spec.buckets)} if spec.kind == HISTOGRAM else {}
            metric = self._metrics[key] = self._families[name].Metric(labels=labels, **kwargs)
        return metric

    def publish(self, values: Values, observations: list) -> None:
        """Gauges that changed, counters by their growth, then each histogram observation."""
        reported = self._reported
        for key, value in values.items():
            if self._specs[key[0]].kind == INFO:
                self._current(*key)
                continue
            last = reported.get(key)
            if last == value:
                continue
            metric = self.metric(*key)  # a counter shows from 0, so rate() sees its first increase
            if self._specs[key[0]].kind == GAUGE:
                metric.set(value)
            elif value > (last or 0):
                metric.increment(value - (last or 0))
            elif last is not None:
                continue  # a counter never goes down
            reported[key] = value
        for name, label, value in observations:
            self.metric(name, () if label is None else (label,)).observe(value)

    def _current(self, name: str, label_values: tuple) -> None:
        """Make `label_values` the info family's current series, valued the unix time now (the newest value wins)."""
        if self._info.get(name) == label_values:
            return
        series = [key for key in self._metrics if key[0] == name]
        if len(series) >= MAX_INFO_SERIES and (name, label_values) not in self._metrics:
            for key in series:  # the metrics before their family (Triton refuses the other order)
                del self._metrics[key]
            self._families[name] = None
            self._families[name] = self._family(self._specs[name])
        self._stamp = max(time.time(), self._stamp + 0.001)
        self.metric(name, label_values).set(self._stamp)
        self._info[name] = label_values

    def increment(self, name: str, label_values: tuple, amount: float = 1) -> None:
        """Count at once (a model without an engine loop, e.g. lora_adapters)."""
        self.metric(name, label_values).increment(amount)

    def close(self) -> None:
        """Drop the metrics before their families (Triton refuses the other order)."""
        self._metrics.clear()
        self._families.clear()


class MetricsPublisher:
    """The side thread: publishes the latest snapshot the loop handed over, plus every observation."""

    def __init__(self, metrics: TritonMetrics, stats):
        self.metrics, self.stats = metrics, stats
        self._latest: Values = {}
        self._next_capture = 0.0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="loraplex-metrics", daemon=True)

    def start(self, engine) -> None:
        """Publish the engine's state as it is now, then keep publishing from the thread."""
        self._latest = engine.snapshot()
        self._publish()
        self._thread.start()

    def on_step(self, engine) -> None:
        """The engine loop's hook after each step: a snapshot if one is due or the loop goes idle."""
        now = time.monotonic()
        if now < self._next_capture and engine.has_work():
            return
        self._next_capture = now + CAPTURE_SECONDS
        self._latest = engine.snapshot()
        self._wake.set()

    def wake(self) -> None:
        """Something other threads count changed (a refusal): publish soon."""
        self._wake.set()

    def stop(self, engine=None) -> None:
        """Publish a last time (the engine's final state, if given), end the thread, release the metrics."""
        if engine is not None:
            self._latest = engine.snapshot()
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if not self._thread.is_alive():
            self.metrics.close()

    def _run(self) -> None:
        while True:
            self._wake.wait(REFRESH_SECONDS)
            self._wake.clear()
            stopping = self._stopping
            self._publish()
            if stopping:
                return

    def _publish(self) -> None:
        try:
            values = {**self._latest, **live_values(self.stats)}
            self.metrics.publish(values, self.stats.drain())
        except Exception:  # metrics must never take the model down
            log.exception("publishing metrics failed")
