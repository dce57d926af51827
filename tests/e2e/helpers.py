"""Client-side helpers for end-to-end tests: token ids from logprobs, HTTP calls, metrics."""

from __future__ import annotations

import json
import re
import time

import requests


def token_ids_of(result) -> list[int]:
    """Chosen token ids of sample 0, from the `logprobs` output (the first key per token)."""
    ids = []
    for r in result.responses:
        entries = json.loads(r["logprobs"][0]) or []
        ids += [int(next(iter(e))) for e in entries]
    return ids


def http_generate(server, body: dict, stream: bool = False, headers: dict | None = None):
    """POST /generate or /generate_stream; returns the requests.Response."""
    endpoint = "generate_stream" if stream else "generate"
    return requests.post(f"{server.http_url}/v2/models/lora_llm/{endpoint}", json=body, headers=headers, timeout=120)


def sse_events(response) -> list[dict]:
    """Parse server-sent events of /generate_stream."""
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def scrape(server, name: str, **labels) -> float | None:
    """One sample of a Prometheus metric from Triton's metrics port (None if absent)."""
    text = requests.get(server.metrics_url, timeout=10).text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for_metric(server, name: str, expected: float, timeout: float = 20.0, **labels) -> float | None:
    """Poll a metric until it equals `expected` (returns the last value seen)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = scrape(server, name, **labels)
        if value == expected:
            return value
        time.sleep(0.2)
    return value
