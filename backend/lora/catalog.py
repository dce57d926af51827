"""Which adapter a request's `lora_name` means, and which versions the AdapterManager knows.

A name resolves within the caller's tenant first (its uploads in the adapter store), then
among the shared adapters: those loaded at run time (``/v1/load_lora_adapter``, versioned in
the store), `multi_lora.json`'s (registered at start), then the folders directly under the
store. Every step is one pointer read or one stat, so a running server serves an adapter
loaded or uploaded a moment ago, and resolving costs the same at 10,000 adapters as at one.
Another tenant's adapter is never found: the caller gets the same error as for a name that
does not exist, listing (a bounded part of) the names it may use.

An upload or a run-time shared adapter is an immutable version folder, registered with the
AdapterManager under a key of its own (``<tenant>/<name>@<version>``, ``:shared/<name>@<version>``),
so a request keeps the version it resolved to while a newer one serves new requests; a shared
folder of the store is registered under its name. ``AdapterVersions`` registers such a key when
a request first needs it and unregisters it when it is superseded (or deleted) and no request
uses it any more, or when too many unused ones pile up.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from loraplex.engine.request import Request, show
from loraplex.lora.manager import AdapterManager
from loraplex.exceptions import AdapterNotFound

log = logging.getLogger("loraplex.lora")

MAX_NAMES_TEXT = 2000  # characters of names the unknown-LoRA error lists at most
SHARED_KEY_PREFIX = ":shared"


def tenant_key(tenant: str, name: str, version: str) -> str:
    """The AdapterManager name of one uploaded version ('/' never occurs in shared names)."""
    return f"{tenant}/{name}@{version}"


def shared_key(name: str, version: str) -> str:
    """The AdapterManager name of one version of a shared adapter loaded at run time."""
    return tenant_key(SHARED_KEY_PREFIX, name, version)


def names_text(names: list[str], total: int, limit: int = MAX_NAMES_TEXT) -> str:
    """``names`` as a Python list literal cut to about ``limit`` characters, saying how many of ``total`` are left."""
    shown, used = [], 0  # "[" + "]" less the last ", "
    for name in names:
        used += len(repr(name)) + 2
        if used > limit:
            break
        shown.append(name)
    text = repr(shown)
    return text if len(shown) == total else f"{text} and {total - len(shown)} more"


class AdapterCatalog:
    """Resolves (tenant, lora_name) to (manager key, folder, registered lazily?): see the module doc."""

    def __init__(self, store, shared: dict[str, str]):
        bad = sorted(name for name in shared if "/" in name or not name)
        if bad:
            raise ValueError(f"adapter names must be non-empty and must not contain '/': {bad}")
        self.store = store  # an AdapterStore, or None (no uploads)
        self.shared = dict(shared)  # multi_lora.json: registered with the AdapterManager at start

    def resolve(self, tenant: str, name: str) -> tuple[str, str, bool]:
        """(manager key, folder, registered on use?) for a request of `tenant` naming `name`; raises AdapterNotFound."""
        store = self.store
        if store is not None:
            stored = store.lookup(tenant, name)
            if stored is not None:
                return tenant_key(tenant, name, stored.version), str(stored.path), True
            loaded = store.lookup_shared(name)
            if loaded is not None:
                return shared_key(name, loaded.version), str(loaded.path), True
        path = self.shared.get(name)
        if path is not None:
            return name, path, False
        folder = store.shared_folder(name) if store is not None else None
        if folder is not None:
            return name, folder, True
        # vllm_backend's exact text (its clients compare it), listing only what this tenant may use
        raise AdapterNotFound(f"LoRA {show(name, 200)[1:-1]} is not supported, "
                              f"we currently support {self.visible_text(tenant)}")

    def visible_text(self, tenant: str) -> str:
        """The first names this tenant may use (about MAX_NAMES_TEXT characters), and how many more there are."""
        if self.store is None:
            names = sorted(self.shared)
            return names_text(names, len(names))
        page = self.store.page(tenant, "", MAX_NAMES_TEXT // 4, self.shared, read=False)
        return names_text(page.names(), page.total)

    def visible(self, tenant: str) -> list[str]:
        """Adapter names this tenant may use (its uploads and the shared ones), sorted: at most one store page."""
        if self.store is None:
            return sorted(self.shared)
        return self.store.page(tenant, "", extra_shared=self.shared).names()


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


__all__ = ["AdapterCatalog", "AdapterVersions", "names_text", "shared_key", "tenant_key"]
