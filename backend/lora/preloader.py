"""Reads cold adapters from disk on a worker thread, so that loading one never stalls the engine loop.

A request whose adapter is neither in host memory nor in a device slot waits here, not in
the engine's inbox: the worker reads and validates the folder (``AdapterManager.read``),
then hands the request on with the result; the loop thread only adopts the validated copy
into its host tier (``AdapterManager.adopt``). A read that fails hands the request on with
nothing: the loop reads it again and fails that request alone with the adapter's error.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from typing import Callable

log = logging.getLogger("loraplex.lora")


class AdapterPreloader:
    """One daemon worker thread, started on first use; ``deliver(request, preloaded_or_None)`` runs on it."""

    def __init__(self, read: Callable, deliver: Callable) -> None:
        self._read, self._deliver = read, deliver
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: Counter = Counter()  # adapter name -> reads submitted and not delivered yet

    def loading(self) -> int:
        """Distinct adapters being read (submitted, not delivered yet): the host tier's loading gauge."""
        with self._lock:
            return len(self._pending)

    def submit(self, request, name: str, folder: str) -> None:
        """Read adapter ``name`` from ``folder`` for ``request``, then deliver it."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="loraplex-adapter-load", daemon=True)
                self._thread.start()
            self._pending[name] += 1
        self._queue.put((request, name, folder))

    def close(self, timeout: float = 30.0) -> None:
        """Finish the reads already submitted (their requests are delivered), then stop the worker."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            request, name, folder = item
            try:
                preloaded = self._read(name, folder)
            except Exception:  # the loop thread reads it again and fails that request alone
                log.debug("preloading adapter %r failed; the engine loop will report it", name, exc_info=True)
                preloaded = None
            with self._lock:
                self._pending[name] -= 1
                if self._pending[name] <= 0:
                    del self._pending[name]
            try:
                self._deliver(request, preloaded)
            except Exception:  # the worker must never die
                log.exception("handing request %s on after its adapter load failed", request.request_id)
