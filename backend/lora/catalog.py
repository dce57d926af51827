"""Which adapter a request's `lora_name` means, and which versions the AdapterManager knows.

A name resolves within the caller's tenant first (its uploads in the adapter store), then
among the shared adapters (`multi_lora.json` and the folders directly under the store).
Another tenant's adapter is never found: the caller gets the same error as for a name
that does not exist, listing only the names it may use.

An upload is an immutable version folder, registered with the AdapterManager under a key
of its own (``<tenant>/<name>@<version>``), so a request keeps the version it resolved to
while a newer one serves new requests. ``AdapterVersions`` registers a version when a
request first needs it and unregisters it when it is superseded (or deleted) and no
request uses it any more, or when too many unused versions pile up.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from loraplex.engine.request import Request, show
from loraplex.lora.manager import AdapterManager
from loraplex.exceptions import AdapterNotFound

log = logging.getLogger("loraplex.lora")


def tenant_key(tenant: str, name: str, version: str) -> str:
    """The AdapterManager name of one uploaded version ('/' never occurs in shared names)."""
    return f"{tenant}/{name}@{version}"


class AdapterCatalog:
    """Resolves (tenant, lora_name) to (manager key, folder): the tenant's upload, else a shared adapter."""

    def __init__(self, store, shared: dict[str, str]):
        bad = sorted(name for name in shared if "/" in name or not name)
        if bad:
            raise ValueError(f"adapter names must be non-empty and must not contain '/': {bad}")
        self.store = store  # an AdapterStore, or None (no uploads)
        self.shared = dict(shared)

    def resolve(self, tenant: str, name: str) -> tuple[str, str, bool]:
        """(manager key, folder, uploaded?) for a request of `tenant` naming `name`; raises AdapterNotFound."""
        stored = self.store.lookup(tenant, name) if self.store is not None else None
        if stored is not None:
            return tenant_key(tenant, name, stored.version), str(stored.path), True
        path = self.shared.get(name)
        if path is not None:
            return name, path, False
        # vllm_backend's exact text (its clients compare it), listing only what this tenant may use
        raise AdapterNotFound(f"LoRA {show(name, 200)[1:-1]} is not supported, "
                              f"we currently support {self.visible(tenant)}")

    def visible(self, tenant: str) -> list[str]:
        """Adapter names this tenant may use: its own uploads and the shared ones, sorted."""
        own = {a.name for a in self.store.list(tenant)} if self.store is not None else set()
        return sorted(own | set(self.shared))


class AdapterVersions:
    """Registers uploaded versions with the AdapterManager while they are current or in use (loop thread only)."""

    def __init__(self, manager: AdapterManager, max_idle: int):
        self.manager = manager
        self.max_idle = max_idle  # registered versions no request uses, kept for reuse (host copy)
        self._users: dict[str, int] = {}  # key -> requests using it
        self._current: dict[tuple[str, str], str] = {}  # (tenant, name) -> latest key seen
        self._idle: OrderedDict[str, None] = OrderedDict()  # keys with no users, least recently used first

    def use(self, request: Request) -> None:
        """A request of an uploaded version is admitted: register that version if needed and count the user."""
        key = request.adapter_key
        if key not in self._users and key not in self._idle:
            self.manager.register(key, request.adapter_path)
        self._idle.pop(key, None)
        self._users[key] = self._users.get(key, 0) + 1
        current = (request.tenant, request.params.lora_name)
        previous = self._current.get(current)
        if previous != key:
            self._current[current] = key
            if previous is not None and previous in self._idle:
                self._forget(previous)  # superseded and unused: new requests resolve to the new version

    def done(self, request: Request) -> None:
        """A request that used an uploaded version ended (however it ended)."""
        key = request.adapter_key
        users = self._users.get(key, 0) - 1
        if users > 0:
            self._users[key] = users
            return
        self._users.pop(key, None)
        if self._current.get((request.tenant, request.params.lora_name)) != key:
            self._forget(key)
            return
        self._idle[key] = None
        while len(self._idle) > self.max_idle:
            self._forget(next(iter(self._idle)))

    def registered(self) -> int:
        """Uploaded versions registered now (bounded: in use, plus at most max_idle)."""
        return len(self._users) + len(self._idle)

    def _forget(self, key: str) -> None:
        self._idle.pop(key, None)
        for pair, current in list(self._current.items()):
            if current == key:
                del self._current[pair]
        try:
            self.manager.unregister(key)  # a device copy still pinned keeps its slot until released
        except AdapterNotFound:
            log.warning("adapter version %s was not registered", key)


__all__ = ["AdapterCatalog", "AdapterVersions", "tenant_key"]
