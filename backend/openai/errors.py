"""OpenAI's error object, and which HTTP status each Triton error becomes.

Over a gRPC stream Triton sends only an error's message (no code), so the mapping reads the
messages the model is known to send; anything else the model refuses is bad input (400).
"""

from __future__ import annotations

import grpc

AUTH_TEXT = "missing or invalid API key"  # loraplex.tenancy.AUTH_ERROR starts so
NOT_FOUND_TEXT = "we currently support"  # vllm_backend's unknown-LoRA text: "LoRA x is not supported, we currently support [...]"
QUOTA_TEXT = "tenant quota exceeded"
UNAVAILABLE_TEXTS = (
    "server overloaded", "shutting down", "is not healthy", "unknown model", "is not ready", "not ready",
    "no available versions", "Stream removed", "Socket closed", "Request was cancelled",
)


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """The JSON body OpenAI's clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """400: the request itself is wrong."""
    return OpenAIError(400, message, "invalid_request_error", param, None)


def unavailable(message: str) -> OpenAIError:
    """503: overloaded, not ready, shutting down or unreachable; retry later or elsewhere."""
    return OpenAIError(503, message, "service_unavailable_error", None, "service_unavailable")


def from_triton(message: str) -> OpenAIError:
    """The OpenAI error for a message lora_llm sent on its stream."""
    if message.startswith(AUTH_TEXT):
        return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")
    if message.startswith("LoRA ") and NOT_FOUND_TEXT in message:
        return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")
    if message.startswith(QUOTA_TEXT):
        return OpenAIError(429, message, "rate_limit_error", None, "rate_limit_exceeded")
    if any(text in message for text in UNAVAILABLE_TEXTS):
        return unavailable(message)
    return bad_request(message)


def from_rpc(exc: grpc.RpcError, url: str) -> OpenAIError:
    """The OpenAI error for a failed gRPC call to Triton (unreachable, stream torn down, ...)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"Triton at {url} is unreachable or going away: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return from_triton(details or "")
    if code == grpc.StatusCode.NOT_FOUND:
        return unavailable(f"Triton at {url} does not serve the model: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return unavailable(details or "Triton is out of resources")
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
        return unavailable(f"the stream to Triton at {url} ended: {details}")
    return OpenAIError(500, f"Triton at {url} failed: {code.name if code else ''} {details}".strip(),
                       "server_error", None, "internal_error")
