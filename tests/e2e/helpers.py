"""Client-side helpers for end-to-end tests: token ids from logprobs, HTTP calls, metrics."""

from __future__ import annotations

import json
import time

import requests

from loraplex.clients import metrics
from loraplex.clients.load import chosen_token_ids


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


def wait_for_positive(server, name: str, timeout: float = 20.0, **labels) -> float | None:
    """Poll a metric until it is above 0 (metrics are published up to ~50 ms after the engine's step)."""
    deadline = time.monotonic() + timeout
    while True:
        value = scrape(server, name, **labels)
        if (value or 0) > 0 or time.monotonic() > deadline:
            return value
        time.sleep(0.02)
