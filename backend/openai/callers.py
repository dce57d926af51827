"""Callers whose identity Triton accepted a moment ago, so that a large JSON body from one of them is parsed
without asking again (``lora_adapters`` handles one request at a time: a busy upload there must not hold up a
known caller's prompt). Only accepted identities are kept, as digests, for a short while and a bounded number;
Triton still authenticates every request itself."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict

KNOWN_FOR_S = 60.0
MAX_KNOWN = 4096


def _digest(headers: dict[str, str]) -> bytes:
    return hashlib.sha256(repr(sorted(headers.items())).encode("utf-8", "surrogatepass")).digest()


class KnownCallers:
    """Identity headers (as digests) that passed Triton's check within ``ttl_s``; the oldest are dropped first."""

    def __init__(self, ttl_s: float = KNOWN_FOR_S, size: int = MAX_KNOWN):
        self.ttl_s, self.size = ttl_s, size
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def known(self, headers: dict[str, str]) -> bool:
        """Whether these identity headers passed within the last ``ttl_s``."""
        until = self._until.get(_digest(headers))
        return until is not None and until > time.monotonic()

    def accepted(self, headers: dict[str, str]) -> None:
        """Remember that these identity headers passed just now."""
        key = _digest(headers)
        self._until[key] = time.monotonic() + self.ttl_s
        self._until.move_to_end(key)
        while len(self._until) > self.size:
            self._until.popitem(last=False)
