"""AdapterManager: which adapters are known, which sit in host memory, which own a device slot.

Three tiers: registered (name -> folder on disk), host (an LRU of at most max_cpu_loras
validated LoraAdapter objects) and device (LoraSlots rows). acquire() pins an adapter in a
device slot for a running sequence, loading it from host or disk on demand and evicting
the least recently used unpinned adapter when the slots are full; release() unpins.

Re-registering a name drops its host copy and marks its device copy stale; the next
acquire() re-reads the folder and reuses the slot only if the content digest is unchanged.
refresh() does the same when the adapter's files changed or vanished on disk since they
were read (inode, size, mtime), so new requests see the store as it is now.
A device copy replaced (or unregistered) while pinned is retired: it keeps its slot for
the sequences still using it and frees the slot when the last of them releases it.

Thread-safety: none. Every call comes from the engine loop thread (the Triton threads hand
their requests to that loop), so there are no locks, with two exceptions that change no
state: ``read`` (a disk read, for the preloader's worker thread; its memo of failed reads has a
lock of its own) and ``needs_read`` (a racy hint: at worst an adapter is read twice, or read on
the loop thread as a fallback).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from loraplex.exceptions import AdapterError, AdapterNotFound
from loraplex.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter, load_peft_adapter
from loraplex.lora.slots import LoraSlots
from loraplex.lora.vocab import check_base_copies


MAX_REMEMBERED_FAILURES = 256  # folders whose failed validation read() remembers (by their files' signature)


def files_signature(path: Path) -> tuple | None:
    """(inode, size, mtime) of an adapter folder's two files; None when one is missing."""
    try:
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns)
                     for st in (os.stat(path / CONFIG_FILE), os.stat(path / WEIGHTS_FILE)))
    except OSError:
        return None


@dataclass(slots=True)
class _Resident:
    name: str
    slot: int
    digest: str
    pins: int = 0
    stale: bool = False  # re-registered since loaded: content re-checked on next acquire


class AdapterManager:
    """Registry, host-memory LRU and device slots (with pins and LRU eviction) of LoRA adapters."""

    def __init__(self, slots: LoraSlots, hf_config, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype = torch.float32) -> None:
        if max_lora_rank > slots.max_rank:
            raise ValueError(f"max_lora_rank {max_lora_rank} exceeds the slots' max_rank {slots.max_rank}")
        if max_cpu_loras < 0:
            raise ValueError("max_cpu_loras must be >= 0")
        self.slots = slots
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.loads_from_disk = 0
        self.device_loads = 0  # copies into a device slot (metrics)
        self.evictions = 0
        self.host_evictions = 0
        self._paths: dict[str, Path] = {}
        self._signatures: dict[str, tuple | None] = {}  # files as last read from disk
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._resident: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        self._retired: dict[int, _Resident] = {}  # slot -> replaced version still pinned
        self._free: list[int] = list(range(slots.max_loras))
        self._failures: dict[str, tuple[tuple, str]] = {}  # folder -> (files' signature, error) of a failed read
        self._failures_lock = threading.Lock()  # read() runs on the preloader's thread and the loop's
        # load latencies for metrics: observe(stage, seconds), stage "disk_read" (any thread) or "host_to_device"
        self.observe: Callable[[str, float], None] = lambda stage, seconds: None

    # registry -------------------------------------------------------------------------

    def register(self, name: str, path) -> None:
        """Make an adapter folder servable under a name; re-registering invalidates cached copies."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty string, got {name!r}")
        existed = name in self._paths
        self._paths[name] = Path(path)
        self._signatures.pop(name, None)
        if existed:
            self._host.pop(name, None)
            rec = self._resident.get(name)
            if rec is not None:
                rec.stale = True

    def unregister(self, name: str) -> None:
        """Forget an adapter; a device copy still pinned keeps its slot until released."""
        self._path(name)
        del self._paths[name]
        self._signatures.pop(name, None)
        self._host.pop(name, None)
        rec = self._resident.pop(name, None)
        if rec is not None:
            self._retire(rec)

    def refresh(self, name: str) -> None:
        """If the adapter's files changed or vanished since they were read, drop the cached copies (as register)."""
        path = self._path(name)
        if name in self._signatures and files_signature(path) != self._signatures[name]:
            self.register(name, path)

    def names(self) -> list[str]:
        """Registered adapter names, sorted."""
        return sorted(self._paths)

    def digest(self, name: str) -> str:
        """Content digest of an adapter, loading and validating it into host memory if needed."""
        self._path(name)
        rec = self._resident.get(name)
        if rec is not None and not rec.stale:
            return rec.digest
        return self._host_get(name).digest

    # reading off the loop thread --------------------------------------------------------

    def needs_read(self, name: str, folder: str | None = None) -> str | None:
        """The folder acquiring ``name`` would read now (in neither host memory nor a current slot), else None.

        ``folder`` is for a name not registered yet (an uploaded version, registered at admission).
        """
        path, rec = folder or self._paths.get(name), self._resident.get(name)
        if path is None or self.max_cpu_loras == 0 or name in self._host or (rec is not None and not rec.stale):
            return None
        return str(path)

    def read(self, name: str, folder: str) -> tuple[str, tuple | None, LoraAdapter]:
        """Read and validate an adapter folder (any thread): (the folder, its files' signature, the adapter).

        A folder whose unchanged files failed validation before fails again at once, with the same error
        (the loop thread reads again what the preloader could not: that must not redo the work)."""
        signature = files_signature(Path(folder))  # before reading: a change while reading shows at adopt
        with self._failures_lock:
            failed = self._failures.get(folder)
        if failed is not None and signature is not None and failed[0] == signature:
            raise AdapterError(failed[1])
        start = time.perf_counter()
        try:
            adapter = load_peft_adapter(folder, name, self.hf_config, self.max_lora_rank, self.dtype,
                                        max_expert_rank=self.slots.max_expert_rank)
            if adapter.magnitudes and self.slots.base_weight is not None:  # DoRA's scales here, off the loop (052)
                adapter.dora_scales(self.slots.weight_of)
            if adapter.vocab is not None and self.slots.vocab.base is not None:  # peft's base copies, as DoRA's
                check_base_copies(adapter, self.slots.vocab.base)
        except AdapterError as exc:
            if signature is not None:
                self._remember_failure(folder, signature, str(exc))
            raise
        self.observe("disk_read", time.perf_counter() - start)
        return folder, signature, adapter

    def _remember_failure(self, folder: str, signature: tuple, message: str) -> None:
        with self._failures_lock:
            self._failures.pop(folder, None)
            self._failures[folder] = (signature, message)
            while len(self._failures) > MAX_REMEMBERED_FAILURES:
                del self._failures[next(iter(self._failures))]

    def adopt(self, name: str, preloaded: tuple[str, tuple | None, LoraAdapter]) -> None:
        """Put an adapter ``read`` off the loop thread into the host tier, if it is still what ``name`` serves."""
        folder, signature, adapter = preloaded
        path = self._paths.get(name)
        if path is None or path != Path(folder) or name in self._host or signature is None:
            return
        if files_signature(path) != signature:
            return  # changed since it was read: acquire reads it again
        self._signatures[name] = signature
        self.loads_from_disk += 1
        self._keep_on_host(name, adapter)

    # device slots ---------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """Pin an adapter in a device slot and return the slot; None when every slot is pinned."""
        self._path(name)
        rec = self._resident.get(name)
        if rec is not None and not rec.stale:
            return self._pin(rec)
        if rec is None and not self._slot_available():
            return None  # waiting for a slot must not re-read the adapter every step
        adapter = self._host_get(name)
        if rec is not None:
            if rec.digest == adapter.digest:
                rec.stale = False
                return self._pin(rec)
            del self._resident[name]
            self._retire(rec)
        slot = self._take_slot()
        if slot is None:
            return None
        start = time.perf_counter()
        try:
            self.slots.load(slot, adapter)
        except BaseException:
            self._free_slot(slot)  # a load that fails keeps no slot
            raise
        self.observe("host_to_device", time.perf_counter() - start)
        self.device_loads += 1
        rec = _Resident(name=name, slot=slot, digest=adapter.digest)
        self._resident[name] = rec
        return self._pin(rec)

    def release(self, name: str, slot: int | None = None) -> None:
        """Drop one pin taken by acquire(); pass the slot acquire() returned to be exact across re-registers."""
        candidates = [r for r in self._retired.values() if r.name == name]
        rec = self._resident.get(name)
        if rec is not None and rec.pins > 0:
            candidates.append(rec)
        if slot is not None:
            candidates = [r for r in candidates if r.slot == slot]
        if not candidates:
            if name not in self._paths and rec is None:
                raise AdapterNotFound(name)
            raise ValueError(f"release({name!r}): adapter is not pinned" + (f" in slot {slot}" if slot is not None else ""))
        if len(candidates) > 1:
            raise ValueError(f"release({name!r}): pinned in slots {sorted(r.slot for r in candidates)}; pass slot=")
        rec = candidates[0]
        rec.pins -= 1
        if rec.pins == 0 and self._retired.get(rec.slot) is rec:
            del self._retired[rec.slot]
            self._free_slot(rec.slot)

    def reset_pins(self) -> None:
        """Drop every pin (the engine reset its state: no sequence holds one); retired slots are freed."""
        for rec in self._resident.values():
            rec.pins = 0
        for slot in list(self._retired):
            del self._retired[slot]
            self._free_slot(slot)

    def would_evict(self, name: str) -> bool:
        """Whether acquire(name) now would take a slot from another adapter (not resident and no slot free)."""
        return name not in self._resident and not self._free

    def num_registered(self) -> int:
        """Adapters servable by name (the disk tier)."""
        return len(self._paths)

    def is_resident(self, name: str) -> bool:
        """Whether acquire(name) would find the adapter's current version already in a slot."""
        rec = self._resident.get(name)
        return rec is not None and not rec.stale

    def slot_of(self, name: str) -> int | None:
        """Device slot of the adapter's current version, or None when not resident."""
        return self._resident[name].slot if self.is_resident(name) else None

    def pins(self, name: str) -> int:
        """Pin count of the adapter's resident version (0 when not resident)."""
        rec = self._resident.get(name)
        return rec.pins if rec is not None else 0

    def pinned_count(self) -> int:
        """Number of device slots pinned by at least one sequence."""
        return sum(1 for r in self._resident.values() if r.pins > 0) + len(self._retired)

    def total_pins(self) -> int:
        """Pins held by running sequences, over every resident and retired device copy."""
        return sum(r.pins for r in self._resident.values()) + sum(r.pins for r in self._retired.values())

    def resident_names(self) -> list[str]:
        """Names holding a device slot, least recently used first."""
        return list(self._resident)

    def host_names(self) -> list[str]:
        """Names held in the host-memory tier, least recently used first."""
        return list(self._host)

    # internals ------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        try:
            return self._paths[name]
        except KeyError:
            raise AdapterNotFound(name) from None

    def _pin(self, rec: _Resident) -> int:
        rec.pins += 1
        self._resident.move_to_end(rec.name)
        return rec.slot

    def _host_get(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        _, signature, adapter = self.read(name, str(self._paths[name]))
        self._signatures[name] = signature
        self.loads_from_disk += 1
        self._keep_on_host(name, adapter)
        return adapter

    def _keep_on_host(self, name: str, adapter: LoraAdapter) -> None:
        if self.max_cpu_loras > 0:
            self._host[name] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
                self.host_evictions += 1

    def _slot_available(self) -> bool:
        return bool(self._free) or any(r.pins == 0 for r in self._resident.values())

    def _take_slot(self) -> int | None:
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
            return slot
        for name, rec in self._resident.items():
            if rec.pins == 0:
                del self._resident[name]
                self.evictions += 1
                return rec.slot
        return None

    def _retire(self, rec: _Resident) -> None:
        if rec.pins > 0:
            self._retired[rec.slot] = rec
        else:
            self._free_slot(rec.slot)

    def _free_slot(self, slot: int) -> None:
        self.slots.clear(slot)
        self._free.append(slot)


__all__ = ["AdapterManager", "AdapterNotFound"]
