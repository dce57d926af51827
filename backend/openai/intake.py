"""Each HTTP request's lifetime: an id, a body read within its bound, and a watch for the client leaving.

The body is read whole before the app runs, and refused with a 413 as soon as its Content-Length
or the bytes read so far pass the bound (the rest is never read). The app then reads it from
memory while the connection is watched. A streamed route (the adapter upload) is not read ahead:
it checks the caller's key first and reads its body as it arrives, within the same bound, and
the watch starts once the body is read. Watched, a client that disconnects before its response ended
(waiting for a template, in the engine's queue, mid-stream) cancels the app, and every Triton
stream the request opened (``on_close``) is cancelled when the request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, Callable

from loraplex.openai.errors import OpenAIError

REQUEST_ID = "loraplex.request_id"  # scope keys
ON_CLOSE = "loraplex.on_close"


def request_id(scope: dict) -> str:
    """The id the gateway gave this request (its ``x-request-id`` reply header)."""
    return scope.get(REQUEST_ID, "-")


def on_close(scope: dict, callback: Callable[[], Any]) -> None:
    """Call ``callback`` when this request ends (its response sent, an error, or the client gone)."""
    scope.setdefault(ON_CLOSE, []).append(callback)


def too_large(limit: int) -> OpenAIError:
    """413: the body is over ``--max-body-bytes``."""
    return OpenAIError(413, f"the request body is over {limit} bytes (the server's limit)", "invalid_request_error",
                       None, "request_too_large")


async def _refuse(send, error: OpenAIError, rid: bytes) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), (b"x-request-id", rid)]})
    await send({"type": "http.response.body", "body": body})


def _declared_too_large(scope: dict, limit: int) -> None:
    """413 when the request's Content-Length is over ``limit`` (nothing of the body is read)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise too_large(limit)


async def _read_body(scope: dict, receive, limit: int) -> bytes | None:
    """The whole body; None when the client left; raises OpenAIError (413) past ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Intake:
    """ASGI middleware: request id, bounded body, and cancel-on-disconnect for every HTTP request.

    A path in ``streamed`` is not read ahead: its route checks the caller first and reads the body itself
    as it arrives (still refused with a 413 past its bound); the disconnect watch starts once it is read.
    """

    def __init__(self, app, max_body_bytes: int, route_bytes: dict[str, int] | None = None,
                 streamed: frozenset[str] = frozenset()):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.route_bytes = dict(route_bytes or {})  # path -> its own bound (an adapter upload's)
        self.streamed = frozenset(streamed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = secrets.token_hex(8)
        scope[REQUEST_ID], scope[ON_CLOSE] = rid, []
        tag, ended, gone = rid.encode(), False, asyncio.Event()
        limit = self.route_bytes.get(scope.get("path"), self.max_body_bytes)
        streamed = scope.get("path") in self.streamed
        try:
            _declared_too_large(scope, limit)
            body = None if streamed else await _read_body(scope, receive, limit)
        except OpenAIError as exc:
            return await _refuse(send, exc, tag)
        if body is None and not streamed:
            return
        delivered, size = False, 0
        current, left, finished, watcher = asyncio.current_task(), False, False, None

        async def watch():
            nonlocal left
            await _disconnected(receive)
            gone.set()
            if not ended and not finished:  # the client went away before its response ended
                left = True
                current.cancel()

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def stream():
            nonlocal delivered, size, watcher
            if delivered:
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":  # the client left while its body was read
                gone.set()
                raise asyncio.CancelledError
            size += len(message.get("body", b""))
            if size > limit:
                raise too_large(limit)
            if not message.get("more_body"):
                delivered = True
                watcher = asyncio.ensure_future(watch())
            return message

        async def tagged_send(message):
            nonlocal ended
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", tag)]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        if not streamed:
            watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, stream if streamed else replay, tagged_send)
        except asyncio.CancelledError:
            if gone.is_set() and not left and not delivered and current.cancelling() == 0:
                return  # raised by stream(): the client left while its body was read
            if not left or current.cancelling() > 1:
                raise
        finally:
            finished = True
            if watcher is not None:
                watcher.cancel()
            if left:
                current.uncancel()
            for callback in scope[ON_CLOSE]:
                callback()
