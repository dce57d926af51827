"""Samples of Prometheus metrics (`loraplex_*`) from Triton's metrics endpoint."""

from __future__ import annotations

import re
import time
import urllib.request

_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape(metrics_url: str, name: str, **labels) -> float | None:
    """One sample of a metric whose labels include `labels` (None if absent)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(_LABEL.findall(line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for_metric(metrics_url: str, name: str, expected: float, timeout: float = 20.0, **labels) -> float | None:
    """Poll a metric until it equals `expected` (returns the last value seen), every 50 ms: as often as the server
    publishes them."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = scrape(metrics_url, name, **labels)
        if value == expected:
            return value
        time.sleep(0.05)
    return value
