"""Samples of Prometheus metrics (`loraplex_*`) from Triton's metrics endpoint."""

from __future__ import annotations

import re
import time
import urllib.request

_LABEL = re.compile(r'(\w+)="([^"]*)"')


def fetch(metrics_url: str) -> str:
    """The endpoint's text, one scrape."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels) -> float | None:
    """In one scrape's text, the sample of a metric whose labels include `labels` (None if absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(_LABEL.findall(line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def scrape(metrics_url: str, name: str, **labels) -> float | None:
    """One sample of a metric whose labels include `labels` (None if absent)."""
    return sample(fetch(metrics_url), name, **labels)


def wait_for_metrics(metrics_url: str, expected: list[tuple[str, dict, float]], timeout: float = 20.0) -> dict:
    """Poll, every 50 ms (as often as the server publishes), until one scrape shows every (name, labels, value) of
    `expected`; the values of the last scrape seen, keyed "name{labels}" (a state no single scrape showed is not
    one the server was in)."""
    deadline = time.monotonic() + timeout
    while True:
        text = fetch(metrics_url)
        seen = {f"{name}{labels}": sample(text, name, **labels) for name, labels, _ in expected}
        if all(seen[f"{name}{labels}"] == value for name, labels, value in expected) or time.monotonic() >= deadline:
            return seen
        time.sleep(0.05)


def wait_for_metric(metrics_url: str, name: str, expected: float, timeout: float = 20.0, **labels) -> float | None:
    """Poll a metric until it equals `expected` (returns the last value seen)."""
    return wait_for_metrics(metrics_url, [(name, labels, expected)], timeout)[f"{name}{labels}"]
