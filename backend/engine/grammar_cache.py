"""Compiled grammars kept per tenant, within one byte bound for all, each tenant's share protected.

A tenant's entries are found only by that tenant (a hit for one tenant says nothing about another's
constraints). Past the bound, the least recently used entry of the tenant holding the most bytes goes first;
so a tenant never evicts an entry of a tenant holding fewer bytes than itself, and each of k tenants keeps at
least ``max_bytes / k`` of its working set however much another inserts. Not thread-safe: the caller locks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class GrammarCache:
    """Per-tenant LRUs of (value, size in bytes) within ``max_bytes`` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[str, OrderedDict[Hashable, tuple[object, int]]] = {}  # least recently used first
        self._bytes: dict[str, int] = {}
        self.total_bytes = 0

    def get(self, tenant: str, key: Hashable):
        """The tenant's value for key (now its most recently used), or None."""
        entries = self._entries.get(tenant)
        if entries is None or key not in entries:
            return None
        entries.move_to_end(key)
        return entries[key][0]

    def put(self, tenant: str, key: Hashable, value, size: int) -> None:
        """Keep value for the tenant; one bigger than the whole bound is not kept."""
        if size > self.max_bytes or self.get(tenant, key) is not None:
            return
        self._entries.setdefault(tenant, OrderedDict())[key] = (value, size)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        self.total_bytes += size
        while self.total_bytes > self.max_bytes:
            self._evict_one(max(self._bytes, key=lambda t: (self._bytes[t], t == tenant)))

    def bytes_of(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def keys_of(self, tenant: str) -> list:
        """The tenant's keys, least recently used first."""
        return list(self._entries.get(tenant, ()))

    def _evict_one(self, tenant: str) -> None:
        entries = self._entries[tenant]
        _, (_, size) = entries.popitem(last=False)
        self._bytes[tenant] -= size
        self.total_bytes -= size
        if not entries:
            del self._entries[tenant], self._bytes[tenant]
