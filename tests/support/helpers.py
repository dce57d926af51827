"""Client-side helpers for end-to-end tests: token ids from logprobs, HTTP calls, metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from loraplex.clients import metrics
from loraplex.clients.load import chosen_token_ids
from loraplex.launch.tritonserver import free_ports
from loraplex.openai.process import GATEWAY_ID_ENV, gateway_answers


def token_ids_of(result) -> list[int]:
    """Chosen token ids of sample 0, from the `logprobs` output (the first key per token)."""
    return [i for r in result.responses for i in chosen_token_ids(r["logprobs"][0])]


def http_generate(server, body: dict, stream: bool = False, headers: dict | None = None):
    """POST /generate or /generate_stream; returns the requests.Response."""
    endpoint = "generate_stream" if stream else "generate"
    return requests.post(f"{server.http_url}/v2/models/lora_llm/{endpoint}", json=body, headers=headers, timeout=120)


def sse_events(response) -> list[dict]:
    """Parse server-sent events of /generate_stream."""
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def scrape(server, name: str, **labels) -> float | None:
    """One sample of a Prometheus metric from Triton's metrics port (None if absent)."""
    return metrics.scrape(server.metrics_url, name, **labels)


def wait_for_metric(server, name: str, expected: float, timeout: float = 20.0, **labels) -> float | None:
    """Poll a metric until it equals `expected` (returns the last value seen)."""
    return metrics.wait_for_metric(server.metrics_url, name, expected, timeout, **labels)


def assert_idle(server, num_blocks: int | None = None, pins: bool = False, timeout: float = 60.0) -> None:
    """One scrape shows no sequence waiting, running or swapped and no KV block used (free: num_blocks, when
    given; no adapter pin, when pins): the checks of separate scrapes could each pass while a late request ran."""
    expected = [("loraplex_num_sequences", {"state": s}, 0.0) for s in ("waiting", "running", "swapped")]
    expected.append(("loraplex_kv_cache_blocks", {"state": "used"}, 0.0))
    if num_blocks is not None:
        expected.append(("loraplex_kv_cache_blocks", {"state": "free"}, float(num_blocks)))
    if pins:
        expected.append(("loraplex_adapter_pins", {}, 0.0))
    seen = metrics.wait_for_metrics(server.metrics_url, expected, timeout)
    assert all(seen[f"{name}{labels}"] == value for name, labels, value in expected), seen


def wait_for_positive(server, name: str, timeout: float = 20.0, **labels) -> float | None:
    """Poll a metric until it is above 0 (metrics are published up to ~50 ms after the engine's step)."""
    deadline = time.monotonic() + timeout
    while True:
        value = scrape(server, name, **labels)
        if (value or 0) > 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


@contextmanager
def run_gateway(triton_grpc_url: str, model_dir, log_path: Path, *flags: str):
    """`loraplex-openai` as its own process on 127.0.0.1 in front of a server; yields its base URL once it answers,
    itself (its /health names the id it was given: a parallel worker's gateway may hold the port picked)."""
    log = open(log_path, "wb")
    for attempt in range(3):  # a port taken between free_ports and the bind: the gateway exits; pick another
        (port,) = free_ports(1)
        cmd = [str(Path(sys.executable).with_name("loraplex-openai")), "--triton-url", triton_grpc_url,
               "--host", "127.0.0.1", "--port", str(port), "--model-dir", str(model_dir), "--log-level", "warning",
               *flags]
        gateway_id = f"test-gateway-{port}-{attempt}"
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", **{GATEWAY_ID_ENV: gateway_id}))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while proc.poll() is None and not gateway_answers(url, gateway_id):
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        if proc.poll() is None or "address already in use" not in log_path.read_text():
            break
    try:
        assert proc.poll() is None, log_path.read_text()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
