"""Tenant identity: the tenants file, API keys, and who a request's key belongs to.

With a tenants file (``LORAPLEX_TENANTS_FILE``) only a key establishes a tenant; without
one (development mode) the client names it (``x-tenant-id``, then ``tenant``, else
``default``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Mapping

from loraplex.exceptions import InvalidApiKey, TenantsFileError

log = logging.getLogger("loraplex.tenancy.tenants")

TENANTS_FILE_ENV = "LORAPLEX_TENANTS_FILE"
DEFAULT_TENANT = "default"
RELOAD_CHECK_SECONDS = 1.0  # a lookup checks the file's mtime/size at most this often
KEY_HEADER, KEY_PARAMETER = "x-api-key", "api_key"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the tenants file: its key's digest and its quotas (0 = unlimited)."""

    name: str
    api_key_digest: bytes
    weight: float = 1
    max_concurrent_requests: int = 0
    max_queued_requests: int = 0
    max_adapters: int = 0
    max_adapter_rank: int = 0
    max_adapter_bytes: int = 0
    tokens_per_minute: int = 0
    queue_fraction: float = 0.0  # weight / the file's total weight: its part of the waiting queue (queue_share)

    @property
    def authenticated(self) -> bool:
        """Established by an API key (a tenants file), not named by the client."""
        return bool(self.api_key_digest)


QUOTA_FIELDS = tuple(f.name for f in fields(Tenant)
                     if f.name not in ("name", "api_key_digest", "weight", "queue_fraction"))
KNOWN_FIELDS = ("api_key_sha256", "weight", *QUOTA_FIELDS)
# A tenants file's defaults for fields it leaves out (an explicit 0 still means unlimited). Development mode
# (no file) has no quotas. README.md "Tenants and API keys" explains each value.
DEFAULT_QUOTAS = {
    "max_concurrent_requests": 64,  # sequences (n counts n): a quarter of the default max_num_seqs
    "max_queued_requests": 256,
    "tokens_per_minute": 1_000_000,  # prompt + n x max_tokens reserved at acceptance
    "max_adapters": 16,
    "max_adapter_rank": 0,  # the server's max_lora_rank bounds it
    "max_adapter_bytes": 256 << 20,
}
assert set(DEFAULT_QUOTAS) == set(QUOTA_FIELDS)


def key_digest(key: str) -> bytes:
    """sha256 of an API key (what the tenants file stores, in hex)."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def new_key() -> tuple[str, str]:
    """A fresh random API key and its sha256 in hex."""
    key = secrets.token_urlsafe(32)
    return key, key_digest(key).hex()


def _number(name: str, field: str, value, minimum: float, integer: bool):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) \
            or (isinstance(value, float) and not math.isfinite(value)) or value < minimum:
        what = "an integer" if integer else "a number"
        raise TenantsFileError(f"tenant {name!r}: {field} must be {what} >= {minimum:g}, got {value!r}")
    return value


def _tenant(name: str, entry) -> Tenant:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise TenantsFileError(f"tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-' "
                               "(starting with a letter or digit)")
    if not isinstance(entry, dict):
        raise TenantsFileError(f"tenant {name!r}: expected a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(KNOWN_FIELDS))
    if unknown:
        raise TenantsFileError(f"tenant {name!r}: unknown field(s) {', '.join(unknown)} "
                               f"(known: {', '.join(KNOWN_FIELDS)})")
    digest = entry.get("api_key_sha256")
    if not isinstance(digest, str) or not HEX_SHA256.fullmatch(digest):
        raise TenantsFileError(f"tenant {name!r}: api_key_sha256 must be the 64 hex digits of the key's sha256 "
                               "(`loraplex-serve new-key` prints one)")
    weight = _number(name, "weight", entry.get("weight", 1), 0, integer=False)
    if weight == 0:
        raise TenantsFileError(f"tenant {name!r}: weight must be > 0, got 0")
    quotas = {f: _number(name, f, entry.get(f, DEFAULT_QUOTAS[f]), 0, integer=True) for f in QUOTA_FIELDS}
    return Tenant(name, bytes.fromhex(digest), weight, **quotas)


def parse_tenants(data) -> dict[str, Tenant]:
    """Validate a decoded tenants file: tenant name -> Tenant; raises TenantsFileError."""
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        raise TenantsFileError('expected {"tenants": {"<name>": {"api_key_sha256": "<hex>", ...}}}')
    tenants = {name: _tenant(name, entry) for name, entry in data["tenants"].items()}
    owners: dict[bytes, str] = {}
    for tenant in tenants.values():
        if tenant.api_key_digest in owners:
            raise TenantsFileError(f"tenants {owners[tenant.api_key_digest]!r} and {tenant.name!r} "
                                   "have the same api_key_sha256")
        owners[tenant.api_key_digest] = tenant.name
    total = sum(t.weight for t in tenants.values())
    return {name: replace(t, queue_fraction=t.weight / total) for name, t in tenants.items()}


def _refuse_duplicates(pairs: list) -> dict:
    """json object_pairs_hook: a key given twice in one object (json.loads would keep the last silently)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise TenantsFileError(f"{key!r} appears twice in one JSON object (a duplicate tenant name?)")
        seen[key] = value
    return seen


def load_tenants_file(path: str | os.PathLike) -> dict[str, Tenant]:
    """Read and validate a tenants file; raises TenantsFileError naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=_refuse_duplicates)
    except TenantsFileError as exc:
        raise TenantsFileError(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TenantsFileError(f"{path}: {exc}") from None
    try:
        return parse_tenants(data)
    except TenantsFileError as exc:
        raise TenantsFileError(f"{path}: {exc}") from None


def development_tenant(parameters: Mapping) -> str:
    """Development mode: the tenant the client names (x-tenant-id, then tenant, else default)."""
    return str(parameters.get("x-tenant-id") or parameters.get("tenant") or DEFAULT_TENANT)


class TenantsFile:
    """The tenants file, re-read when its mtime or size changes (checked at most once a second, on lookup or
    ``refresh``). A reload that fails, or a file that is gone, keeps the last good tenants; every check while it
    still fails logs an ERROR and counts one ``reload_failures``."""

    def __init__(self, path: str | os.PathLike, clock: Callable[[], float] = time.monotonic):
        self.path, self.clock = Path(path), clock
        self._lock = threading.Lock()
        self._signature = self._signature_now()  # before reading: a change in between is seen next time
        self.tenants = load_tenants_file(self.path)  # the first load must succeed
        self._checked = clock()
        self._failing = False  # the file as it is now did not load: retried at every check
        self.reload_failures = 0  # checks that found the file unloadable (a metric counts them)
        self.on_failure: Callable[[], None] | None = None  # called after each one (e.g. wake the metrics)

    def _signature_now(self):
        try:
            st = self.path.stat()
        except OSError as exc:
            return repr(exc)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def refresh(self) -> None:
        """Reload the file if it changed, or retry it while it fails (at most once per RELOAD_CHECK_SECONDS)."""
        with self._lock:
            if self.clock() - self._checked < RELOAD_CHECK_SECONDS:
                return
            self._checked = self.clock()
            signature = self._signature_now()  # before reading, as above
            if signature == self._signature and not self._failing:
                return
            self._signature = signature
            try:
                self.tenants = load_tenants_file(self.path)
            except TenantsFileError as exc:
                self._failing = True
                self.reload_failures += 1
                log.error("tenants file not reloaded, keeping the last good one (%d tenant(s)): %s",
                          len(self.tenants), exc)
            else:
                self._failing = False
                log.info("tenants file reloaded: %d tenant(s)", len(self.tenants))
                return
        if self.on_failure is not None:
            self.on_failure()

    def tenant_for_key(self, key) -> Tenant | None:
        """The tenant whose key this is (None if none): every digest is compared, in constant time."""
        self.refresh()
        if not isinstance(key, str) or not key:
            return None
        digest, found = key_digest(key), None
        for tenant in self.tenants.values():
            if hmac.compare_digest(digest, tenant.api_key_digest) and found is None:
                found = tenant
        return found


class TenantResolver:
    """Answers "who is this request?" from its Triton parameters (forwarded headers included)."""

    def __init__(self, tenants_file: str | os.PathLike | None = None, **file_args):
        self.file = TenantsFile(tenants_file, **file_args) if tenants_file else None

    @classmethod
    def from_env(cls) -> "TenantResolver":
        """The resolver for ``LORAPLEX_TENANTS_FILE`` (development mode when unset or empty)."""
        return cls(os.environ.get(TENANTS_FILE_ENV) or None)

    @property
    def authenticated(self) -> bool:
        """True with a tenants file (only keys establish tenants), False in development mode."""
        return self.file is not None

    def refresh(self) -> None:
        """Check the tenants file now (rate-limited), as a lookup would; nothing in development mode."""
        if self.file is not None:
            self.file.refresh()

    def resolve_tenant(self, parameters: Mapping) -> Tenant:
        """The request's Tenant (with its quotas); raises InvalidApiKey when a tenants file is in use and the key matches none.

        In development mode the tenant is the one the client names, with no quotas.
        """
        if self.file is None:
            return Tenant(development_tenant(parameters), b"")
        tenant = self.file.tenant_for_key(parameters.get(KEY_HEADER) or parameters.get(KEY_PARAMETER))
        if tenant is None:
            raise InvalidApiKey()
        return tenant

    def resolve(self, parameters: Mapping) -> str:
        """The request's tenant name (see resolve_tenant)."""
        return self.resolve_tenant(parameters).name
