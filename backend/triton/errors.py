"""Which Triton error code each engine exception becomes."""

from __future__ import annotations

import logging
import secrets

from loraplex.exceptions import (AdapterError, AdapterNotFound, AdapterStoreError, EngineOverloaded, EngineShuttingDown, InvalidRequest, RequestCancelled, StoreFull)

MAX_MESSAGE_CHARS = 2000
INTERNAL_TEXT = "internal error (request {ref}); the server log has the details"

log = logging.getLogger("loraplex.triton")


def error_code(pb_utils, exc: Exception):
    """INVALID_ARG for bad input or a bad adapter, NOT_FOUND, UNAVAILABLE (overload, a full store), CANCELLED;
    else INTERNAL."""
    codes = pb_utils.TritonError
    for kind, code in (
        (InvalidRequest, codes.INVALID_ARG),
        (AdapterError, codes.INVALID_ARG),
        (StoreFull, codes.UNAVAILABLE),  # the server's capacity, not the request: retry once versions are collected
        (AdapterStoreError, codes.INVALID_ARG),
        (AdapterNotFound, codes.NOT_FOUND),
        (EngineOverloaded, codes.UNAVAILABLE),
        (EngineShuttingDown, codes.UNAVAILABLE),
        (RequestCancelled, codes.CANCELLED),
    ):
        if isinstance(exc, kind):
            return code
    return codes.INTERNAL


def error_message(exc: Exception) -> str:
    """The client-facing message: KeyError's unquoted, bounded in length, always encodable as UTF-8."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc) or type(exc).__name__
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + " ..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def client_error(pb_utils, exc: Exception, request_id: str | None = None) -> tuple[str, object]:
    """(message, code) to send: an INTERNAL error as a generic text naming the request, its details only logged.

    An unexpected exception's text may carry paths, reprs or internals; the log line and
    the client's message share the reference, so an operator can find one from the other.
    """
    code = error_code(pb_utils, exc)
    if code != pb_utils.TritonError.INTERNAL:
        return error_message(exc), code
    ref = request_id or secrets.token_hex(8)
    log.error("internal error in request %s", ref, exc_info=exc)
    return INTERNAL_TEXT.format(ref=ref), code
