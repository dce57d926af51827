"""What other threads hand the engine loop: one typed message each, drained at the start of a step.

The loop thread owns the scheduler; every other thread (Triton's, the admission pool, the
adapter preloader, the output processor) reaches it only through these messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.request import Request, Sequence


@dataclass(slots=True, frozen=True)
class Add:
    """A validated request to schedule (its adapter already read, if it had to be)."""

    request: Request


@dataclass(slots=True, frozen=True)
class Abort:
    """The client cancelled this request: end it with CANCELLED and free what it holds."""

    request_id: str


@dataclass(slots=True, frozen=True)
class StopSample:
    """The output processor matched a stop string: end this sample (its final output is sent)."""

    seq: Sequence


@dataclass(slots=True, frozen=True)
class FinalMade:
    """The output processor made the final output of a request with stop strings: count its end by its reason."""

    request: Request


@dataclass(slots=True, frozen=True)
class OutputFailed:
    """The output processor could not make a request's output: fail it with its one error output."""

    request: Request
    error: Exception


Message = Add | Abort | StopSample | FinalMade | OutputFailed
