"""The adapter store on disk: shared adapters, and per-tenant uploads with immutable versions.

The folder is the source of truth for every replica serving it (several tritonservers on
one shared volume). Layout under ``root``::

    <name>/adapter_config.json                 shared adapters placed by the operator (served to every tenant)
    .shared/adapters/<name>.json               shared adapters loaded at run time (/v1/load_lora_adapter):
    .shared/versions/<name>/<version>/...      pointer + immutable versions, as a tenant's
    .tenants/<tenant-dir>/TENANT               the tenant's name, for operators
    .tenants/<tenant-dir>/.lock                flock: quota check + pointer change
    .tenants/<tenant-dir>/adapters/<name>.json pointer to the current version (metadata)
    .tenants/<tenant-dir>/versions/<name>/<version>/{adapter_config.json,adapter_model.safetensors}

    .tenants/.lock                             flock: the store-wide byte cap + a version's rename into place

``tenant-dir`` is a sha256 prefix of the tenant name and ``<name>`` must match
ADAPTER_NAME, so no name can steer a path. Every file is written atomically (``.tmp-*``
file, fsync, rename, fsync the folder). A version that stops being current stays on disk
for RETIRED_VERSION_GRACE_SECONDS (a request in flight elsewhere may reload it), then the
next collection removes it: the server's timer (Collector), any tenant's upload (at most
every COLLECT_INTERVAL_SECONDS), and the tenant's own upload or delete. Every version on
disk counts against its tenant's max_adapters, and every tenant's versions together
against the store-wide byte cap (shared versions count against neither).

Every request-time operation is O(1) in the number of adapters: ``lookup``/``lookup_shared``
read one pointer file or stat one folder; ``page``/``shared_page`` read one folder's names
(no per-entry stat or read) and then only the page's pointers; nothing walks the store.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import heapq
import itertools
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from loraplex.exceptions import AdapterError, AdapterNotFound, AdapterStoreError, StoreFull
from loraplex.lora.adapter import CONFIG_FILE, DTYPE_SIZES, MAX_CONFIG_BYTES, WEIGHTS_FILE, adapter_digest, check_safetensors_header, max_adapter_tensors, max_header_bytes, parse_peft_adapter, uses_dora
from loraplex.lora.moe_layout import expert_layout
from loraplex.lora.shapes import module_shapes
from loraplex.lora.vocab import max_vocab_bytes

from loraplex.tenancy.tenants import Tenant

log = logging.getLogger("loraplex.store")

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANTS_DIR = ".tenants"
SHARED_DIR = ".shared"
SHARED_OWNER = ""  # StoredAdapter.tenant of a shared adapter loaded at run time
MAX_PAGE = 1000  # names one list page may hold
NAME_CACHE = 256  # folders whose sorted names a store keeps (keyed by the folder's mtime)
NAME_SETTLE_NS = 2_000_000_000  # a listing is kept once its folder's mtime is this old
TMP_PREFIX = ".tmp-"
TENANT_DIR = re.compile(r"[0-9a-f]{32}")
RETIRED_VERSION_GRACE_SECONDS = 600
COLLECT_INTERVAL_SECONDS = 60  # the server's collection timer; an upload collects at most this often too
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What one tenant holds on disk: current versions, retired ones still in their grace period, their bytes."""

    current: int
    retired: int
    bytes: int
    next_free: float | None  # when the oldest retired version may be collected (unix time), if any

    @property
    def versions(self) -> int:
        """Version folders on disk that count against max_adapters."""
        return self.current + self.retired


@dataclass(frozen=True, slots=True)
class StoredAdapter:
    """One tenant's current version of an adapter name, as its pointer file describes it."""

    tenant: str
    name: str
    version: str
    path: Path
    digest: str
    rank: int
    target_modules: tuple[str, ...]
    bytes: int
    created: float

    def to_json(self) -> dict:
        """What list/info/upload return to the client (no server paths)."""
        iso = datetime.fromtimestamp(self.created, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
        return {"name": self.name, "version": self.version, "rank": self.rank,
                "target_modules": list(self.target_modules), "bytes": self.bytes, "digest": self.digest,
                "created": iso, "created_unix": self.created}


@dataclass(frozen=True, slots=True)
class Page:
    """One page of AdapterStore.page: the tenant's adapters on it, the shared names on it, where the next starts."""

    own: list  # StoredAdapter (names only when the page was not read)
    shared: list[str]
    next: str | None  # the ``after`` of the next page; None: this is the last
    total: int  # distinct names from this page's start to the end (shared folders counted unchecked)

    def names(self) -> list[str]:
        """Every name on the page, sorted."""
        return sorted({a if isinstance(a, str) else a.name for a in self.own} | set(self.shared))


def _already_loaded(name: str) -> AdapterStoreError:
    """vLLM's text for a shared name loaded again without load_inplace."""
    return AdapterStoreError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                             f"adapter in place, set 'load_inplace' to True.")


def not_found(name: str) -> AdapterNotFound:
    """The one error for a name the tenant does not have (whether or not another tenant has it)."""
    return AdapterNotFound(f"adapter {name!r} not found")


def check_name(name) -> str:
    """The adapter name if it is safe as a file name; AdapterStoreError otherwise."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        shown = name if not isinstance(name, str) or len(name) <= 80 else name[:80] + "..."
        raise AdapterStoreError(f"invalid adapter name {shown!r}: use {NAME_RULE}")
    return name


def tenant_dir_name(tenant: str) -> str:
    """The tenant's folder name under .tenants/: a sha256 prefix, so no tenant name can steer a path."""
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def max_weights_bytes(hf_config, max_lora_rank: int) -> int:
    """Size of the largest valid adapter_model.safetensors for this model: every module at max_lora_rank, in F64,
    and the vocabulary's tensors (lora/vocab.py)."""
    layers = int(hf_config.num_hidden_layers)
    elements = max_lora_rank * layers * sum(i + o for i, o in module_shapes(hf_config).values())
    experts = expert_layout(hf_config)  # a MoE model's: each expert's projections (decision 066)
    elements += max_lora_rank * experts.elements_per_rank() if experts is not None else 0
    return (8 + max_header_bytes(max_adapter_tensors(hf_config)) + elements * max(DTYPE_SIZES.values())
            + max_vocab_bytes(hf_config, max_lora_rank))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same folder, fsync, rename, fsync folder."""
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class AdapterStore:
    """Shared adapters and per-tenant uploads in one folder (see the module doc for the layout)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int = 0, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.max_bytes = max_bytes  # every tenant's versions on disk together; 0 = no cap
        self.clock = clock  # unix time: retirement stamps, the grace period, the collection interval
        self._last_collect = clock()
        self._names_cache: OrderedDict[tuple[str, str], tuple[int, tuple[str, ...]]] = OrderedDict()
        self._names_lock = threading.Lock()
        self._union = None  # (loaded, folders, extra, their sorted union): _shared_union's last answer

    # reading (cheap: the engine calls lookup on every request naming an adapter) ---------------

    def shared(self) -> dict[str, str]:
        """Every PEFT folder directly under the root: name -> path (walks the root: operators and tests only;
        requests use shared_folder, lookup_shared and page)."""
        if not self.root.is_dir():
            return {}
        return {p.name: str(p) for p in sorted(self.root.iterdir())
                if not p.name.startswith(".") and (p / CONFIG_FILE).is_file()}

    def shared_folder(self, name: str) -> str | None:
        """The operator's shared folder ``<root>/<name>`` if it holds an adapter_config.json (one stat)."""
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            return None
        path = self.root / name
        return str(path) if (path / CONFIG_FILE).is_file() else None

    def lookup_shared(self, name: str) -> StoredAdapter | None:
        """The current version of the shared adapter ``name`` loaded at run time (one small JSON read), or None."""
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            return None
        return self._read_pointer(SHARED_OWNER, self.root / SHARED_DIR / "adapters" / f"{name}.json", name)

    def page(self, tenant: str, after: str = "", limit: int = MAX_PAGE, extra_shared=(),
             read: bool = True) -> Page:
        """One page of the names ``tenant`` may use, sorted by name, after the name ``after`` ("" = the first page).

        ``extra_shared`` are shared names from elsewhere (multi_lora.json). Three folders' sorted names
        come from ``names`` (a stat each while unchanged), then only the page's pointers (unless not
        ``read``) and shared folders are read: the rest of the store is never stat'ed or read.
        """
        limit = max(1, min(int(limit), MAX_PAGE))
        own = self.names(self._tenant_dir(tenant) / "adapters", ".json")
        loaded = self.names(self.root / SHARED_DIR / "adapters", ".json")
        folders = self.names(self.root, "")
        extra = tuple(sorted(extra_shared))
        every = self._shared_union(loaded, folders, extra)
        lists = (own, every)
        starts = [bisect.bisect_right(names, after) for names in lists]
        window: list[str] = []
        for name in heapq.merge(*(itertools.islice(names, i, None) for names, i in zip(lists, starts))):
            if window and window[-1] == name:
                continue
            if len(window) == limit:
                break
            window.append(name)
        else:
            name = None  # no name after the window
        total = len(every) - starts[1] + sum(not _has(every, n) for n in itertools.islice(own, starts[0], None))
        mine, shared = [], []
        for name_ in window:
            if _has(own, name_):
                stored = self.lookup(tenant, name_) if read else None
                if stored is not None or not read:
                    mine.append(stored if read else name_)
            if _has(loaded, name_) or _has(extra, name_) or (_has(folders, name_) and self.shared_folder(name_)):
                shared.append(name_)
        return Page(mine, shared, window[-1] if name is not None else None, total)

    def _shared_union(self, loaded: tuple, folders: tuple, extra: tuple) -> tuple[str, ...]:
        """Every shared name, sorted, once: reused while the three listings are the same objects (cached)."""
        with self._names_lock:
            last = self._union
            if last is not None and last[0] is loaded and last[1] is folders and last[2] == extra:
                return last[3]
        union = tuple(sorted(set(loaded) | set(folders) | set(extra)))
        with self._names_lock:
            self._union = (loaded, folders, extra, union)
        return union

    def names(self, folder: Path, suffix: str) -> tuple[str, ...]:
        """The adapter names in ``folder`` (entries ending in ``suffix``, removed), sorted: one stat while the
        folder is unchanged (its mtime), one listdir when it changed; the last NAME_CACHE folders are kept.
        A listing is reused only once its mtime is NAME_SETTLE_NS old: a file system's clock is coarse (a
        change in the same tick keeps the mtime), so a folder changed just now is listed again."""
        try:
            stamp = os.stat(folder).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            return ()
        key = (str(folder), suffix)
        with self._names_lock:
            cached = self._names_cache.get(key)
            if cached is not None and cached[0] == stamp:
                self._names_cache.move_to_end(key)
                return cached[1]
        names = tuple(sorted(_names(folder, suffix)))
        if time.time_ns() - stamp < NAME_SETTLE_NS:
            return names
        with self._names_lock:
            self._names_cache[key] = (stamp, names)
            self._names_cache.move_to_end(key)
            while len(self._names_cache) > NAME_CACHE:
                self._names_cache.popitem(last=False)
        return names

    def _tenant_dir(self, tenant: str) -> Path:
        return self.root / TENANTS_DIR / tenant_dir_name(tenant)

    def lookup(self, tenant: str, name: str) -> StoredAdapter | None:
        """The tenant's current version of ``name`` (one small JSON read), or None."""
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            return None
        return self._read_pointer(tenant, self._tenant_dir(tenant) / "adapters" / f"{name}.json", name)

    def list(self, tenant: str) -> list[StoredAdapter]:
        """The tenant's adapters, sorted by name."""
        return self._pointers(self._tenant_dir(tenant), tenant)

    def _pointers(self, tdir: Path, tenant: str) -> list[StoredAdapter]:
        """The current adapters of a tenant folder, sorted by name (unreadable pointers skipped)."""
        folder = tdir / "adapters"
        try:
            entries = sorted(os.listdir(folder))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = entry.removesuffix(".json")
            if entry.endswith(".json") and ADAPTER_NAME.fullmatch(name):
                adapter = self._read_pointer(tenant, folder / entry, name)
                if adapter is not None:
                    found.append(adapter)
        return found

    def info(self, tenant: str, name: str) -> StoredAdapter:
        """The tenant's adapter ``name``; AdapterNotFound if it has none of that name."""
        adapter = self.lookup(tenant, check_name(name))
        if adapter is None:
            raise not_found(name)
        return adapter

    def _read_pointer(self, tenant: str, path: Path, name: str) -> StoredAdapter | None:
        try:
            data = json.loads(path.read_bytes())
            version = data["version"]
            if data["name"] != name or not isinstance(version, str) or not ADAPTER_NAME.fullmatch(version):
                raise ValueError("name or version does not fit the pointer")
            return StoredAdapter(
                tenant=tenant, name=name, version=version,
                path=path.parent.parent / "versions" / name / version, digest=str(data["digest"]),
                rank=int(data["rank"]), target_modules=tuple(map(str, data["target_modules"])),
                bytes=int(data["bytes"]), created=float(data["created"]),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable adapter pointer %s: %s", path, exc)
            return None

    # writing ---------------------------------------------------------------------------------

    def upload(self, tenant: Tenant, name: str, config_text: str, weights: bytes, hf_config,
               max_lora_rank: int, max_expert_rank: int | None = None) -> StoredAdapter:
        """Validate an adapter completely, then store it as the tenant's new current version of ``name``.

        Raises AdapterStoreError for a bad name or adapter or a quota it would exceed, StoreFull
        when the store-wide byte cap has no room; nothing on disk changes unless it succeeds
        (except that retired versions past their grace period may be collected). ``max_expert_rank``: the
        server's MoE expert LoRA rank (None: max_lora_rank; 0: expert and router adapters refused).
        """
        check_name(name)
        self.maybe_collect()  # whichever tenant uploads next
        return self._store_version(tenant, self._tenant_dir(tenant.name), name, config_text, weights, hf_config,
                                   max_lora_rank, max_expert_rank=max_expert_rank)

    def load_shared(self, name: str, config_text: str, weights: bytes, hf_config, max_lora_rank: int,
                    replace: bool = False, max_expert_rank: int | None = None) -> StoredAdapter:
        """Validate an adapter exactly as an upload, then store it as a new version of the shared adapter ``name``
        (served to every tenant). An existing shared name (loaded, or a folder under the root) is refused with
        vLLM's text unless ``replace``; requests in flight keep the version they resolved to."""
        check_name(name)
        exists = self.lookup_shared(name) is not None or self.shared_folder(name) is not None
        if exists and not replace:
            raise _already_loaded(name)
        self.maybe_collect()
        return self._store_version(Tenant(SHARED_OWNER, b""), self.root / SHARED_DIR, name, config_text, weights,
                                   hf_config, max_lora_rank, capped=False, replace=replace,
                                   max_expert_rank=max_expert_rank)

    def unload_shared(self, name: str) -> StoredAdapter:
        """Remove the shared adapter ``name`` loaded at run time (its version stays for the grace period)."""
        check_name(name)
        sdir = self.root / SHARED_DIR
        if not (sdir / ".lock").is_file():
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        with self._locked(sdir):
            pointer = sdir / "adapters" / f"{name}.json"
            old = self._read_pointer(SHARED_OWNER, pointer, name)
            if old is None:
                if self.shared_folder(name):
                    raise AdapterStoreError(f"the shared adapter '{name}' is a folder the operator placed in the "
                                            f"adapter store, not one loaded at run time: remove the folder")
                raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
            pointer.unlink()
            _fsync_dir(pointer.parent)
            self._retire(old.path)
            self._gc(sdir)
        log.info("shared adapter unloaded: name=%s version=%s digest=%s", name, old.version, old.digest)
        return old

    def _store_version(self, tenant: Tenant, tdir: Path, name: str, config_text: str, weights: bytes, hf_config,
                       max_lora_rank: int, capped: bool = True, replace: bool = True,
                       max_expert_rank: int | None = None) -> StoredAdapter:
        """Validate, then make the adapter the current version of ``name`` in ``tdir`` (a tenant's or .shared)."""
        config_bytes, weights = self._checked_files(name, config_text, weights, tenant, hf_config, max_lora_rank)
        version = adapter_digest(config_bytes, weights)[:16]  # content-addressed: same bytes, same folder
        target = tdir / "versions" / name / version
        size = len(config_bytes) + len(weights)
        if not target.is_dir() and capped:  # early (no lock); both checked again under the locks
            replacing = self.lookup(tenant.name, name) is not None
            self._check_count(tenant, self._usage(tdir), replacing)
            self._check_room(tenant, size, collect=True)
        try:
            adapter = parse_peft_adapter(config_bytes, weights, name, hf_config, max_lora_rank,
                                         max_expert_rank=max_expert_rank)
        except AdapterError as exc:
            raise AdapterStoreError(str(exc)) from None
        if tenant.max_adapter_rank and adapter.rank > tenant.max_adapter_rank:
            raise AdapterStoreError(f"adapter {name!r} has rank {adapter.rank}, above the max_adapter_rank quota "
                                    f"({tenant.max_adapter_rank}) of tenant {tenant.name!r}")
        modules = sorted({m for _, m in adapter.weights} | set(adapter.vocab.modules() if adapter.vocab else ()))
        meta = {"name": name, "version": version, "digest": adapter.digest, "rank": adapter.rank,
                "target_modules": modules, "bytes": len(weights), "created": self.clock()}
        tdir = self._tenant_dir_for_writing(tenant.name) if capped else self._shared_dir_for_writing()
        with self._locked(tdir):
            pointer = tdir / "adapters" / f"{name}.json"
            old = self._read_pointer(tenant.name, pointer, name)
            if old is not None and not replace:  # loaded meanwhile (checked early without the lock)
                raise _already_loaded(name)
            self._gc(tdir, keep={(name, version)})
            if not target.is_dir():
                if capped:
                    self._check_count(tenant, self._usage(tdir), replacing=old is not None)
                self._install(tenant, target, config_bytes, weights, adapter.digest, capped)
            (tdir / "adapters").mkdir(exist_ok=True)
            write_atomic(pointer, json.dumps(meta, sort_keys=True).encode())
            if old is not None and old.version != version:
                self._retire(old.path)  # the grace period starts
        stored = StoredAdapter(tenant=tenant.name, name=name, version=version, path=target, digest=adapter.digest,
                               rank=adapter.rank, target_modules=tuple(meta["target_modules"]), bytes=len(weights),
                               created=meta["created"])
        log.info("adapter %s: tenant=%s name=%s version=%s digest=%s rank=%d bytes=%d",
                 "uploaded" if capped else "loaded (shared)", tenant.name, name, version, adapter.digest,
                 adapter.rank, len(weights))
        return stored

    def delete(self, tenant: str, name: str) -> StoredAdapter:
        """Remove the tenant's adapter ``name`` (its version stays readable for the grace period)."""
        check_name(name)
        tdir = self._tenant_dir(tenant)
        if not (tdir / ".lock").is_file():
            raise not_found(name)
        with self._locked(tdir):
            pointer = tdir / "adapters" / f"{name}.json"
            old = self._read_pointer(tenant, pointer, name)
            if old is None:
                raise not_found(name)
            pointer.unlink()
            _fsync_dir(pointer.parent)
            self._retire(old.path)
            self._gc(tdir)
        log.info("adapter deleted: tenant=%s name=%s version=%s digest=%s", tenant, name, old.version, old.digest)
        return old

    # accounting and collection ---------------------------------------------------------------

    def usage(self, tenant: str) -> TenantUsage:
        """What the tenant holds on disk now (retired versions past their grace period not counted)."""
        return self._usage(self._tenant_dir(tenant))

    def stored_bytes(self) -> int:
        """Bytes of every tenant's version folders on disk (what the store-wide cap bounds)."""
        return sum(_folder_bytes(path) for tdir in self._tenant_dirs() for _, _, path in _version_folders(tdir))

    def maybe_collect(self) -> int:
        """collect() if COLLECT_INTERVAL_SECONDS have passed since this store's last collection; else 0."""
        if self.clock() - self._last_collect < COLLECT_INTERVAL_SECONDS:
            return 0
        return self.collect()

    def collect(self) -> int:
        """Remove every tenant's retired versions past the grace period; returns how many (busy tenants skipped)."""
        self._last_collect = self.clock()
        removed = 0
        shared = [self.root / SHARED_DIR] if (self.root / SHARED_DIR / ".lock").is_file() else []
        for tdir in self._tenant_dirs() + shared:
            with self._locked(tdir, wait=False) as held:  # a tenant busy in an upload collects its own
                if held:
                    removed += self._gc(tdir)
        return removed

    def _tenant_dirs(self) -> list[Path]:
        """Every tenant folder under .tenants/ (sorted)."""
        try:
            names = sorted(os.listdir(self.root / TENANTS_DIR))
        except FileNotFoundError:
            return []
        return [self.root / TENANTS_DIR / n for n in names
                if TENANT_DIR.fullmatch(n) and (self.root / TENANTS_DIR / n / ".lock").is_file()]

    def _usage(self, tdir: Path) -> TenantUsage:
        """Current and in-grace retired versions of a tenant folder, and their bytes."""
        current = {(a.name, a.version) for a in self._pointers(tdir, "")}
        cutoff = self.clock() - RETIRED_VERSION_GRACE_SECONDS
        counts, size, oldest = [0, 0], 0, None
        for name, version, path in _version_folders(tdir):
            if (name, version) not in current:
                try:
                    retired = path.lstat().st_mtime
                except FileNotFoundError:
                    continue
                if retired < cutoff:
                    continue  # collectable: the next collection removes it
                oldest = retired if oldest is None else min(oldest, retired)
            counts[(name, version) not in current] += 1
            size += _folder_bytes(path)
        next_free = None if oldest is None else oldest + RETIRED_VERSION_GRACE_SECONDS
        return TenantUsage(current=counts[0], retired=counts[1], bytes=size, next_free=next_free)

    def _check_count(self, tenant: Tenant, usage: TenantUsage, replacing: bool) -> None:
        """Refuse a new version unless the tenant's versions on disk leave room under max_adapters (+1 to replace)."""
        limit = tenant.max_adapters + replacing
        if not tenant.max_adapters or usage.versions < limit:
            return
        held = f"{usage.current} current"
        if usage.retired:
            wait = max(1, math.ceil(usage.next_free - self.clock()))
            held += (f" and {usage.retired} replaced or deleted, kept {RETIRED_VERSION_GRACE_SECONDS} s for "
                     f"requests in flight (the oldest is removed in {wait} s)")
            advice = "retry then"
        else:
            advice = (f"delete one (its version is kept {RETIRED_VERSION_GRACE_SECONDS} s for requests in flight, "
                      f"then removed), or upload under an existing name to replace it")
        quota = f"its max_adapters quota ({tenant.max_adapters}{' plus the version a replacement retires' * replacing})"
        raise AdapterStoreError(f"tenant {tenant.name!r} already has {usage.versions} adapter version(s) on disk "
                                f"({held}), {quota}: {advice}")

    def _check_room(self, tenant: Tenant, size: int, collect: bool = False) -> None:
        """Refuse ``size`` more bytes when the store-wide cap has no room (after a collection, if asked)."""
        if not self.max_bytes:
            return
        stored = self.stored_bytes()
        if stored + size > self.max_bytes and collect and self.collect():
            stored = self.stored_bytes()
        if stored + size > self.max_bytes:
            log.warning("adapter store full: tenant=%s needs %d bytes, uploads hold %d of %d (adapter_store_max_bytes)",
                        tenant.name, size, stored, self.max_bytes)
            raise StoreFull(f"the adapter store is full: this upload ({size} bytes) does not fit under the server's "
                            f"adapter_store_max_bytes; retry later (replaced versions are removed "
                            f"{RETIRED_VERSION_GRACE_SECONDS} s after they are replaced) or ask the operator")

    def _retire(self, path: Path) -> None:
        """Stamp a version folder that just stopped being current: its grace period starts now."""
        now = self.clock()
        with contextlib.suppress(FileNotFoundError):
            os.utime(path, (now, now))

    # helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _checked_files(name: str, config_text, weights, tenant: Tenant, hf_config,
                       max_lora_rank: int) -> tuple[bytes, bytes]:
        """Cheap checks before anything is parsed: types, sizes, quotas, the safetensors header."""
        if not isinstance(config_text, str):
            raise AdapterStoreError(f"adapter_config must be the text of {CONFIG_FILE}")
        config_bytes = config_text.encode("utf-8", "surrogatepass")
        if len(config_bytes) > MAX_CONFIG_BYTES:
            raise AdapterStoreError(f"adapter_config is {len(config_bytes)} bytes; at most {MAX_CONFIG_BYTES} "
                                    f"are allowed")
        if not config_bytes.strip():
            raise AdapterStoreError(f"adapter_config is empty: send the text of {CONFIG_FILE}")
        if not isinstance(weights, (bytes, bytearray, memoryview)) or not weights:
            raise AdapterStoreError(f"adapter_weights is empty: send the bytes of {WEIGHTS_FILE}")
        weights = bytes(weights)
        if tenant.max_adapter_bytes and len(weights) > tenant.max_adapter_bytes:
            raise AdapterStoreError(f"adapter_weights is {len(weights)} bytes, above the max_adapter_bytes quota "
                                    f"({tenant.max_adapter_bytes} bytes) of tenant {tenant.name!r}")
        limit = max_weights_bytes(hf_config, max_lora_rank)
        if len(weights) > limit:
            raise AdapterStoreError(f"adapter_weights is {len(weights)} bytes, more than any valid adapter of "
                                    f"this model at max_lora_rank {max_lora_rank} ({limit} bytes)")
        try:
            check_safetensors_header(weights, max_adapter_tensors(hf_config, uses_dora(config_bytes)))
        except AdapterError as exc:
            raise AdapterStoreError(f"adapter {name!r}: {exc}") from None
        return config_bytes, weights

    def _tenant_dir_for_writing(self, tenant: str) -> Path:
        """The tenant's folder with its TENANT file and lock file, created on first use."""
        tdir = self._tenant_dir(tenant)
        tenant_file = tdir / "TENANT"
        if tenant_file.is_file():
            if tenant_file.read_text(encoding="utf-8", errors="replace").strip() != tenant:
                raise AdapterStoreError("tenant folder name collision; ask the operator")  # sha256 prefix: never
            return tdir
        tdir.mkdir(parents=True, exist_ok=True)
        (tdir / ".lock").touch(exist_ok=True)
        write_atomic(tenant_file, tenant.encode("utf-8", "surrogatepass") + b"\n")
        _fsync_dir(tdir.parent)
        return tdir

    def _shared_dir_for_writing(self) -> Path:
        """``.shared/`` with its lock file, created on first use."""
        sdir = self.root / SHARED_DIR
        sdir.mkdir(parents=True, exist_ok=True)
        (sdir / ".lock").touch(exist_ok=True)
        return sdir

    @staticmethod
    @contextlib.contextmanager
    def _locked(folder: Path, wait: bool = True) -> Iterator[bool]:
        """Hold ``folder/.lock``'s flock (shared by every replica on this store); yields False if busy and not wait."""
        with open(folder / ".lock", "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _install(self, tenant: Tenant, target: Path, config_bytes: bytes, weights: bytes, digest: str,
                 capped: bool = True) -> None:
        """Write a version folder: stage and verify it, then check the cap and rename it under the store's lock."""
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            _write_synced(staging / CONFIG_FILE, config_bytes)
            _write_synced(staging / WEIGHTS_FILE, weights)
            _fsync_dir(staging)
            written = adapter_digest((staging / CONFIG_FILE).read_bytes(), (staging / WEIGHTS_FILE).read_bytes())
            if written != digest:
                raise OSError(f"adapter files read back differ from those written ({written} != {digest})")
            if capped:
                with self._locked(self.root / TENANTS_DIR):  # no other replica places a version meanwhile
                    self._check_room(tenant, len(config_bytes) + len(weights))
                    os.rename(staging, target)
            else:
                os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                target.parent.rmdir()  # only when empty: a refused first version of a name leaves nothing
            raise
        _fsync_dir(target.parent)

    def _gc(self, tdir: Path, keep: set[tuple[str, str]] = frozenset()) -> int:
        """Remove unnamed version folders and ``.tmp-*`` leftovers past the grace period (under the tenant's lock)."""
        removed = 0
        cutoff = self.clock() - RETIRED_VERSION_GRACE_SECONDS
        current = {(a.name, a.version) for a in self._pointers(tdir, "")} | set(keep)
        for folder in (tdir / "adapters", tdir):
            _remove_stale_tmp(folder, cutoff)
        versions = tdir / "versions"
        if not versions.is_dir():
            return removed
        for name_dir in versions.iterdir():
            for entry in list(name_dir.iterdir()) if name_dir.is_dir() else []:
                if (name_dir.name, entry.name) in current:
                    continue
                try:
                    stale = entry.lstat().st_mtime < cutoff
                except FileNotFoundError:
                    continue
                if stale:
                    log.info("removing retired adapter version %s", entry)
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                    removed += not entry.name.startswith(TMP_PREFIX)
            with contextlib.suppress(OSError):
                name_dir.rmdir()  # only when empty
        return removed


class Collector:
    """The server's collection timer: every ``interval`` seconds, store.collect() on a daemon thread."""

    def __init__(self, store: AdapterStore, interval: float = COLLECT_INTERVAL_SECONDS):
        self.store, self.interval = store, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-store-collector", daemon=True)

    def start(self) -> Collector:
        """Start the timer thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the timer thread (a collection under way finishes first)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                removed = self.store.collect()
            except Exception:  # the timer outlives one failed sweep
                log.exception("collecting retired adapter versions failed")
                continue
            if removed:
                log.info("collected %d retired adapter version(s)", removed)


def _version_folders(tdir: Path) -> Iterator[tuple[str, str, Path]]:
    """(name, version, folder) of every version folder of a tenant folder (staging leftovers excluded)."""
    try:
        names = sorted(os.listdir(tdir / "versions"))
    except FileNotFoundError:
        return
    for name in names:
        try:
            versions = sorted(os.listdir(tdir / "versions" / name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for version in versions:
            if not version.startswith(TMP_PREFIX):
                yield name, version, tdir / "versions" / name / version


def _names(folder: Path, suffix: str) -> set[str]:
    """Adapter names in ``folder``: entries ending in ``suffix`` (removed) that fit ADAPTER_NAME (one listdir)."""
    try:
        entries = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {e[:len(e) - len(suffix)] for e in entries
            if e.endswith(suffix) and ADAPTER_NAME.fullmatch(e[:len(e) - len(suffix)])}


def _has(names: tuple[str, ...], name: str) -> bool:
    """Whether the sorted ``names`` hold ``name`` (bisect)."""
    i = bisect.bisect_left(names, name)
    return i < len(names) and names[i] == name


def _folder_bytes(path: Path) -> int:
    """Bytes of the files directly in a folder (0 when it is gone)."""
    try:
        with os.scandir(path) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return 0


def _remove_stale_tmp(folder: Path, cutoff: float) -> None:
    """Remove ``.tmp-*`` files/folders in ``folder`` older than ``cutoff`` (left by crashed writers)."""
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.startswith(TMP_PREFIX):
            try:
                if entry.lstat().st_mtime >= cutoff:
                    continue
            except FileNotFoundError:
                continue
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
