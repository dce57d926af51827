"""Each HTTP request's lifetime: an id, a body read within its bound, and a watch for the client leaving.

The body is read whole before the app runs, and refused with a 413 as soon as its Content-Length
or the bytes read so far pass the bound (the rest is never read). The app then reads it from
memory while the connection is watched: a client that disconnects before its response ended
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


async def _read_body(scope: dict, receive, limit: int) -> bytes | None:
    """The whole body; None when the client left; raises OpenAIError (413) past ``limit`` bytes."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise too_large(limit)
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
    """ASGI middleware: request id, bounded body, and cancel-on-disconnect for every HTTP request."""

    def __init__(self, app, max_body_bytes: int, route_bytes: dict[str, int] | None = None):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.route_bytes = dict(route_bytes or {})  # path -> its own bound (an adapter upload's)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = secrets.token_hex(8)
        scope[REQUEST_ID], scope[ON_CLOSE] = rid, []
        tag, ended, gone = rid.encode(), False, asyncio.Event()
        try:
            body = await _read_body(scope, receive, self.route_bytes.get(scope.get("path"), self.max_body_bytes))
        except OpenAIError as exc:
            return await _refuse(send, exc, tag)
        if body is None:
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def tagged_send(message):
            nonlocal ended
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", tag)]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        current, left, finished = asyncio.current_task(), False, False

        async def watch():
            nonlocal left
            await _disconnected(receive)
            gone.set()
            if not ended and not finished:  # the client went away before its response ended
                left = True
                current.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, replay, tagged_send)
        except asyncio.CancelledError:
            if not left or current.cancelling() > 1:
                raise
        finally:
            finished = True
            watcher.cancel()
            if left:
                current.uncancel()
            for callback in scope[ON_CLOSE]:
                callback()
