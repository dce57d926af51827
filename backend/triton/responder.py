"""The response thread: coalesces engine deltas per request and sends them via Triton senders.

A send is an IPC round trip through the Python backend, so every delta pending for a request goes
out as one response; the engine loop never blocks on delivery. With ``stream_interval`` N > 1
a stream's response waits until it carries N new tokens (vLLM's ``--stream-interval``): the
first response and the final one go out at once.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from loraplex.triton.errors import client_error

log = logging.getLogger("loraplex.responder")

WAKE_SECONDS = 0.02  # the response thread's idle wake-up, for cancellation polls
CANCEL_POLL_SECONDS = 0.1  # each request's is_cancelled() is asked about this often...
CANCEL_POLLS_PER_SECOND = 200  # ...but no more of them than this in all (each an IPC round trip)


@dataclass(slots=True)
class Pending:
    """Per request: its sender, what the client asked for, and unsent deltas per sample."""

    sender: object
    stream: bool
    prompt: str
    exclude_input: bool
    returns: dict
    n: int
    texts: list = field(default_factory=list)  # per sample, its unsent text pieces (joined once, when sent)
    num_tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    cumulative: list = field(default_factory=list)
    num_input_tokens: int = 0
    abort_requested: bool = False
    streamed: bool = False  # a streamed response went out (the first is never held back)

    def __post_init__(self):
        self.reset_deltas()
        self.finish, self.cumulative = [None] * self.n, [0.0] * self.n

    def reset_deltas(self) -> None:
        """After a streamed send, the next response carries only what comes next."""
        self.texts, self.num_tokens = [[] for _ in range(self.n)], [0] * self.n
        self.logprobs = [[] for _ in range(self.n)]


class Responder:
    """Owns the senders; turns RequestOutput deltas into Triton responses."""

    def __init__(self, pb_utils, abort: callable, decode_token: callable, stream_interval: int = 1):
        self.pb = pb_utils
        self.stream_interval = stream_interval
        self.abort = abort
        self.decode_token = decode_token
        self.pending: dict[str, Pending] = {}
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel_polls = CancelPolls()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="loraplex-responder", daemon=True)

    def start(self) -> None:
        """Start the response thread."""
        self.thread.start()

    def stop(self) -> None:
        """Stop the response thread after it drains."""
        self.stopping = True
        self.queue.put(None)
        self.thread.join(5)

    def register(self, request_id: str, sender, stream: bool, prompt: str, exclude_input: bool, returns: dict, n: int):
        """Remember a request before the engine can produce output for it."""
        with self.lock:
            self.pending[request_id] = Pending(sender, stream, prompt, exclude_input, returns, n)
            self.cancel_polls.add(request_id)

    def unregister(self, request_id: str) -> None:
        """Forget a registered request the engine refused (nothing was sent for it)."""
        with self.lock:
            self.pending.pop(request_id, None)

    def push(self, outputs: list) -> None:
        """Called by the engine loop; never blocks."""
        self.queue.put(outputs)

    def send_error(self, sender, message: str, code) -> None:
        """An error response with the FINAL flag."""
        error = self.pb.TritonError(message, code)
        sender.send(self.pb.InferenceResponse(output_tensors=[], error=error),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _run(self) -> None:
        while not self.stopping:
            try:
                self._serve_once()
            except Exception:  # the response thread must never die
                log.exception("response thread iteration failed")

    def _serve_once(self) -> None:
        """Take every pending batch of outputs, send one response per touched request, poll cancellation."""
        try:
            batch = self.queue.get(timeout=WAKE_SECONDS)
        except queue.Empty:
            batch = []
        if batch is None:
            self.stopping = True
            return
        batches = [batch]
        while not self.queue.empty():  # coalesce everything already pending
            more = self.queue.get_nowait()
            if more is None:
                self.stopping = True
                break
            batches.append(more)
        touched: dict[str, Pending] = {}
        for outputs in batches:
            for out in outputs:
                self._contained(out.request_id, self._absorb, out, touched)
        for request_id, p in touched.items():
            self._contained(request_id, self._flush, request_id, p)
        self._poll_cancelled()

    def _contained(self, request_id: str, action, *args) -> None:
        """Run one request's action; if it raises, that request alone ends with an error (and is aborted)."""
        try:
            action(*args)
        except Exception as exc:
            log.exception("response handling failed for request %s", request_id)
            self._end_with_error(request_id, exc)

    def _end_with_error(self, request_id: str, exc: Exception) -> None:
        with self.lock:
            p = self.pending.pop(request_id, None)
        if p is not None:
            self.abort(request_id)
            self.send_exception(p.sender, exc, request_id)

    def _absorb(self, out, touched: dict) -> None:
        with self.lock:
            p = self.pending.get(out.request_id)
        if p is None:
            return
        if out.error is not None:
            with self.lock:
                self.pending.pop(out.request_id, None)
            touched.pop(out.request_id, None)
            self.send_exception(p.sender, out.error, out.request_id)
            return
        i = out.index
        if out.text:
            p.texts[i].append(out.text)
        p.num_tokens[i] += len(out.token_ids)
        p.cumulative[i] = out.cumulative_logprob
        p.num_input_tokens = out.num_input_tokens
        if out.logprobs:
            p.logprobs[i] += out.logprobs
        if out.finished:
            p.finish[i] = out.finish_reason
        touched[out.request_id] = p

    def _flush(self, request_id: str, p: Pending) -> None:
        with self.lock:
            if self.pending.get(request_id) is not p:  # ended meanwhile (an error was sent)
                return
        done = all(f is not None for f in p.finish)
        if not p.stream and not done:
            return
        if p.stream and not done and self._holds(p):
            return
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if done else 0
        response = self._response(p, done)  # raising here ends the request with an error (see _contained)
        try:
            p.sender.send(response, flags=flags)
        except Exception:  # the client went away: stop generating for it
            log.warning("send failed for request %s; aborting it", request_id, exc_info=True)
            if not done:
                self.abort(request_id)
            done = True
        if done:
            with self.lock:
                self.pending.pop(request_id, None)
        else:
            p.streamed = True
            p.reset_deltas()

    def _holds(self, p: Pending) -> bool:
        """A stream's next response waits: nothing new yet, or fewer than stream_interval tokens after its first."""
        if not any(p.texts) and not any(p.num_tokens):
            return True
        return p.streamed and max(p.num_tokens) < self.stream_interval

    def _response(self, p: Pending, done: bool):
        pb = self.pb
        texts = ["".join(t) if p.exclude_input else "".join([p.prompt, *t]) for t in p.texts]
        tensors = [pb.Tensor("text_output", np.array([t.encode("utf-8") for t in texts], dtype=np.object_))]
        r = p.returns
        if r["return_finish_reason"]:
            reasons = [str(f) if f is not None else "None" for f in p.finish]
            tensors.append(pb.Tensor("finish_reason", np.array([s.encode() for s in reasons], dtype=np.object_)))
        if r["return_cumulative_logprob"]:
            tensors.append(pb.Tensor("cumulative_logprob", np.array(p.cumulative, dtype=np.float32)))
        if r["return_logprobs"]:
            blobs = [json.dumps(self._logprobs_json(lp)).encode() for lp in p.logprobs]
            tensors.append(pb.Tensor("logprobs", np.array(blobs, dtype=np.object_)))
        if r["return_num_input_tokens"]:
            tensors.append(pb.Tensor("num_input_tokens", np.array([p.num_input_tokens], dtype=np.uint32)))
        if r["return_num_output_tokens"]:
            tensors.append(pb.Tensor("num_output_tokens", np.array(p.num_tokens, dtype=np.uint32)))
        return pb.InferenceResponse(output_tensors=tensors)

    def _logprobs_json(self, entries: list) -> list | None:
        """vllm_backend's shape: per token, {token_id: {logprob, rank, decoded_token}}."""
        if not entries:
            return None
        result = []
        for e in entries:
            token_id, logprob, rank = e["token"]
            item = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": self.decode_token(token_id)}}
            for k, (tid, lp) in enumerate(e["top"], start=1):
                item.setdefault(str(tid), {"logprob": lp, "rank": k, "decoded_token": self.decode_token(tid)})
            result.append(item)
        return result

    def send_exception(self, sender, exc: Exception, request_id: str | None = None) -> None:
        """An error response for an exception (errors.client_error's message and code) with the FINAL flag."""
        try:
            self.send_error(sender, *client_error(self.pb, exc, request_id))
        except Exception:
            log.exception("could not send error response")

    def _poll_cancelled(self) -> None:
        with self.lock:
            due = [(request_id, self.pending[request_id])
                   for request_id in self.cancel_polls.due(time.monotonic(), self.pending)]
        for request_id, p in due:
            if p.abort_requested:
                continue
            try:
                cancelled = p.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - a sender that cannot answer is a client gone
                cancelled = True
            if cancelled:
                p.abort_requested = True
                self.abort(request_id)
        with self.lock:
            self.cancel_polls.keep(request_id for request_id, p in due if not p.abort_requested)


class CancelPolls:
    """Which requests to ask is_cancelled() now: each about every CANCEL_POLL_SECONDS, round robin,
    at most CANCEL_POLLS_PER_SECOND in all. Each ask is an IPC round trip to tritonserver, so the asks
    must grow with time, not with the requests pending (decision 022)."""

    def __init__(self, interval: float = CANCEL_POLL_SECONDS, rate: float = CANCEL_POLLS_PER_SECOND):
        self.interval, self.rate = interval, rate
        self.order: deque = deque()  # request ids, least recently asked first
        self.credit, self.last = 0.0, None

    def add(self, request_id: str) -> None:
        """A new request: asked first."""
        self.order.appendleft(request_id)

    def due(self, now: float, pending: dict) -> list:
        """The ids to ask now, taken out of the order (put the ones still live back with keep()).
        Ids no longer pending drop out on the way, free."""
        elapsed, self.last = (0.0 if self.last is None else now - self.last), now
        live = len(pending)
        self.credit = min(self.credit + elapsed * min(self.rate, live / self.interval), max(live, 1))
        taken = []
        while self.order and len(taken) < int(self.credit):
            request_id = self.order.popleft()
            if request_id in pending:
                taken.append(request_id)
        self.credit -= len(taken)
        return taken

    def keep(self, request_ids) -> None:
        """Ask these again after the others."""
        self.order.extend(request_ids)
