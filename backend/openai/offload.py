"""Prompt rendering and token counting off the event loop: a few threads, a bounded queue, a time bound.

A Python thread cannot be stopped, so the bound on a job's cost is its input (the request body's
bound) and the template (the operator's own: a request cannot supply one). The pool bounds the
rest: at most ``threads`` jobs run at once, at most ``threads * RENDER_QUEUE_PER_THREAD`` are
admitted (more is a 503 at once), and a job that has not finished within ``timeout_s`` (queueing
included) answers its request with a 503 while the event loop goes on serving everyone else. A
queued job whose request timed out or went away is dropped before it starts. ``busy`` counts the
threads running a job right now, those whose request already got its 503 included (the gateway's
``/metrics``).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from loraplex.openai.errors import OpenAIError
from loraplex.openai.limits import RENDER_QUEUE_PER_THREAD


def _busy(message: str, code: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable_error", None, code)


class RenderPool:
    """Runs CPU-bound request work (chat templates, token counts) on a bounded set of threads."""

    def __init__(self, threads: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.max_admitted = threads * RENDER_QUEUE_PER_THREAD
        self.admitted = 0  # jobs whose request still waits for them (only the event loop touches it)
        self.threads = threads
        self.busy = 0  # jobs running on a thread now, finished with or not by their request (under _lock)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-render")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a pool thread; 503 when the pool is full or the job is not done within the bound."""
        if self.admitted >= self.max_admitted:
            raise _busy(f"the gateway is busy rendering prompts ({self.admitted} waiting); retry later",
                        "service_unavailable")
        self.admitted += 1
        try:
            job = self._executor.submit(self._counted, fn, args)
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except TimeoutError:
            raise _busy(f"rendering the prompt took over {self.timeout_s:g} s (--render-timeout); retry later "
                        "or send a shorter conversation", "render_timeout") from None
        finally:
            self.admitted -= 1

    def _counted(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(*args)`` on a pool thread, counted in ``busy`` while it runs."""
        with self._lock:
            self.busy += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.busy -= 1

    def close(self) -> None:
        """Stop taking jobs; queued ones are dropped, running ones finish in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)
