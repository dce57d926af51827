"""Many concurrent gRPC streams against `lora_llm`: one client and stream per request, over worker processes.

Each request runs in its own `tritonclient.grpc` stream (`start_stream` + one
`async_stream_infer`), so a cancelled one (`stop_stream(cancel_requests=True)`) touches
nothing else. `run_streams` drives a list of jobs from the calling process; `StreamPool`
spreads them over spawned worker processes so the client is not the bottleneck.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from .generate import build_inputs

FLAGS = {"return_num_output_tokens": True, "return_logprobs": True}


@dataclass(slots=True)
class StreamJob:
    """One streamed request; `cancel_after` cancels it after that many responses (0: right after sending)."""

    prompt: str
    params: dict
    tenant: str | None = None
    cancel_after: int | None = None


@dataclass(slots=True)
class StreamOutcome:
    """What one stream got back: token ids (from logprobs), text, token count, FINAL flags, error."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_output_tokens: int = 0
    responses: int = 0
    final_count: int = 0
    error: str | None = None
    cancelled: bool = False


def chosen_token_ids(logprobs_json: str) -> list[int]:
    """Token ids chosen in one response, from its vllm_backend `logprobs` JSON (the first key per token)."""
    return [int(next(iter(entry))) for entry in json.loads(logprobs_json) or []]


def absorb(outcome: StreamOutcome, result) -> bool:
    """Add one response to the outcome; True when it carried the FINAL flag."""
    response = result.get_response()
    if response.outputs:
        outcome.responses += 1
        outcome.text += "".join(v.decode("utf-8") for v in result.as_numpy("text_output")[:1].tolist())
        counts = result.as_numpy("num_output_tokens")
        if counts is not None:
            outcome.num_output_tokens += int(counts[0])
        logprobs = result.as_numpy("logprobs")
        if logprobs is not None:
            outcome.token_ids += chosen_token_ids(logprobs[0])
    final = response.parameters["triton_final_response"].bool_param
    outcome.final_count += final
    return final


def stream_problem(outcome: StreamOutcome, max_tokens: int, tokenizer=None,
                   expected: list[int] | None = None) -> str | None:
    """Why a stream owed exactly `max_tokens` tokens (the `expected` ids, if given) is not exact; None when it is."""
    if outcome.error is not None:
        return f"error: {outcome.error}"
    if outcome.final_count != 1:
        return f"{outcome.final_count} FINAL responses"
    if outcome.num_output_tokens != max_tokens or len(outcome.token_ids) != max_tokens:
        return (f"num_output_tokens {outcome.num_output_tokens}, {len(outcome.token_ids)} token ids; "
                f"max_tokens {max_tokens}")
    if tokenizer is not None and outcome.text != tokenizer.decode(outcome.token_ids, skip_special_tokens=True):
        return "text deltas do not concatenate to the decoded token ids"
    if expected is not None and outcome.token_ids != expected:
        return f"token ids differ from the expected ones at {first_difference(outcome.token_ids, expected)}"
    return None


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where two id lists differ (or the shorter length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class _Stream:
    """One request on its own client and stream; events go to the driver's queue."""

    def __init__(self, grpcclient, url: str, job: StreamJob, events: queue.SimpleQueue, model: str):
        self.job, self.events, self.outcome = job, events, StreamOutcome()
        self.ended = self.closing = False
        self.client = grpcclient.InferenceServerClient(url)
        headers = {"x-tenant-id": job.tenant} if job.tenant else None
        try:
            self.client.start_stream(callback=self._on_response, headers=headers)
            self.client.async_stream_infer(model, build_inputs(grpcclient, job.prompt, job.params, True, **FLAGS),
                                           request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        except Exception as exc:  # noqa: BLE001 - a stream that cannot start is one failed outcome
            self.outcome.error = f"could not start the stream: {exc}"
            events.put(("done", self))
            return
        if job.cancel_after == 0:
            events.put(("cancel", self))

    def _on_response(self, result, error) -> None:
        if self.ended:
            return
        if error is not None:
            self.outcome.error = error.message() if hasattr(error, "message") else str(error)
            self.events.put(("done", self))
        elif absorb(self.outcome, result):
            self.events.put(("done", self))
        elif self.job.cancel_after is not None and self.outcome.responses == self.job.cancel_after:
            self.events.put(("cancel", self))

    def close(self, cancel: bool = False) -> None:
        """End the stream (cancelling its request when asked) and close the client."""
        if self.ended:
            return
        self.ended = True
        if cancel:
            self.outcome.cancelled = True
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run_streams(url: str, jobs: list[StreamJob], timeout: float = 1800.0,
                model: str = "lora_llm") -> list[StreamOutcome]:
    """Run every job at once, each on its own stream; outcomes in job order."""
    import tritonclient.grpc as grpcclient

    events: queue.SimpleQueue = queue.SimpleQueue()
    streams: list[_Stream] = []

    def start_all() -> None:  # beside the loop below, so an early stream's cancel does not wait for the last start
        streams.extend(_Stream(grpcclient, url, job, events, model) for job in jobs)

    starter = threading.Thread(target=start_all, daemon=True)
    starter.start()
    open_count = len(jobs)
    deadline = time.monotonic() + timeout
    cancellers: list[threading.Thread] = []
    while open_count:
        try:
            kind, stream = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if stream.ended or stream.closing:
            continue
        open_count -= 1
        if kind == "cancel":  # on its own thread: a cancel must not wait behind the closes of finished streams
            stream.closing = True
            cancellers.append(threading.Thread(target=stream.close, args=(True,), daemon=True))
            cancellers[-1].start()
        else:
            stream.close()
    starter.join()
    for thread in cancellers:
        thread.join()
    for stream in streams:
        if not stream.ended:
            stream.outcome.error = f"no final response within {timeout:.0f} s"
            stream.close(cancel=True)
    return [s.outcome for s in streams]


class StreamPool:
    """Worker processes that run shares of a job list at the same time (a context manager)."""

    def __init__(self, url: str, procs: int, timeout: float = 1800.0):
        self.url, self.procs, self.timeout = url, max(1, procs), timeout
        self.executor = ProcessPoolExecutor(self.procs, mp_context=multiprocessing.get_context("spawn"))

    def run(self, jobs: list[StreamJob]) -> list[StreamOutcome]:
        """Run the jobs split round-robin over the workers; outcomes in job order."""
        shares = [jobs[i :: self.procs] for i in range(self.procs)]
        futures = [self.executor.submit(run_streams, self.url, share, self.timeout) for share in shares if share]
        outcomes: list[StreamOutcome | None] = [None] * len(jobs)
        for i, future in enumerate(futures):
            outcomes[i :: self.procs] = future.result()
        return outcomes

    def close(self) -> None:
        """Stop the worker processes."""
        self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "StreamPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
