"""Several lora_llm streams (one per prompt of a request) read as one, in arrival order.

``start()`` waits until every stream has answered once, so an error Triton sends at once (bad
key, unknown adapter, over quota) becomes the HTTP status of the reply instead of an event
inside a 200 stream. ``cancel()`` ends every stream still open (their gRPC calls are cancelled).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from loraplex.openai.errors import OpenAIError, internal_error
from loraplex.openai.triton_stream import Delta

log = logging.getLogger("loraplex.openai")

END = None  # a stream's last item


class Generation:
    """The merged deltas of one request's streams: ``(prompt index, Delta)``."""

    def __init__(self, streams: list[AsyncIterator[Delta]], request_id: str = "-"):
        self.streams, self.request_id = streams, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.buffer: list[tuple[int, Delta | None]] = []

    async def _pump(self, index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                self.queue.put_nowait((index, delta))
            self.queue.put_nowait((index, END))
        except OpenAIError as exc:
            self.queue.put_nowait((index, exc))
        except Exception:  # a 500 with the request id for the client, the details in the log
            log.exception("request %s: stream %d failed", self.request_id, index)
            self.queue.put_nowait((index, internal_error(self.request_id)))

    async def _next(self) -> tuple[int, Delta | None]:
        index, item = await self.queue.get()
        if isinstance(item, OpenAIError):
            self.cancel()
            raise item
        return index, item

    async def start(self) -> None:
        """Open every stream and wait for each one's first answer; raises the first error."""
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.streams)]
        answered: set[int] = set()
        try:
            while len(answered) < len(self.streams):
                item = await self._next()
                self.buffer.append(item)
                answered.add(item[0])
        except BaseException:
            self.cancel()
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Every delta after ``start()``, until all streams ended; raises a stream's error."""
        open_streams = len(self.streams)
        try:
            while open_streams:
                index, delta = self.buffer.pop(0) if self.buffer else await self._next()
                if delta is END:
                    open_streams -= 1
                else:
                    yield index, delta
        finally:
            self.cancel()

    def cancel(self) -> None:
        """End every stream still running (does not wait)."""
        for task in self.tasks:
            if not task.done():
                task.cancel()
