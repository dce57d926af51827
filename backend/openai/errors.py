"""OpenAI's error object, and which HTTP status each Triton error becomes.

Over a gRPC stream Triton sends only an error's message (no code), so the mapping reads the
messages the model is known to send; anything else the model refuses is bad input (400).
What reaches a client names no address, path or exception: lora_llm's own messages pass with
addresses and paths cut out, gRPC's details never do, and an unexpected failure is a generic
500 with the request id (the details go to the log).
"""

from __future__ import annotations

import logging
import re

import grpc

log = logging.getLogger("loraplex.openai")

AUTH_TEXT = "missing or invalid API key"  # loraplex.tenancy.tenants.AUTH_ERROR starts so
NOT_FOUND_TEXT = "we currently support"  # vllm_backend's unknown-LoRA text: "LoRA x is not supported, we currently support [...]"
QUOTA_TEXT = "tenant quota exceeded"
UNAVAILABLE_TEXTS = (
    "server overloaded", "shutting down", "is not healthy", "unknown model", "is not ready", "not ready",
    "no available versions", "Stream removed", "Socket closed", "Request was cancelled",
)


RETRY_AFTER_S = {429: 2, 503: 1}  # the Retry-After header's seconds on these statuses (OpenAI's SDKs honour it)
MAX_CLIENT_TEXT = 4096  # lora_llm's messages are cut at 2,000 characters; nothing longer is its own
# What is cut out of a message: each pattern is linear (a match may start only where its run of characters
# starts, so no run is rescanned from each of its characters); ``at`` marks where a cut begins in its run, ``to``
# where it ends when the match stops short of it (a port: the run after it is the next match's).
_ADDRESSES_AND_PATHS = tuple(re.compile(pattern, re.IGNORECASE) for pattern in (
    r"(?<![a-z0-9+.-])[0-9+.-]*+(?P<at>)[a-z][a-z0-9+.-]*+://\S+",  # URLs, from the scheme's first letter
    r"\b(?:ipv4|ipv6|unix|dns):\S+",  # gRPC's peer names
    r"\[(?=[0-9a-f]*+:)[0-9a-f:]*+\](?::\d+)?",  # [v6]:port
    r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b",  # v4[:port]
    r"(?<![\w.-])(?:[.-]|[^\Wa-z]\w*+)*+(?P<at>)[a-z][\w.-]*+(?=:\d{2,5}\b(?!\.\d)(?P<to>))",  # host:port
    r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*",  # absolute paths
))
_DEBUG_MARKS = ("Traceback (most recent call last)", 'File "', "debug_error_string", "grpc_status",
                "created_time", "grpc_message")


def client_text(message: str) -> str | None:
    """``message`` fit for a client (addresses and paths cut out); None for a traceback or gRPC debug text."""
    if len(message) > MAX_CLIENT_TEXT or any(mark in message for mark in _DEBUG_MARKS):
        return None
    spans = sorted((m.start("at") if "at" in m.re.groupindex else m.start(),
                    m.end("to") if "to" in m.re.groupindex else m.end())
                   for pattern in _ADDRESSES_AND_PATHS for m in pattern.finditer(message))
    kept, last = [], 0
    for start, end in spans:  # overlapping cuts are one cut
        if end <= last:
            continue
        if start > last or not kept:
            kept.append(message[last:start])
            kept.append("<redacted>")
        last = max(last, end)
    return "".join(kept) + message[last:]


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """The JSON body OpenAI's clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` on a 429 or 503; ``Connection: close`` on a 413 (the rest of that body is not read)."""
        if self.status == 413:
            return {"Connection": "close"}
        seconds = RETRY_AFTER_S.get(self.status)
        return {"Retry-After": str(seconds)} if seconds is not None else {}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """400: the request itself is wrong."""
    return OpenAIError(400, message, "invalid_request_error", param, None)


def unavailable(message: str) -> OpenAIError:
    """503: overloaded, not ready, shutting down or unreachable; retry later or elsewhere."""
    return OpenAIError(503, message, "service_unavailable_error", None, "service_unavailable")


def internal_error(request_id: str) -> OpenAIError:
    """500: a failure the client cannot act on; the request id finds its details in the gateway's log."""
    return OpenAIError(500, f"internal error in the gateway (request id {request_id})", "server_error", None,
                       "internal_error")


def from_triton(message: str, request_id: str = "-") -> OpenAIError:
    """The OpenAI error for a message lora_llm sent on its stream."""
    text = client_text(message)
    if text is None:
        log.error("request %s: Triton sent an error not fit for the client: %s", request_id, message)
        return internal_error(request_id)
    message = text
    if message.startswith(AUTH_TEXT):
        return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")
    if message.startswith("LoRA ") and NOT_FOUND_TEXT in message:
        return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")
    if message.startswith(QUOTA_TEXT):
        return OpenAIError(429, message, "rate_limit_error", None, "rate_limit_exceeded")
    if any(mark in message for mark in UNAVAILABLE_TEXTS):
        return unavailable(message)
    return bad_request(message)


def from_rpc(exc: grpc.RpcError, request_id: str = "-") -> OpenAIError:
    """The OpenAI error for a failed gRPC call to Triton (unreachable, stream torn down, ...)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # lora_llm's own message
        return from_triton(details or "", request_id)
    log.warning("request %s: gRPC call to Triton failed: %s %s", request_id, code, details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable("Triton is unreachable or going away; retry later")
    if code == grpc.StatusCode.NOT_FOUND:
        return unavailable("lora_llm is not served by this Triton; retry later")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return unavailable("Triton is out of resources; retry later")
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
        return unavailable("the stream to Triton ended before the request finished; retry later")
    return internal_error(request_id)
