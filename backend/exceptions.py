"""The exceptions that cross layers: what a request can fail with, and what it becomes for the client.

One module, importing nothing of ours, so that any layer may raise or catch them without
importing another (`triton/errors.py` maps each to its Triton error code).
"""

from __future__ import annotations

# The one message for a missing and a wrong API key (no difference an attacker could use).
AUTH_ERROR = ("missing or invalid API key (send it in the x-api-key header, "
              "or as the api_key parameter on HTTP generate)")


class InvalidRequest(ValueError):
    """Bad client input: becomes an INVALID_ARG error response."""


class RequestCancelled(Exception):
    """The client cancelled the request: becomes a CANCELLED error response."""


class EngineOverloaded(RuntimeError):
    """Too many requests waiting (max_waiting_requests): becomes an UNAVAILABLE error response."""


class EngineShuttingDown(RuntimeError):
    """The model is being unloaded: becomes an UNAVAILABLE error response."""


class QuotaExceeded(EngineOverloaded):
    """A tenant's quota refuses a request (UNAVAILABLE: retry later)."""


class QueueFull(EngineOverloaded):
    """A tenant is over its part of the waiting queue and the shared part is full (UNAVAILABLE: retry later)."""


class InvalidApiKey(InvalidRequest):
    """A request's API key is missing or matches no tenant (one message for both)."""

    def __init__(self):
        super().__init__(AUTH_ERROR)


class TenantsFileError(ValueError):
    """The tenants file cannot be read or is not valid."""


class AdapterNotFound(KeyError):
    """No adapter is registered under this name."""


class AdapterError(ValueError):
    """An adapter that cannot be served: missing, malformed, unsupported, or not for this model."""


class AdapterStoreError(ValueError):
    """An upload that is refused: a bad name, a bad adapter, or over a quota (INVALID_ARG)."""


class StoreFull(AdapterStoreError):
    """An upload the store-wide byte cap has no room for now (UNAVAILABLE: collection frees room)."""


class NonFiniteLogits(RuntimeError):
    """The model produced NaN or infinite logits for one sequence: that request fails alone."""
